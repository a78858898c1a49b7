"""LoRA adapter folders checked against a base model folder, from the files' bytes alone.

Owns the safetensors header format and PEFT's LoRA folder layout (adapter_config.json,
adapter_model.safetensors). Knows nothing about torch, loading or serving: stdlib only.
"""

from __future__ import annotations

import json
import math
import re
import stat
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

MAX_HEADER_BYTES = 100 * 1024 * 1024  # safetensors' own limit
DTYPE_SIZES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
    "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1,
}  # fmt: skip
# The exponent bits within the top 16 bits of a float: all ones means infinity or NaN.
_EXPONENT_MASKS = {"F64": 0x7FF0, "F32": 0x7F80, "BF16": 0x7F80, "F16": 0x7C00}
ADAPTER_DTYPES = frozenset(_EXPONENT_MASKS)  # float dtypes PEFT writes and loads
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# PEFT's save_pretrained removes the adapter name: `base_model.model.<module>.lora_A.weight`.
_LORA_KEY = re.compile(r"base_model\.model\.(?P<module>.+)\.lora_(?P<half>[AB])\.weight")


class InvalidFile(ValueError):
    """A folder or file that cannot be used; str() is one line: `<file>: <what is wrong>`."""

    def __init__(self, path: Path | str, problem: str) -> None:
        self.path = Path(path)
        self.problem = " ".join(problem.split())
        super().__init__(f"{self.path}: {self.problem}")


class InvalidAdapter(InvalidFile):
    """An adapter folder or file that cannot be loaded."""


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a safetensors file; `begin`/`end` are byte offsets into the data buffer."""

    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


def read_safetensors_header(path: Path) -> dict[str, TensorInfo]:
    """The tensors of a safetensors file, by name, after checking the whole file's layout.

    Guarantees on return: every dtype is known, each tensor's byte size matches its dtype and
    shape, the tensors tile the data buffer exactly (no gap, no overlap), and the file is
    exactly as long as its header says (a truncated or half-written file is refused).
    Raises InvalidAdapter naming `path` otherwise. Reads the header only, not the data.
    """
    path = Path(path)
    try:
        with path.open("rb") as f:
            size = path.stat().st_size
            header, header_len = _read_header_json(f, path, size)
    except OSError as exc:
        raise InvalidAdapter(path, f"cannot read: {exc.strerror or exc}") from None
    tensors = {name: _tensor_info(path, name, entry) for name, entry in header.items() if name != "__metadata__"}
    if not isinstance(header.get("__metadata__", {}), dict):
        raise InvalidAdapter(path, "the header's __metadata__ is not a JSON object")
    buffer_len = size - 8 - header_len
    expected = 0
    for name, info in sorted(tensors.items(), key=lambda item: (item[1].begin, item[1].end)):
        if info.begin != expected:
            how = "overlaps the previous tensor" if info.begin < expected else "leaves a gap before it"
            raise InvalidAdapter(path, f"tensor {name!r} begins at byte {info.begin} and {how} (ends at {expected})")
        expected = info.end
    if expected > buffer_len:
        raise InvalidAdapter(
            path,
            f"file is truncated or half-written: it is {size} bytes, its header describes {8 + header_len + expected}")
    if expected < buffer_len:
        raise InvalidAdapter(
            path, f"file has {buffer_len - expected} trailing bytes after the tensors its header describes")
    return tensors


def _read_header_json(f: BinaryIO, path: Path, size: int) -> tuple[dict[str, Any], int]:
    prefix = f.read(8)
    if len(prefix) < 8:
        raise InvalidAdapter(path, f"file is {size} bytes, too short for a safetensors header")
    (header_len,) = struct.unpack("<Q", prefix)
    if header_len > MAX_HEADER_BYTES:
        raise InvalidAdapter(path, f"header length {header_len} is absurd (over {MAX_HEADER_BYTES}): not safetensors")
    if 8 + header_len > size:
        raise InvalidAdapter(
            path, f"file is truncated or not safetensors: header length {header_len} exceeds the file's {size} bytes")
    raw = f.read(header_len)
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except (UnicodeDecodeError, ValueError) as exc:
        raise InvalidAdapter(path, f"header is not valid JSON ({exc})") from None
    if not isinstance(header, dict):
        raise InvalidAdapter(path, f"header is a JSON {type(header).__name__}, not an object")
    return header, header_len


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def _tensor_info(path: Path, name: str, entry: Any) -> TensorInfo:
    def bad(problem: str) -> InvalidAdapter:
        return InvalidAdapter(path, f"tensor {name!r}: {problem}")

    if not isinstance(entry, dict):
        raise bad("its header entry is not a JSON object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in DTYPE_SIZES:
        raise bad(f"unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise bad(f"shape {shape!r} is not a list of non-negative integers")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_count(o) for o in offsets)):
        raise bad(f"data_offsets {offsets!r} is not [begin, end]")
    begin, end = offsets
    if end < begin:
        raise bad(f"data_offsets {offsets!r} end before they begin")
    nbytes = math.prod(shape) * DTYPE_SIZES[dtype]
    if end - begin != nbytes:
        raise bad(f"holds {end - begin} bytes, but {dtype} {tuple(shape)} needs {nbytes}")
    return TensorInfo(dtype, tuple(shape), begin, end)


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _read_json_object(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_bytes())
    except FileNotFoundError:
        raise InvalidAdapter(path, "missing") from None
    except OSError as exc:
        raise InvalidAdapter(path, f"cannot read: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise InvalidAdapter(path, f"not valid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise InvalidAdapter(path, f"holds a JSON {type(value).__name__}, not an object")
    return value


@dataclass(frozen=True)
class _Base:
    """A base model as headers show it: Linear shapes, every module name, and a label."""

    linears: dict[str, tuple[int, int]]
    modules: frozenset[str]
    label: str


def base_linear_shapes(model_dir: Path) -> dict[str, tuple[int, int]]:
    """(out_features, in_features) of every Linear layer of an HF model folder, by module name.

    A Linear layer is a module with a 2-D `weight` in the model's safetensors shards (those of
    `model.safetensors.index.json` when present), embeddings excepted; a tied `lm_head` of a
    `*ForCausalLM` counts too. Reads config.json and the shards' headers only.
    """
    return _read_base(Path(model_dir)).linears


def _read_base(model_dir: Path) -> _Base:
    config = _read_json_object(model_dir / "config.json")
    archs: list[Any] = config.get("architectures") or []
    if not isinstance(archs, list):
        raise InvalidAdapter(model_dir / "config.json", f"architectures {archs!r} is not a list")
    kind = config.get("model_type") or (archs[0] if archs else "unknown type")
    label = f"the base model {model_dir.name} ({kind})"
    tensors: dict[str, TensorInfo] = {}
    for file in _weight_files(model_dir):
        tensors.update(read_safetensors_header(file))
    linears: dict[str, tuple[int, int]] = {}
    modules: set[str] = set()
    embeddings: list[tuple[int, ...]] = []
    for name, info in tensors.items():
        module, _, param = name.rpartition(".")
        parts = module.split(".")
        modules.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
        if param == "weight" and len(info.shape) == 2:
            if _is_embedding(parts[-1]):
                embeddings.append(info.shape)
            else:
                linears[module] = (info.shape[0], info.shape[1])
    tied = config.get("tie_word_embeddings", True) is not False
    causal = any(isinstance(a, str) and a.endswith("ForCausalLM") for a in archs)
    vocab = [shape for shape in embeddings if shape[0] == config.get("vocab_size")]
    if "lm_head" not in linears and tied and causal and len(vocab) == 1:
        linears["lm_head"] = (vocab[0][0], vocab[0][1])
        modules.add("lm_head")
    return _Base(linears, frozenset(modules), label)


def _is_embedding(leaf: str) -> bool:
    return "embed" in leaf or leaf in ("wte", "wpe")


def _weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = _read_json_object(index).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise InvalidAdapter(index, "weight_map is not an object of file names")
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    single = model_dir / "model.safetensors"
    files = [single] if single.is_file() else sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise InvalidAdapter(model_dir, "no *.safetensors weights in the base model folder")
    return files


def check_adapter(adapter_dir: Path, model_dir: Path) -> list[str]:
    """Raise InvalidAdapter unless `adapter_dir` is a PEFT LoRA adapter that `model_dir` can take.

    Guarantees on return: the folder holds only regular files; adapter_config.json is a plain
    LoRA config (integer r >= 1, no DoRA, no modules_to_save) whose target_modules match only
    Linear layers of the base; adapter_model.safetensors is intact and holds, for at least one
    targeted Linear, a float lora_A (r, in_features) and lora_B (out_features, r) pair
    (r from rank_pattern where it names the module), all finite. Returns warnings, e.g. a
    `base_model_name_or_path` that names another model. Never imports torch.
    """
    adapter_dir, model_dir = Path(adapter_dir), Path(model_dir)
    _check_entries(adapter_dir)
    config_path = adapter_dir / ADAPTER_CONFIG
    config = _read_json_object(config_path)
    rank_of = _lora_ranks(config_path, config)
    base = _read_base(model_dir)
    targeted = _targeted_modules(config_path, config.get("target_modules"), base)
    weights = adapter_dir / ADAPTER_WEIGHTS
    if not weights.is_file():
        if (adapter_dir / "adapter_model.bin").is_file():
            raise InvalidAdapter(
                adapter_dir / "adapter_model.bin", f"only safetensors adapters are accepted ({ADAPTER_WEIGHTS})")
        raise InvalidAdapter(weights, "missing")
    tensors = read_safetensors_header(weights)
    _check_tensors(weights, tensors, base, targeted, rank_of)
    _check_finite(weights, tensors)
    warnings = []
    named = config.get("base_model_name_or_path")
    if isinstance(named, str) and named and named != str(model_dir) and Path(named).name != model_dir.resolve().name:
        warnings.append(f"adapter was trained on {named!r}, the base model is {str(model_dir)!r}")
    return warnings


def _check_entries(adapter_dir: Path) -> None:
    if not adapter_dir.is_dir():
        raise InvalidAdapter(adapter_dir, "not a folder")
    for entry in sorted(adapter_dir.iterdir()):
        mode = entry.lstat().st_mode
        if stat.S_ISLNK(mode):
            raise InvalidAdapter(entry, "is a symlink; an adapter folder holds regular files only")
        if not stat.S_ISREG(mode):
            raise InvalidAdapter(entry, "is not a regular file; an adapter folder holds regular files only")


def _lora_ranks(path: Path, config: dict[str, Any]) -> dict[str, int]:
    """Validate the config's LoRA fields; return {"": r, pattern: rank, ...} (rank_pattern)."""
    if config.get("peft_type") != "LORA":
        raise InvalidAdapter(path, f"peft_type is {config.get('peft_type')!r}; only LORA adapters are accepted")
    if config.get("use_dora"):
        raise InvalidAdapter(path, "use_dora is set; DoRA adapters are not supported")
    if config.get("modules_to_save"):
        raise InvalidAdapter(path, f"modules_to_save is set ({config['modules_to_save']!r}); it is not supported")
    pattern_ranks = config.get("rank_pattern") or {}
    if not isinstance(pattern_ranks, dict):
        raise InvalidAdapter(path, "rank_pattern is not an object of pattern -> rank")
    ranks = {"": config.get("r"), **pattern_ranks}
    for pattern, r in ranks.items():
        where = f"rank_pattern[{pattern!r}]" if pattern else "r"
        if not _is_count(r) or r < 1:
            raise InvalidAdapter(path, f"{where} is {r!r}; the LoRA rank must be an integer >= 1")
        try:
            re.compile(pattern)
        except re.error as exc:
            raise InvalidAdapter(path, f"{where} is not a valid regex ({exc})") from None
    return ranks


def module_value(module: str, values: dict[str, Any]) -> Any:
    """PEFT's rule (`get_pattern_key`) for rank_pattern and alpha_pattern: the value of the first pattern key
    matching a suffix of the module's name, else the default under ""."""
    for pattern, value in values.items():
        if pattern and re.match(rf"(.*\.)?({pattern})$", module):
            return value
    return values[""]


def _targeted_modules(path: Path, targets: Any, base: _Base) -> frozenset[str]:
    """The Linear layers `target_modules` selects, by PEFT's matching; every match must be Linear."""
    if targets == "all-linear":
        return frozenset(name for name in base.linears if name != "lm_head")
    if isinstance(targets, str):
        try:
            pattern = re.compile(targets)
        except re.error as exc:
            raise InvalidAdapter(path, f"target_modules {targets!r} is not a valid regex ({exc})") from None
        groups = {targets: [m for m in base.modules if pattern.fullmatch(m)]}
    elif isinstance(targets, list) and targets and all(isinstance(t, str) and t for t in targets):
        groups = {t: [m for m in base.modules if m == t or m.endswith("." + t)] for t in targets}
    else:
        raise InvalidAdapter(path, f"target_modules {targets!r} is neither a regex nor a list of module names")
    for target, matched in sorted(groups.items()):
        if not matched:
            raise InvalidAdapter(path, f"target module {target!r} matches no module of {base.label}")
        other = sorted(m for m in matched if m not in base.linears)
        if other:
            raise InvalidAdapter(
                path, f"target module {target!r} matches {other[0]!r}, not a Linear layer of {base.label}")
    return frozenset(m for matched in groups.values() for m in matched)


def _check_tensors(
    path: Path, tensors: dict[str, TensorInfo], base: _Base, targeted: frozenset[str], ranks: dict[str, int]) -> None:
    if not tensors:
        raise InvalidAdapter(path, "holds no tensors")
    halves: dict[str, set[str]] = {}
    for key, info in sorted(tensors.items()):
        match = _LORA_KEY.fullmatch(key)
        if match is None:
            raise InvalidAdapter(path, f"unexpected tensor {key!r}; only base_model.model.<module>.lora_A/B.weight")
        module, half = match["module"], match["half"]
        if module not in base.linears:
            raise InvalidAdapter(path, f"tensor {key!r}: {module!r} is not a Linear layer of {base.label}")
        if module not in targeted:
            raise InvalidAdapter(path, f"tensor {key!r}: {module!r} is not in target_modules (PEFT would ignore it)")
        if info.dtype not in ADAPTER_DTYPES:
            raise InvalidAdapter(
                path, f"tensor {key!r} is {info.dtype}; LoRA weights must be one of {sorted(ADAPTER_DTYPES)}")
        out_features, in_features = base.linears[module]
        r = module_value(module, ranks)
        want = (r, in_features) if half == "A" else (out_features, r)
        if info.shape != want:
            raise InvalidAdapter(path, f"tensor {key!r} has shape {info.shape}, {base.label} needs {want} (rank {r})")
        halves.setdefault(module, set()).add(half)
    for module, seen in sorted(halves.items()):
        if seen != {"A", "B"}:
            (has,) = seen
            lacks = "B" if has == "A" else "A"
            raise InvalidAdapter(path, f"{module!r} has lora_{has} but no lora_{lacks}")


def _check_finite(path: Path, tensors: dict[str, TensorInfo]) -> None:
    """Refuse NaN or infinity in any float tensor (reads the data, one tensor at a time)."""
    with path.open("rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        for name, info in sorted(tensors.items(), key=lambda item: item[1].begin):
            if info.dtype not in _EXPONENT_MASKS:
                continue
            f.seek(8 + header_len + info.begin)
            index = _first_nonfinite(f.read(info.end - info.begin), info.dtype)
            if index is not None:
                raise InvalidAdapter(path, f"tensor {name!r} holds a non-finite value (NaN or inf) at element {index}")


_HAS_BITS = {m: bytes(int(b & m == m) for b in range(256)) for m in {0x7F, 0x7C, 0x80, 0xF0}}


def _first_nonfinite(data: bytes, dtype: str) -> int | None:
    """The index of the first NaN or infinity in little-endian `data` of a float dtype, else None.

    A value is non-finite when its exponent bits are all ones; they sit in the top two bytes of
    each element, so the check runs as bytes.translate and one big-int AND (C speed, ~1 ms/MB).
    """
    size, mask = DTYPE_SIZES[dtype], _EXPONENT_MASKS[dtype]
    hits = data[size - 1 :: size].translate(_HAS_BITS[mask >> 8])
    if mask & 0xFF:
        low = data[size - 2 :: size].translate(_HAS_BITS[mask & 0xFF])
        both = int.from_bytes(hits, "little") & int.from_bytes(low, "little")
        if not both:
            return None
        return ((both & -both).bit_length() - 1) // 8
    index = hits.find(1)
    return None if index < 0 else index
