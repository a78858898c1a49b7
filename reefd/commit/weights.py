"""Full-weights model folders checked against the base model they would replace, from the files' bytes alone.

Owns the rules a full HF model folder (config, tokenizer, safetensors weights) must meet to stand in for the base
model in a running engine. Reads headers and data with reefd.commit.adapters' safetensors reader; stdlib only, no torch.
"""

from __future__ import annotations

import hashlib
import json
import stat
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from reefd.commit.adapters import (
    InvalidAdapter,
    InvalidFile,
    TensorInfo,
    _check_finite,
    _read_json_object,
    _weight_files,
    read_safetensors_header,
)

WEIGHT_DTYPES = ("F32", "F16", "BF16")  # what an engine loads full weights from (and casts to its own dtype)
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Keys that fix the tensors' shapes or how the engine wires them: a release must match the base on each.
SHAPE_KEYS = (
    "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size",
    "head_dim", "tie_word_embeddings", "max_position_embeddings")  # fmt: skip
# The files a tokenizer is loaded from; the engine keeps the base's tokenizer, so a release must carry it unchanged.
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model", "vocab.json", "merges.txt",
    "added_tokens.json", "chat_template.jinja")  # fmt: skip
PICKLE_SUFFIXES = (".bin", ".pt", ".pth")  # torch pickles: loading one runs code, so they are never accepted
_LISTED = 5  # tensor names quoted in a message about missing or extra tensors
OBJECTIVE_FOLDER = "objective"  # a trained candidate's objective state (reefd.train), beside the weights


class InvalidWeights(InvalidFile):
    """A weights folder or file that cannot replace the base model; str() is one line: `<file>: <what is wrong>`."""


@contextmanager
def _as_invalid_weights() -> Iterator[None]:
    """The safetensors and JSON readers of reefd.commit.adapters raise InvalidAdapter; here it reads as
    InvalidWeights."""
    try:
        yield
    except InvalidAdapter as exc:
        raise InvalidWeights(exc.path, exc.problem) from None


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files of a full-weights folder: the shards its model.safetensors.index.json lists, else
    model.safetensors. Raises InvalidWeights when the index is malformed or names a shard that is missing, when
    neither file is there, and when another *.safetensors file is there (engines differ on loading it)."""
    with _as_invalid_weights():
        return _weights(Path(folder))[0]


def _weights(folder: Path) -> tuple[list[Path], dict[str, str] | None]:
    """weight_files() and the index's weight_map (tensor -> shard file name; None without an index)."""
    weight_map = _index_map(folder)
    names = sorted(set(weight_map.values())) if weight_map is not None else [SINGLE_FILE]
    for name in names:
        if not (folder / name).is_file():
            why = f"listed in {INDEX_FILE}" if weight_map is not None else f"and there is no {INDEX_FILE} either"
            raise InvalidWeights(folder / name, f"missing ({why})")
    stray = sorted(p.name for p in folder.glob("*.safetensors") if p.name not in names)
    if stray:
        why = f"not listed in {INDEX_FILE}" if weight_map is not None else f"a second weights file beside {SINGLE_FILE}"
        raise InvalidWeights(folder / stray[0], f"is {why}; engines differ on whether they load it")
    return [folder / name for name in names], weight_map


def _index_map(folder: Path) -> dict[str, str] | None:
    """The index's weight_map (tensor -> shard file name), or None for a single-file folder."""
    index = folder / INDEX_FILE
    if not index.exists():
        return None
    weight_map = _read_json_object(index).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map or not all(isinstance(v, str) for v in weight_map.values()):
        raise InvalidAdapter(index, "weight_map is not a non-empty object of tensor name -> shard file name")
    for shard in sorted(set(weight_map.values())):
        if Path(shard).name != shard or not shard.endswith(".safetensors"):
            raise InvalidAdapter(index, f"weight_map names shard {shard!r}, not a *.safetensors file of this folder")
    return weight_map


def check_weights(folder: Path, model_dir: Path) -> list[str]:
    """Raise InvalidWeights unless `folder` is a full HF model folder that can replace the base at `model_dir`.

    Guarantees on return: the folder holds regular files only (and an `objective/` folder of them); its
    config.json has the base's model_type, architectures and shape keys (SHAPE_KEYS); it carries every tokenizer
    file of the base byte for byte and no other; its weights are safetensors only (model.safetensors, or the intact
    shards its index maps tensor by tensor), holding exactly the base's tensor names and shapes, each F32, F16 or
    BF16 and all finite. Returns warnings, e.g. a file stored in another dtype than the base's. Reads the whole of
    every weight file.
    """
    folder, model_dir = Path(folder), Path(model_dir)
    with _as_invalid_weights():
        _check_entries(folder)
        _check_config(
            folder / "config.json", _read_json_object(folder / "config.json"),
            _read_json_object(model_dir / "config.json"))
        _check_tokenizer(folder, model_dir)
        files, tensors = _read_weights(folder)
        base: dict[str, TensorInfo] = {}
        for file in _weight_files(model_dir):
            base.update(read_safetensors_header(file))
        where = folder / (SINGLE_FILE if len(files) == 1 and files[0].name == SINGLE_FILE else INDEX_FILE)
        warnings = _check_tensors(where, tensors, base)
        for file in files:
            _check_finite(file, tensors[file])
    return warnings


def _check_entries(folder: Path, nested: bool = False) -> None:
    """Regular files only, and one folder: OBJECTIVE_FOLDER, the trainer objective's own state (a critic, say),
    which engines never read (they load the top level's weight files)."""
    if not folder.is_dir():
        raise InvalidWeights(folder, "not a folder")
    for entry in sorted(folder.iterdir()):
        mode = entry.lstat().st_mode
        if stat.S_ISLNK(mode):
            raise InvalidWeights(entry, "is a symlink; a weights folder holds regular files only")
        if stat.S_ISDIR(mode) and entry.name == OBJECTIVE_FOLDER and not nested:
            _check_entries(entry, nested=True)
            continue
        if not stat.S_ISREG(mode):
            raise InvalidWeights(entry, "is not a regular file; a weights folder holds regular files only "
                                        f"(and its {OBJECTIVE_FOLDER}/ folder)")


def _check_config(path: Path, config: dict[str, Any], base: dict[str, Any]) -> None:
    for key in ("model_type", "architectures", *SHAPE_KEYS):
        value, base_value = _config_value(config, key), _config_value(base, key)
        if value == base_value:
            continue
        if value is None:
            raise InvalidWeights(path, f"{key} is missing, the base model's is {json.dumps(base_value)}")
        if base_value is None:
            raise InvalidWeights(path, f"{key} is {json.dumps(value)}, the base model has none")
        raise InvalidWeights(path, f"{key} is {json.dumps(value)}, the base model's is {json.dumps(base_value)}")


def _config_value(config: dict[str, Any], key: str) -> Any:
    """A config's value for `key`; the two keys transformers derives when absent are derived the same way."""
    value = config.get(key)
    if value is None and key == "num_key_value_heads":
        return config.get("num_attention_heads")
    if value is None and key == "head_dim":
        hidden, heads = config.get("hidden_size"), config.get("num_attention_heads")
        if isinstance(hidden, int) and isinstance(heads, int) and heads > 0:
            return hidden // heads
    return value


def _check_tokenizer(folder: Path, model_dir: Path) -> None:
    keep = "a weights release must keep the base model's tokenizer"
    for name in TOKENIZER_FILES:
        mine, theirs = folder / name, model_dir / name
        if not theirs.is_file():
            if mine.exists():
                raise InvalidWeights(mine, f"is a tokenizer file the base model does not have: {keep}")
        elif not mine.exists():
            raise InvalidWeights(mine, f"missing; the base model has it and {keep}")
        elif _sha256(mine) != _sha256(theirs):
            raise InvalidWeights(mine, f"differs from the base model's (sha256); {keep}")


def _sha256(path: Path) -> str:
    try:
        with path.open("rb") as f:
            return hashlib.file_digest(f, "sha256").hexdigest()
    except OSError as exc:
        raise InvalidWeights(path, f"cannot read: {exc.strerror or exc}") from None


def _read_weights(folder: Path) -> tuple[list[Path], dict[Path, dict[str, TensorInfo]]]:
    """The weight files and their headers; with an index, each tensor must sit in the one shard the index names."""
    for entry in sorted(folder.iterdir()):
        if entry.name.endswith(PICKLE_SUFFIXES):
            raise InvalidWeights(entry, f"only safetensors weights are accepted ({SINGLE_FILE} or {INDEX_FILE})")
    files, weight_map = _weights(folder)
    tensors = {file: read_safetensors_header(file) for file in files}
    if weight_map is not None:
        seen: dict[str, Path] = {}
        for file, header in tensors.items():
            for name in sorted(header):
                if name in seen:
                    raise InvalidWeights(file, f"tensor {name!r} is also in {seen[name].name}")
                seen[name] = file
                if weight_map.get(name) != file.name:
                    listed = f"maps it to {weight_map[name]}" if name in weight_map else "does not list it"
                    raise InvalidWeights(file, f"holds tensor {name!r}, but {INDEX_FILE} {listed}")
        for name, shard in sorted(weight_map.items()):
            if name not in seen:
                raise InvalidWeights(folder / INDEX_FILE, f"maps tensor {name!r} to {shard}, which does not hold it")
    return files, tensors


def _check_tensors(where: Path, tensors: dict[Path, dict[str, TensorInfo]], base: dict[str, TensorInfo]) -> list[str]:
    names = {name for header in tensors.values() for name in header}
    missing, extra = sorted(base.keys() - names), sorted(names - base.keys())
    if missing or extra:
        parts = [f"{label} {_quoted(found)}" for label, found in (("missing", missing), ("extra", extra)) if found]
        raise InvalidWeights(where, f"tensors differ from the base model's: {'; '.join(parts)}")
    warnings = []
    for file, header in tensors.items():
        changed: Counter[tuple[str, str]] = Counter()
        for name, info in sorted(header.items()):
            if info.dtype not in WEIGHT_DTYPES:
                raise InvalidWeights(file, f"tensor {name!r} is {info.dtype}; weights must be one of {WEIGHT_DTYPES}")
            want = base[name]
            if info.shape != want.shape:
                raise InvalidWeights(file, f"tensor {name!r} has shape {info.shape}, the base model's is {want.shape}")
            if info.dtype != want.dtype:
                changed[info.dtype, want.dtype] += 1
        for (dtype, base_dtype), count in sorted(changed.items()):
            if count == len(header):
                warnings.append(f"{file.name}: stored as {dtype}, the base model as {base_dtype}")
            else:
                some = f"{count} tensor{'s' if count > 1 else ''}"
                warnings.append(f"{file.name}: {some} stored as {dtype}, the base model's as {base_dtype}")
    return warnings


def _quoted(names: list[str]) -> str:
    shown = ", ".join(repr(name) for name in names[:_LISTED])
    return shown if len(names) <= _LISTED else f"{shown} and {len(names) - _LISTED} more"
