"""Reading a checkpoint's small JSON files (config, generation and tokenizer configs)."""
from __future__ import annotations

import json
from pathlib import Path

from ..errors import FuselmError


def read_object(path: Path, missing: dict | None = None) -> dict:
    """The JSON object in `path`, or `missing` where the file does not exist and `missing` is given;
    a one-line error naming the file where it is not valid JSON or not an object."""
    if missing is not None and not path.exists():
        return missing
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:       # JSONDecodeError is a ValueError
        raise FuselmError(f"{path}: invalid JSON ({' '.join(str(e).split())})") from None
    if not isinstance(value, dict):
        raise FuselmError(f"{path}: not a JSON object (a {type(value).__name__})")
    return value
