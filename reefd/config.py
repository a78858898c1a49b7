"""Scenario configs: structured dataclasses, composed by Hydra, validated by JSON Schema.

Owns the YAML contract (keys, defaults, allowed values) and turns any mistake into one
line naming the file and the full key path. Knows nothing about HTTP or engines.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jsonschema
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

ENGINE_KINDS = ["worker", "sglang", "upstream"]
MODEL_SOURCES = ["tiny", "smollm2"]
TOOL_PARSERS = ["hermes"]


@dataclass
class ModelConfig:
    """Which model answers a scenario, and which engine runs it."""

    name: str = field(default="", metadata={"description": "Display name of the model."})
    engine: str = field(
        default="worker",
        metadata={"enum": ENGINE_KINDS, "description": "worker: the embedded engine process; "
                  "sglang: a real SGLang server (launched, or attached by url); "
                  "upstream: an OpenAI-compatible provider."},
    )
    source: str | None = field(
        default=None,
        metadata={"enum": [*MODEL_SOURCES, None],
                  "description": "A built-in model that reefd prepares into STATE/models/<source>."},
    )
    path: str | None = field(
        default=None, metadata={"description": "An HF model folder (overrides source)."}
    )
    url: str | None = field(
        default=None,
        metadata={"description": "sglang: attach to this server instead of launching one. "
                  "upstream: the provider's base URL, e.g. https://api.openai.com/v1."},
    )
    api_key_env: str | None = field(
        default=None, metadata={"description": "upstream: environment variable holding the key."}
    )
    upstream_model: str | None = field(
        default=None, metadata={"description": "upstream: the model name sent to the provider."}
    )
    tool_parser: str = field(
        default="hermes",
        metadata={"enum": TOOL_PARSERS, "description": "How tool calls appear in model output."},
    )
    max_batch: int = field(
        default=8, metadata={"minimum": 1, "description": "Engine batch size (worker)."}
    )
    max_new_tokens: int | None = field(
        default=None, metadata={"minimum": 1,
                                "description": "Caps generation whatever max_tokens a client asks "
                                               "for; the answer then ends with a length stop."}
    )
    context_length: int | None = field(
        default=None, metadata={"minimum": 1,
                                "description": "Prompt plus answer, in tokens (default: the model "
                                               "folder's max_position_embeddings)."}
    )
    launch_args: list[str] = field(
        default_factory=list,
        metadata={"description": "Extra command-line arguments for a launched engine."},
    )
    startup_timeout_s: float = field(
        default=600.0, metadata={"exclusiveMinimum": 0, "description": "Engine start deadline."}
    )


@dataclass
class ServeConfig:
    """Per-scenario serving limits."""

    default_max_tokens: int = field(
        default=512, metadata={"minimum": 1,
                               "description": "Used when an OpenAI request sets no max_tokens."}
    )
    request_timeout_s: float = field(
        default=600.0, metadata={"exclusiveMinimum": 0, "description": "Engine call deadline."}
    )
    temperature: float | None = field(
        default=None, metadata={"minimum": 0, "maximum": 2,
                                "description": "Used when a request sets no temperature "
                                               "(unset: the API's default, 1.0)."}
    )
    top_p: float | None = field(
        default=None, metadata={"exclusiveMinimum": 0, "maximum": 1,
                                "description": "Used when a request sets no top_p."}
    )


@dataclass
class RecipeConfig:
    """How records and reports become a candidate release (Grow)."""

    name: str = field(
        default="record",
        metadata={"description": "A shipped recipe (record, sao, grpo) or a dotted path pkg.mod:Class. "
                                 "record only records and never trains."},
    )
    backend: str = field(
        default="local", metadata={"enum": ["local"],
                                   "description": "Where weight jobs run: local runs `python -m reefd.train` "
                                                  "as a subprocess."},
    )
    params: dict[str, Any] = field(
        default_factory=dict,
        metadata={"description": "The recipe's own settings; each recipe validates them (see recipes/<name>/)."},
    )
    job_timeout_s: float = field(
        default=3600.0, metadata={"exclusiveMinimum": 0, "description": "A training job running longer fails."}
    )


@dataclass
class TriggerConfig:
    """When a scenario's recipe runs (besides `reefctl train`)."""

    every_n_records: int | None = field(
        default=None, metadata={"minimum": 1,
                                "description": "Run once this many eligible records are waiting."},
    )
    interval_s: float | None = field(
        default=None, metadata={"exclusiveMinimum": 0, "description": "Run every this many seconds."}
    )
    cron: str | None = field(
        default=None, metadata={"description": "A crontab expression (minute hour day month weekday)."}
    )


GATE_KINDS = ["always", "holdout", "floor", "paired"]


@dataclass
class GateConfig:
    """How a candidate is judged before it may be published."""

    kind: str = field(
        default="always",
        metadata={"enum": GATE_KINDS,
                  "description": "always: pass; holdout: beat the serving release on held-out tasks by "
                                 "margin; floor: score at least `floor` on the tasks; paired: run each task "
                                 "with the candidate and with the current release, pass iff wins - losses > "
                                 "min_win_margin."},
    )
    tasks: str | None = field(
        default=None,
        metadata={"description": "JSONL task file (relative to the scenarios folder): one object per line "
                                 "with `prompt` (a string or OpenAI messages) and `answer`."},
    )
    scorer: str = field(
        default="exact",
        metadata={"description": "exact (answer == text, stripped), regex (answer is a pattern searched in "
                                 "the text), or a dotted path pkg.mod:fn(text, task) -> float in [0, 1]."},
    )
    margin: float = field(default=0.0, metadata={"description": "holdout: required mean improvement."})
    min_tasks: int = field(default=1, metadata={"minimum": 1, "description": "Fewer tasks: the gate fails."})
    floor: float | None = field(
        default=None, metadata={"description": "floor (and optionally holdout): minimum candidate mean."}
    )
    max_tokens: int = field(default=32, metadata={"minimum": 1, "description": "Answer length per task."})
    temperature: float = field(default=0.0, metadata={"minimum": 0, "maximum": 2,
                                                      "description": "Sampling for both sides (0: greedy)."})
    samples: int = field(default=1, metadata={"minimum": 1, "description": "Answers per task and side."})
    seed: int = field(default=0, metadata={"description": "Sampling seed, the same for both sides."})
    min_win_margin: int = field(default=0, metadata={"description": "paired: wins - losses must exceed this."})
    reuse_current: bool = field(
        default=True,
        metadata={"description": "Weight candidates: take the serving release's per-task scores from the gate "
                                 "that admitted it, when that gate had the same fingerprint (tasks file bytes, "
                                 "scorer and its module's source, sampling, seeds, model settings, reefd "
                                 "version), instead of generating them again (half the gate's work). Only at "
                                 "temperature 0 or on the worker engine, whose seeded sampling is reproducible. "
                                 "false: both sides are generated at every gate."},
    )


@dataclass
class HarnessConfig:
    """The agent harness a scenario ships and evolves: rules, skills, prompts and config."""

    dir: str | None = field(
        default=None,
        metadata={"description": "The base harness folder (relative to the scenarios folder): rules/*.md, "
                                 "skills/<name>/SKILL.md, prompts/*.md, config.yaml. It becomes a release."},
    )
    inject: bool = field(
        default=True, metadata={"description": "Add the rules and the skill catalog to every request's "
                                               "system prompt (the client's own system prompt is kept)."},
    )
    inline_skills: bool = field(
        default=False, metadata={"description": "Inject whole skill bodies, not only names and descriptions."}
    )


RELEASE_ID_PATTERN = r"^r(0|[1-9][0-9]{0,8})-[0-9a-f]{7}$"
CONFLICT_POLICIES = ["discard", "rebase"]


@dataclass
class ReleaseConfig:
    """Which release serves, and what happens to a candidate whose head moved on."""

    pin: str | None = field(
        default=None,
        metadata={"pattern": RELEASE_ID_PATTERN,
                  "description": "Serve this release (e.g. r3-1a2b3c4); null follows the chain's "
                                 "head. Pinning an older release appends a rollback release, since "
                                 "the chain never rewinds; while pinned, publishes are refused."},
    )
    on_conflict: str = field(
        default="discard",
        metadata={"enum": CONFLICT_POLICIES,
                  "description": "A candidate built on a head that has since moved: discard it, or "
                                 "rebase it onto the new head. It never overwrites a newer release."},
    )


@dataclass
class ScenarioConfig:
    """One scenario: a model, how it is served, and which release serves (later: recipe, gates, triggers)."""

    name: str = field(default="", metadata={"description": "Set from the file name."})
    description: str = ""
    model: ModelConfig = field(default_factory=ModelConfig)
    serve: ServeConfig = field(default_factory=ServeConfig)
    release: ReleaseConfig = field(default_factory=ReleaseConfig)
    recipe: RecipeConfig = field(default_factory=RecipeConfig)
    trigger: TriggerConfig = field(default_factory=TriggerConfig)
    gate: GateConfig = field(default_factory=GateConfig)
    harness: HarnessConfig = field(default_factory=HarnessConfig)


class ConfigError(Exception):
    """A scenario that does not compose or validate. str() is the one-line message."""


# ---------------------------------------------------------------- JSON Schema


def _type_schema(tp: Any) -> dict[str, Any]:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        subs = [_type_schema(a) for a in typing.get_args(tp)]
        return {"anyOf": subs}
    if origin is list:
        (item,) = typing.get_args(tp)
        return {"type": "array", "items": _type_schema(item)}
    if origin is dict:
        return {"type": "object"}
    if dataclasses.is_dataclass(tp):
        return dataclass_schema(tp)  # type: ignore[arg-type]
    mapping = {str: "string", int: "integer", float: "number", bool: "boolean",
               type(None): "null"}
    if tp in mapping:
        return {"type": mapping[tp]}
    raise TypeError(f"no JSON Schema for {tp!r}")


def dataclass_schema(cls: type) -> dict[str, Any]:
    """The JSON Schema of a config dataclass: types, enums, bounds, no unknown keys."""
    hints = typing.get_type_hints(cls)
    props: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        sub = _type_schema(hints[f.name])
        meta = dict(f.metadata)
        if "enum" in meta:
            sub = {"enum": meta.pop("enum")}
        sub.update(meta)
        if f.default is not dataclasses.MISSING and not dataclasses.is_dataclass(f.default):
            sub["default"] = f.default
        props[f.name] = sub
    schema: dict[str, Any] = {"type": "object", "properties": props, "additionalProperties": False}
    if cls.__doc__:
        schema["description"] = cls.__doc__.strip()
    return schema


def json_schema() -> dict[str, Any]:
    """The schema of a composed scenario, printed by `reefd schema` for editors."""
    schema = dataclass_schema(ScenarioConfig)
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "Reef scenario (composed)"
    return schema


_VALIDATOR = jsonschema.Draft202012Validator(json_schema())


def _semantic_errors(cfg: dict[str, Any]) -> list[tuple[str, str]]:
    """Cross-field rules that JSON Schema would express only clumsily."""
    m = cfg["model"]
    errs: list[tuple[str, str]] = []
    if m["engine"] == "upstream":
        if not m["url"]:
            errs.append(("model.url", "an upstream model needs its provider's base URL"))
    elif m["engine"] == "worker" and not (m["source"] or m["path"]):
        errs.append(("model", "a worker model needs 'source' or 'path'"))
    elif m["engine"] == "sglang" and not (m["url"] or m["source"] or m["path"]):
        errs.append(("model", "an sglang model needs 'url' to attach to, or 'source'/'path'"))
    return errs


# ---------------------------------------------------------------- composition


def scenario_files(scenarios_dir: Path) -> list[Path]:
    """Scenario files are the YAML files at the top of the folder; sub-folders are groups."""
    return sorted(p for p in scenarios_dir.glob("*.yaml") if p.is_file())


def _one_line(text: str) -> str:
    text = text.split("Config search path")[0]  # Hydra's search-path dump helps nobody here
    return re.sub(r"\s+", " ", text).strip()


def _omegaconf_message(exc: OmegaConfBaseException) -> str:
    key = getattr(exc, "full_key", None) or ""
    msg = str(exc).split("\n")[0]
    unknown = re.match(r"Key '([^']+)' not in '(\w+)'", msg)
    if unknown:
        groups = (ModelConfig, ServeConfig, ReleaseConfig, RecipeConfig, TriggerConfig, GateConfig, HarnessConfig,
                  ScenarioConfig)
        cls = {c.__name__: c for c in groups}.get(unknown.group(2))
        known = [f.name for f in dataclasses.fields(cls)] if cls else []
        hint = difflib.get_close_matches(unknown.group(1), known, n=1)
        msg = "unknown key" + (f" (did you mean '{hint[0]}'?)" if hint else "")
    return f"{key}: {msg}" if key else msg


def compose(path: Path) -> ScenarioConfig:
    """Compose one scenario file with Hydra and validate it; raise ConfigError on any mistake."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from reefd.releases import InvalidName, validate_name

    label = str(path)
    try:
        validate_name(path.stem)
    except InvalidName:
        raise ConfigError(f"{label}: {path.stem!r} is not a usable scenario name (1-64 letters, digits, "
                          "'.', '_' or '-', starting with a letter or digit, no '..')") from None
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(path.parent.resolve()), version_base="1.3"):
            raw = hydra_compose(config_name=path.stem)
    except Exception as exc:  # Hydra's own errors: missing group options, YAML syntax, …
        raise ConfigError(f"{label}: {_one_line(str(exc))}") from exc
    finally:
        GlobalHydra.instance().clear()
    try:
        merged = OmegaConf.merge(OmegaConf.structured(ScenarioConfig), raw)
        merged.name = path.stem
        data = typing.cast(dict[str, Any], OmegaConf.to_container(merged, resolve=True))
    except OmegaConfBaseException as exc:
        raise ConfigError(f"{label}: {_omegaconf_message(exc)}") from exc
    errors = sorted(_VALIDATOR.iter_errors(data), key=lambda e: list(e.absolute_path))
    if errors:
        err = errors[0]
        where = ".".join(str(p) for p in err.absolute_path) or "(top level)"
        raise ConfigError(f"{label}: {where}: {err.message}")
    for where, msg in _semantic_errors(data):
        raise ConfigError(f"{label}: {where}: {msg}")
    cfg = from_dict(data)
    problem = _grow_problem(cfg, path.parent)
    if problem:
        raise ConfigError(f"{label}: {problem}")
    return cfg


def _grow_problem(cfg: ScenarioConfig, scenarios_dir: Path) -> str | None:
    """The recipe's params, the cron expression and the gate's task file, checked now rather than at the
    first job (the recipe, trigger and gate modules own those rules)."""
    from reefd import gates, recipes

    try:
        recipes.build(cfg.recipe.name, cfg.recipe.params)
    except recipes.RecipeError as exc:
        return f"recipe: {exc}" if not str(exc).startswith("recipe.") else str(exc)
    if cfg.trigger.cron is not None:
        from apscheduler.triggers.cron import CronTrigger

        try:
            CronTrigger.from_crontab(cfg.trigger.cron, timezone="UTC")
        except ValueError as exc:
            return f"trigger.cron: {cfg.trigger.cron!r} is not a crontab expression ({exc})"
    gate = gates.check_config(cfg.gate, scenarios_dir)
    if gate is not None:
        return gate if gate.startswith("gate.") else f"gate: {gate}"
    if cfg.harness.dir is not None:
        from reefd.harness import Harness, HarnessError

        try:
            Harness.from_dir(scenarios_dir / cfg.harness.dir)
        except (HarnessError, OSError) as exc:
            return f"harness.dir: {exc}"
    return None


def from_dict(data: dict[str, Any]) -> ScenarioConfig:
    return ScenarioConfig(
        name=data["name"],
        description=data["description"],
        model=ModelConfig(**data["model"]),
        serve=ServeConfig(**data["serve"]),
        release=ReleaseConfig(**data["release"]),
        recipe=RecipeConfig(**data["recipe"]),
        trigger=TriggerConfig(**data["trigger"]),
        gate=GateConfig(**data["gate"]),
        harness=HarnessConfig(**data["harness"]),
    )


def load_all(scenarios_dir: Path) -> dict[str, ScenarioConfig]:
    """Compose every scenario in the folder; the first bad file raises ConfigError."""
    if not scenarios_dir.is_dir():
        raise ConfigError(f"{scenarios_dir}: scenarios folder not found")
    out = {p.stem: compose(p) for p in scenario_files(scenarios_dir)}
    if not out:
        raise ConfigError(f"{scenarios_dir}: no scenario files (*.yaml) found")
    return out


def to_dict(cfg: ScenarioConfig) -> dict[str, Any]:
    return dataclasses.asdict(cfg)
