"""What a base release records about the model it serves: where it is and what its bytes are.

Knows model folders and engine configs; nothing about git or HTTP.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from reefd.engines import ModelConfig

WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.pt", "*.pth")


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def model_identity(cfg: ModelConfig, model_dir: Path | None) -> dict[str, Any]:
    """The model's identity: for a local folder, the sha256 of its weights and tokenizer."""
    ident: dict[str, Any] = {"model": cfg.name, "engine": cfg.engine}
    if model_dir is None:  # a provider's model (or a remote one): where it is, not its bytes
        ident.update({"url": cfg.url, "upstream_model": cfg.upstream_model})
        return ident
    weights = sorted(p for pattern in WEIGHT_PATTERNS for p in model_dir.glob(pattern))
    ident["path"] = str(model_dir)
    ident["weights"] = {p.name: sha256_file(p) for p in weights}
    tokenizer = model_dir / "tokenizer.json"
    ident["tokenizer"] = sha256_file(tokenizer) if tokenizer.exists() else None
    return ident
