"""The trainer job spec: load a JSON file, validate every field (SpecError names its path, e.g. `samples[3].logprobs: 12
values for 13 completion tokens`), return typed dataclasses. Torch-free; knows nothing about models or losses (the
objective a spec names checks its own `settings`).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

TOP_KEYS = {"job", "objective", "settings", "base_model", "init_adapter", "output_dir", "samples", "lora", "optim",
            "seed", "target", "fault", "proof"}
TARGETS = ("lora", "full")
FAULTS = ("crash", "nan", "hang", "hold", "pause")  # tests only: how the trainer fails on purpose
SAMPLE_KEYS = {"receipt", "prompt_ids", "completion_ids", "logprobs", "reward", "group", "reports", "top_ids", "extra",
               "release", "staleness", "stale"}


class SpecError(ValueError):
    """The spec is unusable; the message names the field (the job exits 2)."""


@dataclass(frozen=True)
class Rollout:
    """One scored rollout of the job, exactly as the engine produced it (logprobs may hold None)."""

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float | None]
    reward: float
    group: str | None = None
    receipt: str | None = None
    top_ids: list[list[int]] | None = None  # the engine's top-K token ids at each completion token (K per token)
    extra: dict[str, Any] | None = None  # what the recipe passes its objective about this sample (JSON)
    release: str | None = None  # the release that produced it
    staleness: int | None = None  # releases the job's base is ahead of that one (None: not in the chain)
    stale: bool = False  # past the recipe's max_staleness: its objective importance-weights it


@dataclass(frozen=True)
class LoraSpec:
    """A fresh adapter's shape; ignored when the job continues from `init_adapter`."""

    r: int = field(default=8, metadata={"exclusiveMinimum": 0})
    alpha: int = field(default=16, metadata={"exclusiveMinimum": 0})
    dropout: float = field(default=0.0, metadata={"minimum": 0, "exclusiveMaximum": 1})
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])


@dataclass(frozen=True)
class OptimSpec:
    """AdamW on the LoRA weights: one optimizer step per micro-batch, `epochs` passes over the samples."""

    lr: float = field(default=5e-4, metadata={"exclusiveMinimum": 0})
    weight_decay: float = field(default=0.0, metadata={"minimum": 0})
    epochs: int = field(default=1, metadata={"minimum": 1})
    micro_batch: int = field(default=8, metadata={"minimum": 1})
    max_grad_norm: float = field(default=1.0, metadata={"exclusiveMinimum": 0})
    beta1: float = field(default=0.9, metadata={"minimum": 0, "exclusiveMaximum": 1})  # Adam's moment decays
    beta2: float = field(default=0.999, metadata={"minimum": 0, "exclusiveMaximum": 1})


@dataclass(frozen=True)
class Fault:
    """Tests only: crash (exit 137 after step 1), nan (a non-finite loss), hang (never trains), hold (waits before
    training while the file `hold` exists), pause (waits after each step while it exists)."""

    kind: str
    hold: Path = Path("/nonexistent")


@dataclass(frozen=True)
class TrainSpec:
    job: str
    objective: str  # pkg.mod:Class of the recipe's Objective (reefd/train/objective.py)
    settings: dict[str, Any]  # the objective's own settings, checked against its Settings by the objective loader
    base_model: Path
    init_adapter: Path | None
    output_dir: Path
    samples: list[Rollout]
    lora: LoraSpec
    optim: OptimSpec
    seed: int = 0
    target: str = "lora"  # lora: a PEFT adapter; full: every parameter, written as a full HF model folder
    fault: Fault | None = None  # tests only: the trainer fails on purpose
    # the candidate's fingerprint, computed here once it is saved: {"texts", "max_tokens", "tokenizer"}
    # (reefd/train/fingerprint.py; the daemon's reference computes it when a job leaves it out)
    proof: dict[str, Any] | None = None

    @property
    def steps(self) -> int:
        per_epoch = -(-len(self.samples) // self.optim.micro_batch)
        return per_epoch * self.optim.epochs


def load_spec(path: str | os.PathLike[str]) -> TrainSpec:
    """Read and validate a spec file; raises SpecError (never KeyError/TypeError) on a bad one."""
    try:
        raw = json.loads(Path(path).read_text())
    except OSError as exc:
        raise SpecError(f"cannot read spec {path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise SpecError(f"spec {path} is not JSON: {exc}") from None
    return parse_spec(raw)


def parse_spec(raw: Any) -> TrainSpec:
    obj = _object(raw, "spec", TOP_KEYS)
    for key in ("job", "objective", "base_model", "output_dir", "samples"):
        if key not in obj:
            raise SpecError(f"{key}: missing")
    objective = _str(obj["objective"], "objective")
    if ":" not in objective:
        raise SpecError(f"objective: {objective!r} is not a dotted path pkg.mod:Class")
    samples = [_sample(s, f"samples[{i}]") for i, s in enumerate(_list(obj["samples"], "samples"))]
    if not samples:
        raise SpecError("samples: empty (nothing to train on)")
    seed = obj.get("seed", 0)
    if not _is_int(seed) or seed < 0:
        raise SpecError(f"seed: {seed!r} is not a non-negative integer")
    target = obj.get("target", "lora")
    if target not in TARGETS:
        raise SpecError(f"target: {target!r} is not one of {', '.join(TARGETS)}")
    settings = obj.get("settings") or {}
    if not isinstance(settings, dict):
        raise SpecError(f"settings: expected a JSON object, got {type(settings).__name__}")
    return TrainSpec(
        job=_str(obj["job"], "job"), objective=objective, settings=dict(settings),
        base_model=_model_dir(obj["base_model"]), init_adapter=_adapter_dir(obj.get("init_adapter")),
        output_dir=_output_dir(obj["output_dir"]), samples=samples, lora=block(LoraSpec, obj.get("lora"), "lora"),
        optim=block(OptimSpec, obj.get("optim"), "optim"), seed=seed, target=target,
        fault=parse_fault(obj.get("fault"), "fault"), proof=_proof(obj.get("proof")))


def _proof(raw: Any) -> dict[str, Any] | None:
    if raw is None:
        return None
    obj = _object(raw, "proof", {"texts", "max_tokens", "tokenizer"})
    texts = _list(obj.get("texts"), "proof.texts")
    if not texts or not all(isinstance(t, str) and t for t in texts) or not _is_int(obj.get("max_tokens")) or \
            obj["max_tokens"] < 1:
        raise SpecError("proof: expected {texts: [non-empty strings], max_tokens: a positive integer, tokenizer}")
    return {"texts": list(texts), "max_tokens": obj["max_tokens"], "tokenizer": _str(obj.get("tokenizer"),
                                                                                       "proof.tokenizer")}


def parse_fault(raw: Any, where: str) -> Fault | None:
    """A spec's (or a scenario's `recipe.fault`) fault: {kind: one of FAULTS, hold: a file path}, or None."""
    if raw is None:
        return None
    obj = _object(raw, where, {"kind", "hold"})
    if obj.get("kind") not in FAULTS:
        raise SpecError(f"{where}.kind: {obj.get('kind')!r} is not one of {', '.join(FAULTS)}")
    hold = obj.get("hold")
    return Fault(obj["kind"], Fault.hold if hold is None else Path(_str(hold, f"{where}.hold")))


def _sample(raw: Any, where: str) -> Rollout:
    obj = _object(raw, where, SAMPLE_KEYS)
    for key in ("prompt_ids", "completion_ids", "logprobs", "reward"):
        if key not in obj:
            raise SpecError(f"{where}.{key}: missing")
    prompt = _token_ids(obj["prompt_ids"], f"{where}.prompt_ids")
    completion = _token_ids(obj["completion_ids"], f"{where}.completion_ids")
    logprobs = _list(obj["logprobs"], f"{where}.logprobs")
    if len(logprobs) != len(completion):
        raise SpecError(f"{where}.logprobs: {len(logprobs)} values for {len(completion)} completion tokens")
    for j, lp in enumerate(logprobs):
        if lp is not None and not (_is_number(lp) and math.isfinite(lp) and lp <= 0.0):
            raise SpecError(f"{where}.logprobs[{j}]: {lp!r} is not a log-probability (finite, <= 0) or null")
    reward = obj["reward"]
    if not (_is_number(reward) and math.isfinite(reward)):
        raise SpecError(f"{where}.reward: {reward!r} is not a finite number")
    group = obj.get("group")
    receipt = obj.get("receipt")
    reports = obj.get("reports", [])  # the reports that scored it: bookkeeping, not used in training
    if not (isinstance(reports, list) and all(isinstance(r, str) for r in reports)):
        raise SpecError(f"{where}.reports: expected a list of report ids")
    extra = obj.get("extra")
    if extra is not None and not isinstance(extra, dict):
        raise SpecError(f"{where}.extra: expected a JSON object, got {type(extra).__name__}")
    release, staleness, stale = obj.get("release"), obj.get("staleness"), obj.get("stale", False)
    if staleness is not None and not (_is_int(staleness) and staleness >= 0):
        raise SpecError(f"{where}.staleness: {staleness!r} is not a number of releases (>= 0) or null")
    if not isinstance(stale, bool):
        raise SpecError(f"{where}.stale: {stale!r} is not true/false")
    return Rollout(
        prompt_ids=prompt, completion_ids=completion, logprobs=[None if lp is None else float(lp) for lp in logprobs],
        reward=float(reward), group=None if group is None else _str(group, f"{where}.group"),
        receipt=None if receipt is None else _str(receipt, f"{where}.receipt"),
        top_ids=_top_ids(obj.get("top_ids"), len(completion), f"{where}.top_ids"), extra=extra,
        release=None if release is None else _str(release, f"{where}.release"), staleness=staleness, stale=stale)


def _top_ids(raw: Any, tokens: int, where: str) -> list[list[int]] | None:
    """K token ids per completion token, the same K for every token (None: not captured)."""
    if raw is None:
        return None
    rows = _list(raw, where)
    if len(rows) != tokens:
        raise SpecError(f"{where}: {len(rows)} rows for {tokens} completion tokens")
    out = [_token_ids(row, f"{where}[{j}]") for j, row in enumerate(rows)]
    widths = {len(row) for row in out}
    if len(widths) > 1 or 0 in widths:
        raise SpecError(f"{where}: every row must hold the same number (K >= 1) of token ids, got {sorted(widths)}")
    return out


def block(cls: Any, raw: Any, where: str) -> Any:
    """A settings block (a frozen dataclass with defaults): every key known, every value of its default's type
    (ints widen to float), within the bounds its fields' metadata states (minimum, exclusiveMinimum, maximum,
    exclusiveMaximum)."""
    if raw is None:
        return cls()
    defaults = cls()
    names = {f.name for f in fields(cls)}
    obj = _object(raw, where, names)
    values: dict[str, Any] = {}
    for key, value in obj.items():
        default = getattr(defaults, key)
        path = f"{where}.{key}"
        if isinstance(default, bool):
            if not isinstance(value, bool):
                raise SpecError(f"{path}: {value!r} is not true/false")
        elif isinstance(default, int):
            if not _is_int(value):
                raise SpecError(f"{path}: {value!r} is not an integer")
        elif isinstance(default, float):
            if not (_is_number(value) and math.isfinite(value)):
                raise SpecError(f"{path}: {value!r} is not a finite number")
            value = float(value)
        elif isinstance(default, list):
            items = _list(value, path)
            if not items or not all(isinstance(v, str) and v for v in items):
                raise SpecError(f"{path}: expected a non-empty list of names")
        values[key] = value
    out = cls(**values)
    _check_ranges(out, where)
    return out


_BOUNDS: dict[str, tuple[str, Any]] = {
    "minimum": (">=", lambda v, b: v >= b), "exclusiveMinimum": (">", lambda v, b: v > b),
    "maximum": ("<=", lambda v, b: v <= b), "exclusiveMaximum": ("<", lambda v, b: v < b),
}


def _check_ranges(values: Any, where: str) -> None:
    for f in fields(values):
        for bound, (text, ok) in _BOUNDS.items():
            limit = f.metadata.get(bound)
            value = getattr(values, f.name)
            if limit is not None and value is not None and not ok(value, limit):
                raise SpecError(f"{where}.{f.name}: {value!r} is not {text} {limit}")


def _model_dir(raw: Any) -> Path:
    path = _abs_path(raw, "base_model")
    if not (path / "config.json").is_file():
        raise SpecError(f"base_model: {path} is not a model folder (no config.json)")
    return path


def _adapter_dir(raw: Any) -> Path | None:
    if raw is None:
        return None
    path = _abs_path(raw, "init_adapter")
    if not (path / "adapter_config.json").is_file():
        raise SpecError(f"init_adapter: {path} is not a PEFT adapter folder (no adapter_config.json)")
    return path


def _output_dir(raw: Any) -> Path:
    path = _abs_path(raw, "output_dir")
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise SpecError(f"output_dir: {path} exists and is not an empty folder")
    return path


def _abs_path(raw: Any, where: str) -> Path:
    path = Path(_str(raw, where))
    if not path.is_absolute():
        raise SpecError(f"{where}: {raw!r} is not an absolute path")
    return path


def _object(raw: Any, where: str, known: set[str]) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise SpecError(f"{where}: expected a JSON object, got {type(raw).__name__}")
    unknown = sorted(set(raw) - known)
    if unknown:
        raise SpecError(f"{where}: unknown key {unknown[0]!r} (known: {', '.join(sorted(known))})")
    return raw


def _list(raw: Any, where: str) -> list[Any]:
    if not isinstance(raw, list):
        raise SpecError(f"{where}: expected a list, got {type(raw).__name__}")
    return raw


def _str(raw: Any, where: str) -> str:
    if not isinstance(raw, str) or not raw:
        raise SpecError(f"{where}: expected a non-empty string, got {raw!r}")
    return raw


def _token_ids(raw: Any, where: str) -> list[int]:
    ids = _list(raw, where)
    if not ids:
        raise SpecError(f"{where}: empty")
    for j, token in enumerate(ids):
        if not _is_int(token) or token < 0:
            raise SpecError(f"{where}[{j}]: {token!r} is not a token id")
    return ids


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)
