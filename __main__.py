"""`python -m fuselm`: the same command line as the `fuselm` script."""
import sys

from .cli import main

sys.exit(main())
