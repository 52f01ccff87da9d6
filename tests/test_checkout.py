"""The test suite runs from a checkout under any folder name: the repository root is the package
`fuselm`, and a name that is no identifier (`fuselm-main`, as GitHub's source zip unpacks) used to
make pytest import the root `__init__.py` as a top-level module, failing every test."""
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SKIP = shutil.ignore_patterns(".git", "__pycache__", "*.egg-info", ".hypothesis", ".pytest_cache",
                              ".benchmarks", "bench", "docs")


@pytest.mark.parametrize("folder", ["fuselm-main", "fuselm"])
def test_suite_runs_from_a_checkout_folder_of_any_name(tmp_path, folder):
    """A copy of the tree in `folder` runs a test file through README's `python -m pytest` (each
    test's setup imports the collectors above it: that is where the root package failed)."""
    copy = shutil.copytree(ROOT, tmp_path / folder, ignore=SKIP)
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "tests/test_sampling.py", "-k", "greedy"],
                          cwd=copy, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and "error" not in done.stdout.lower(), done.stdout[-2000:]
