"""A built-in model's folder (`model.source: tiny|smollm2`) as `python -m reefd.worker.prepare` leaves it: complete
once every file a served model needs is there, and for `tiny`, of the current shape. The contract between the engine
that serves a built-in source (reefd/engines/sglang.py) and the process that prepares it; knows nothing about torch.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# The files whose presence marks a folder as a complete model (written last: the marker).
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")

# The tiny model's shape. A prepared folder whose config.json differs is rebuilt (an older build).
TINY_VOCAB = 4096
TINY_CONFIG: dict[str, Any] = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "max_position_embeddings": 65536,  # a coding agent's first turn is ~20-30k tokens
    "tie_word_embeddings": True,
}


def is_complete(folder: Path, source: str | None = None) -> bool:
    """True when `folder` holds every file a served model needs (for `tiny`: of the current shape)."""
    has_template = (folder / "chat_template.jinja").is_file()
    if not (has_template and all((folder / name).is_file() for name in REQUIRED_FILES)):
        return False
    return source != "tiny" or _has_tiny_shape(folder)


def _has_tiny_shape(folder: Path) -> bool:
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return config.get("vocab_size") == TINY_VOCAB and all(config.get(k) == v for k, v in TINY_CONFIG.items())
