"""Scenario configs: structured dataclasses, composed by Hydra, validated by JSON Schema at load.

Owns the scenario's YAML contract and turns any mistake into one line naming the file and the full key path.
The plug points own their parts of it: `model:` is the engines' ModelConfig, `gate:` is checked by the gate kind
it names (reefd/commit/gates), `recipe.params` by the recipe. Knows nothing about HTTP, records or the chain.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jsonschema
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from reefd import engines, moved_keys, plugins, schema
from reefd.commit import gates
from reefd.commit.chain import InvalidName, validate_name
from reefd.engines import ModelConfig
from reefd.engines.kind_configs import DAY_S, MAX_TOKENS
from reefd.engines.proof import DEFAULT_TOLERANCE, PROBE_TEXTS
from reefd.grow import backends, recipes
from reefd.grow.practice import settings as practice
from reefd.grow.practice.settings import PracticeConfig
from reefd.grow.practice.verifiers import VerifierConfig
from reefd.harness import Harness, HarnessError
from reefd.serve.tenancy import UsersConfig
from reefd.train.spec import SpecError, parse_fault

__all__ = ["ConfigError", "ModelConfig", "ReleaseConfig", "ScenarioConfig", "compose", "json_schema", "load_all"]

log = logging.getLogger("reefd.config")


@dataclass
class ServeConfig:
    """Per-scenario serving limits."""

    default_max_tokens: int = field(
        default=512, metadata={"minimum": 1, "maximum": MAX_TOKENS,
                               "description": "Used when an OpenAI request sets no max_tokens."})
    request_timeout_s: float = field(
        default=600.0, metadata={"exclusiveMinimum": 0, "maximum": DAY_S, "description": "Engine call deadline."})
    temperature: float | None = field(
        default=None, metadata={"minimum": 0, "maximum": 2,
                                "description": "Used when a request sets no temperature "
                                               "(unset: the API's default, 1.0)."}
    )
    top_p: float | None = field(
        default=None,
        metadata={"exclusiveMinimum": 0, "maximum": 1, "description": "Used when a request sets no top_p."})
    session_ttl_s: float = field(
        default=900.0, metadata={"exclusiveMinimum": 0, "maximum": 30 * DAY_S,
                                 "description": "An open session with no new turn for this long expires: its "
                                                "last turn then never gets a next state."}
    )


@dataclass
class RecipeConfig:
    """How records and reports become a candidate release (Grow)."""

    name: str = field(
        default="record",
        metadata={"description": "A shipped recipe (record, sao, grpo, skillclaw, openclaw-rl) or a dotted path "
                                 "pkg.mod:Class. record only records and never trains."},
    )
    backend: Any = field(
        default="local",
        metadata={"description": "Where weight jobs run: a kind (local, ray, slime, or pkg.mod:Class), or {kind: "
                                 "KIND, ...its keys} (reefd/grow/backends)."},
    )
    params: dict[str, Any] = field(
        default_factory=dict,
        metadata={"description": "The recipe's own settings; each recipe validates them (see recipes/<name>/)."},
    )
    job_timeout_s: float = field(
        default=3600.0, metadata={"exclusiveMinimum": 0, "maximum": 7 * DAY_S,
                                  "description": "A training job running longer fails."})
    fault: dict[str, Any] | None = field(default=None, metadata={
        "description": "Tests only: the trainer fails on purpose, {kind: crash|nan|hang|hold|pause, hold: FILE}."})


@dataclass
class TriggerConfig:
    """When a scenario's recipe runs (besides `reefctl train`)."""

    every_n_records: int | None = field(
        default=None, metadata={"minimum": 1, "maximum": 10_000_000,
                                "description": "Run once this many eligible records are waiting."})
    interval_s: float | None = field(
        default=None, metadata={"exclusiveMinimum": 0, "maximum": 366 * DAY_S,
                                "description": "Run every this many seconds."})
    cron: str | None = field(
        default=None, metadata={"description": "A crontab expression (minute hour day month weekday)."})


@dataclass
class RetentionConfig:
    """How long a scenario's records are kept. Records a published release learned from are always kept (they are
    its lineage); their reports too."""

    max_age_days: float | None = field(
        default=None,
        metadata={"exclusiveMinimum": 0, "maximum": 36_500,
                  "description": "Delete records older than this many days (null: any age)."})
    max_records: int | None = field(
        default=None, metadata={"minimum": 1,
                                "description": "Keep at most this many records, deleting the oldest first (null: "
                                               "no limit). Records of a published release's lineage are kept "
                                               "beyond it."}
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
        default=False, metadata={"description": "Inject whole skill bodies, not only names and descriptions."})
    prompt: str | None = field(
        default=None, metadata={"pattern": r"^[a-z0-9][a-z0-9_-]{0,63}$", "description": (
            "A prompt of the harness (prompts/<id>.md) applied to every request it serves: its body opens the "
            "text reefd adds to the system prompt, before the rules (with inject). It is a release's text like any "
            "other, so GEPA can evolve it (components: [prompt/<id>]). null: prompts are only delivered.")})


RELEASE_ID_PATTERN = r"^r(0|[1-9][0-9]{0,8})-[0-9a-f]{7}$"
CONFLICT_POLICIES = ["discard", "rebase"]


TRIAL_OUTCOMES = ["promote", "rollback"]


@dataclass
class TrialConfig:
    """What a new release must show on live traffic before it serves everyone (canary or shadow)."""

    share: float = field(
        default=0.0, metadata={"minimum": 0, "maximum": 1,
                               "description": "Share of sessions (chosen sticky by session) on trial; 0: off, a new "
                                              "release serves everyone at once."})
    min_reports: int = field(
        default=50, metadata={"minimum": 2, "maximum": 1_000_000,
                              "description": "Scores each side needs before the test may decide."})
    max_drop: float = field(
        default=0.05, metadata={"minimum": 0,
                                "description": "How far below the previous release the new one may score and still "
                                               "be promoted (in the metric's units)."})
    confidence: float = field(
        default=0.95, metadata={"exclusiveMinimum": 0.5, "exclusiveMaximum": 1,
                                "description": "Of the one-sided test, over all its looks: a decision is wrong with "
                                               "probability at most 1 - confidence."})
    max_age_s: float = field(
        default=86400.0, metadata={"exclusiveMinimum": 0, "maximum": 366 * DAY_S,
                                   "description": "A trial undecided this long after it started is resolved by "
                                                  "on_timeout."})
    on_timeout: str = field(
        default="rollback", metadata={"enum": TRIAL_OUTCOMES,
                                      "description": "What an undecided trial does at max_age_s."})


@dataclass
class CanaryConfig(TrialConfig):
    """A new release serves `share` of the sessions; both sides are scored by their live reports (and judgments)."""

    metric: str = field(
        default="score", metadata={"pattern": r"^(score|metadata\.[A-Za-z0-9_-]+)$",
                                   "description": "The report's number compared: score, or metadata.KEY."})


@dataclass
class ShadowConfig(TrialConfig):
    """A copy of `share` of the sessions' turns goes to the new release; its answer is recorded as a shadow record
    (never returned, never trained on) and scored against the served answer by `scorer`."""

    scorer: str | None = field(
        default=None, metadata={"description": "pkg.mod:fn(record) -> float: scores a record (its messages, the "
                                               "answer last); the served and the shadow answer of a turn are "
                                               "compared pair by pair."})


@dataclass
class ProofConfig:
    """What each engine process must answer, after it loads or swaps to a release and before it serves it: the
    release's greedy tokens and logprobs on these prompts, as a reference computed them (docs/releases.md)."""

    enabled: bool = field(default=True, metadata={"description": "Prove every load and swap (engines that can)."})
    prompts: list[str] = field(default_factory=lambda: list(PROBE_TEXTS), metadata={
        "minItems": 1, "maxItems": 16, "items": {"type": "string", "minLength": 1, "maxLength": 2000},
        "description": "The probe set: texts, tokenized by the base model's tokenizer."})
    max_tokens: int = field(default=8, metadata={"minimum": 1, "maximum": 64,
                                                 "description": "Tokens generated per prompt."})
    tolerance: float = field(default=DEFAULT_TOLERANCE, metadata={
        "exclusiveMinimum": 0, "maximum": 1,
        "description": "How far (nats) a process's logprob may be from the reference's, per token."})


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
    canary: CanaryConfig = field(default_factory=CanaryConfig)
    shadow: ShadowConfig = field(default_factory=ShadowConfig)
    proof: ProofConfig = field(default_factory=ProofConfig)


@dataclass
class ScenarioConfig:
    """One scenario: a model, how it is served, which release serves, and how it grows."""

    name: str = field(default="", metadata={"description": "Set from the file name."})
    description: str = ""
    model: ModelConfig = field(default_factory=ModelConfig)
    serve: ServeConfig = field(default_factory=ServeConfig)
    release: ReleaseConfig = field(default_factory=ReleaseConfig)
    recipe: RecipeConfig = field(default_factory=RecipeConfig)
    trigger: TriggerConfig = field(default_factory=TriggerConfig)
    gate: dict[str, Any] = field(
        default_factory=lambda: {"kind": "always"},
        metadata={"description": "How a candidate is judged before it may be published: `kind` and that kind's "
                                 "own keys (reefd/commit/gates)."})
    harness: HarnessConfig = field(default_factory=HarnessConfig)
    retention: RetentionConfig = field(default_factory=RetentionConfig)
    practice: PracticeConfig = field(default_factory=PracticeConfig)
    users: UsersConfig | None = field(default=None, metadata={
        "description": "Learn per user: a `users:` block (even `users: {}`) names each request's user (a user's "
                       "token, or x-reef-user). null: one release line for everyone."})


class ConfigError(Exception):
    """A scenario that does not compose or validate. str() is the one-line message."""


# ---------------------------------------------------------------- JSON Schema


def json_schema() -> dict[str, Any]:
    """The schema of a composed scenario, printed by `reefd schema` for editors (with each engine and gate kind's
    keys)."""
    out = schema.dataclass_schema(ScenarioConfig)
    out["properties"]["model"] = engines.json_schema()
    out["properties"]["gate"] = gates.json_schema()
    out["properties"]["recipe"]["properties"]["backend"] = backends.json_schema()
    out["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    out["title"] = "Reef scenario (composed)"
    return out


_VALIDATOR = jsonschema.Draft202012Validator(schema.dataclass_schema(ScenarioConfig))  # `gate:` is the gates'


def _semantic_errors(cfg: dict[str, Any]) -> list[tuple[str, str]]:
    """Cross-field rules that JSON Schema would express only clumsily."""
    errs = engines.check(cfg["model"])  # the engine kind's own rules (reefd/engines/kind_configs.py)
    r = cfg["release"]
    if r["canary"]["share"] > 0 and r["shadow"]["share"] > 0:
        errs.append(("release", "a new release is on trial as a canary or as a shadow, not both: set one share to 0"))
    if r["shadow"]["share"] > 0:
        if not r["shadow"]["scorer"]:
            errs.append(("release.shadow.scorer", "a shadow trial compares answers nobody reported on: name a "
                                                  "scorer, pkg.mod:fn(record) -> float"))
        else:
            try:
                if not callable(plugins.resolve({}, r["shadow"]["scorer"], "shadow scorer")):
                    errs.append(("release.shadow.scorer", f"{r['shadow']['scorer']} is not a function"))
            except plugins.PluginError as exc:
                errs.append(("release.shadow.scorer", str(exc)))
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
        groups = (ModelConfig, ServeConfig, ReleaseConfig, RecipeConfig, TriggerConfig, HarnessConfig, RetentionConfig,
                  PracticeConfig, VerifierConfig, UsersConfig, ScenarioConfig)
        cls = {c.__name__: c for c in groups}.get(unknown.group(2))
        known = [f.name for f in dataclasses.fields(cls)] if cls else []
        hint = difflib.get_close_matches(unknown.group(1), known, n=1)
        msg = "unknown key" + (f" (did you mean '{hint[0]}'?)" if hint else "")
    return f"{key}: {msg}" if key else msg


def compose(path: Path, warnings: list[str] | None = None) -> ScenarioConfig:
    """Compose one scenario file with Hydra and validate it; raise ConfigError on any mistake. An old key that
    moved (reefd/moved_keys.py) is read at its new place, with a warning appended to `warnings`, or logged."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

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
        plain = typing.cast(dict[str, Any], OmegaConf.to_container(raw, resolve=False))
        notes = moved_keys.apply(plain)
        merged = OmegaConf.merge(OmegaConf.structured(ScenarioConfig), plain)
        merged.name = path.stem
        data = typing.cast(dict[str, Any], OmegaConf.to_container(merged, resolve=True))
    except OmegaConfBaseException as exc:
        raise ConfigError(f"{label}: {_omegaconf_message(exc)}") from exc
    except (moved_keys.MovedKeyError, plugins.PluginError) as exc:
        raise ConfigError(f"{label}: {exc}") from None
    for note in notes:
        if warnings is None:
            log.warning("%s: %s", label, note)
        else:
            warnings.append(f"{label}: {note}")
    found = schema.first_error(_VALIDATOR, data)
    if found is not None:
        where, message = found
        raise ConfigError(f"{label}: {where or '(top level)'}: {message}")
    for where, msg in _semantic_errors(data):
        raise ConfigError(f"{label}: {where}: {msg}")
    cfg = from_dict(data)
    problem = _grow_problem(cfg, path.parent)
    if problem:
        raise ConfigError(f"{label}: {problem}")
    return cfg


def _grow_problem(cfg: ScenarioConfig, scenarios_dir: Path) -> str | None:
    """The recipe and its params, the trainer backend, the cron expression, the gate (its task file and scorer)
    and the harness folder, checked now rather than at the first job (each plug point owns its rules)."""
    try:
        recipes.build(cfg.recipe.name, cfg.recipe.params)
    except recipes.RecipeError as exc:
        return f"recipe: {exc}" if not str(exc).startswith("recipe.") else str(exc)
    try:
        backends.load(cfg.recipe.backend)
        parse_fault(cfg.recipe.fault, "recipe.fault")
    except (plugins.PluginError, SpecError) as exc:
        return str(exc)
    if cfg.trigger.cron is not None:
        from apscheduler.triggers.cron import CronTrigger

        try:
            CronTrigger.from_crontab(cfg.trigger.cron, timezone="UTC")
        except ValueError as exc:
            return f"trigger.cron: {cfg.trigger.cron!r} is not a crontab expression ({exc})"
    try:
        problem = gates.build(cfg.gate, scenarios_dir).check()
    except gates.GateError as exc:
        problem = str(exc)
    if problem is not None:
        return problem if problem.startswith("gate") else f"gate: {problem}"
    if cfg.users is not None and cfg.users.tasks is not None:
        if "{user}" not in cfg.users.tasks:
            return f"users.tasks: {cfg.users.tasks!r} has no {{user}}, so every user would share one file"
        try:
            gates.build({**cfg.gate, "tasks": cfg.users.tasks}, scenarios_dir)
        except gates.GateError:
            return f"users.tasks: the {cfg.gate.get('kind', 'always')} gate answers no tasks; choose one that does"
    if cfg.harness.dir is not None:
        try:
            harness = Harness.from_dir(scenarios_dir / cfg.harness.dir)
        except (HarnessError, OSError) as exc:
            return f"harness.dir: {exc}"
        if (problem := harness.config_problem()) is not None:
            return f"harness.dir: {problem}"
        if cfg.harness.prompt is not None and ("prompt", cfg.harness.prompt) not in harness:
            return (f"harness.prompt: {cfg.harness.dir}/prompts/{cfg.harness.prompt}.md does not exist (prompts: "
                    f"{', '.join(e.id for e in harness.of_kind('prompt')) or 'none'})")
    elif cfg.harness.prompt is not None:
        return "harness.prompt: set harness.dir, the harness folder the prompt is in"
    return practice.problem(cfg.practice, scenarios_dir)


def from_dict(data: dict[str, Any]) -> ScenarioConfig:
    return ScenarioConfig(
        name=data["name"], description=data["description"],
        model=ModelConfig(**data["model"]), serve=ServeConfig(**data["serve"]),
        release=ReleaseConfig(**{**data["release"], "canary": CanaryConfig(**data["release"]["canary"]),
                                 "shadow": ShadowConfig(**data["release"]["shadow"]),
                                 "proof": ProofConfig(**data["release"]["proof"])}),
        recipe=RecipeConfig(**data["recipe"]), trigger=TriggerConfig(**data["trigger"]), gate=dict(data["gate"]),
        harness=HarnessConfig(**data["harness"]), retention=RetentionConfig(**data["retention"]),
        practice=PracticeConfig(**{**data["practice"], "verifier": VerifierConfig(**data["practice"]["verifier"])}),
        users=None if data["users"] is None else UsersConfig(**data["users"]))


def load_all(scenarios_dir: Path, warnings: dict[str, list[str]] | None = None) -> dict[str, ScenarioConfig]:
    """Compose every scenario in the folder; the first bad file raises ConfigError. Each scenario's warnings go
    to `warnings[name]` when given, else to the log."""
    if not scenarios_dir.is_dir():
        raise ConfigError(f"{scenarios_dir}: scenarios folder not found")
    files = scenario_files(scenarios_dir)
    out = {p.stem: compose(p, None if warnings is None else warnings.setdefault(p.stem, [])) for p in files}
    if not out:
        raise ConfigError(f"{scenarios_dir}: no scenario files (*.yaml) found")
    return out
