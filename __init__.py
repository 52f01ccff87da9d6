"""fuselm: single-GPU LLM inference from a Python op DSL, a fusing graph compiler and NVRTC-compiled CUDA."""
__version__ = "0.1.0"

from .api import load  # noqa: E402  (fuselm.load: the Python API)
from .runtime.engine import SamplingParams  # noqa: E402
