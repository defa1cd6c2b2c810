"""What can be told of a model folder from its files alone, without torch or transformers: that it holds a
config.json, and how many blocks that file declares. The command line checks these before its heavy imports, so a
wrong folder or block range is told at once; the loader (sharding/blocks.py) makes the same checks with the same
words on the config transformers parses."""

from __future__ import annotations

import json
from pathlib import Path

from nesa_node.errors import ModelLoadError

MAX_CONFIG_BYTES = 1 << 20  # a config.json is a few KiB; a larger file is left to transformers' own reading


def config_file(model_path: str | Path) -> Path:
    """The folder's config.json; ModelLoadError when there is none."""
    path = Path(model_path)
    file = path / "config.json"
    if not file.is_file():
        raise ModelLoadError(f"{path} has no config.json; point --model at a Hugging Face model folder")
    return file


def declared_blocks(model_path: str | Path) -> int | None:
    """The block count config.json states as `num_hidden_layers`, or None when the file does not say it plainly
    (missing, large, unreadable, not a JSON object, or another type): transformers then decides."""
    file = config_file(model_path)
    try:
        if file.stat().st_size > MAX_CONFIG_BYTES:
            return None
        value = json.loads(file.read_text(encoding="utf-8")).get("num_hidden_layers")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def check_span(start: int, end: int, num_blocks: int) -> None:
    """ModelLoadError unless blocks [start, end) lie within the model's 0:num_blocks."""
    if not 0 <= start < end <= num_blocks:
        raise ModelLoadError(f"blocks {start}:{end} are outside the model's 0:{num_blocks} range")


__all__ = ["check_span", "config_file", "declared_blocks"]
