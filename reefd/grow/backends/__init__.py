"""Where weight jobs run (`recipe.backend`), on the daemon's side: the TrainerBackend plug point, its optional
abilities, and the registry that builds one backend per kind and settings (`local`: local.py, `ray`: ray_jobs.py,
`slime`: slime.py). Knows nothing about recipes or the chain. Torch-free.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, ClassVar, Protocol, runtime_checkable

from reefd import plugins, schema

log = logging.getLogger("reefd.train")
Event = dict[str, Any]


class TrainerTimeout(Exception):
    pass


class TrainerBackend(Protocol):
    """A kind of place weight jobs run: `recipe.backend: KIND` or `{kind: KIND, KEY: ...}`, the keys of its `Config`
    dataclass (whose constructor raises ValueError naming `recipe.backend.KEY`), built as `Class(work_dir, max_jobs,
    config)`. `run` gets a spec file (reefd/train/spec.py), relays the trainer's JSON events to `on_event` as they
    come, and returns the exit status `python -m reefd.train --spec` would (0: the candidate is complete in the
    spec's output_dir); TrainerTimeout past `timeout_s`, the job stopped. `close` stops what it started. Declared
    abilities: `detachable`, a job outlives reefd (a restart's `run` with the same spec follows it; Stoppable);
    `full_weights`, every candidate is a full HF model folder; `pushes`, the trainer pushes weights to an engine
    reefd launches for the job (PushesWeights)."""

    Config: ClassVar[type]
    detachable: bool
    full_weights: bool
    pushes: bool

    async def run(self, spec: Path, on_event: Callable[[Event], None], timeout_s: float) -> int: ...

    async def close(self) -> None: ...

    def prewarm(self) -> None:
        """A hint that weight jobs are coming (a scenario trains weights): get ready now if that helps."""


@runtime_checkable
class Stoppable(Protocol):
    async def stop(self, spec: Path) -> str | None:
        """Stop the spec's job where it runs (a cluster): None once it ended (or never started), else the problem."""


@runtime_checkable
class PushesWeights(Protocol):
    def pushed_version(self, doc: dict[str, Any]) -> str:
        """The weight version the engine named in the spec's `engines` reports after the job's last push."""


def kind_of(raw: Any) -> tuple[str, dict[str, Any]]:
    """(kind, its keys) of a `recipe.backend` value: a plain name, or a mapping with `kind`."""
    if isinstance(raw, str):
        return raw, {}
    if not isinstance(raw, dict) or not isinstance(raw.get("kind"), str):
        raise plugins.PluginError("recipe.backend: a kind (local, ray, slime, pkg.mod:Class) or {kind: KIND, ...}")
    return raw["kind"], {k: v for k, v in raw.items() if k != "kind"}


def _moved_into(readers: tuple[str, ...]) -> Callable[[Any, str, Any], Any]:
    """How a key that sat beside `recipe.backend` (before it took a mapping) goes into it (reefd/moved_keys.py):
    `recipe.backend` with the key added, a kind name becoming {kind: KIND, KEY: value}; None where the kind is
    not among `readers`, which alone ever read the old key."""
    def place(raw: Any, key: str, value: Any) -> Any:
        kind, keys = kind_of("local" if raw is None else raw)
        return {"kind": kind, **keys, key: value} if kind in readers else None
    return place


into_cluster = _moved_into(("ray", "slime"))  # recipe.ray_address, recipe.ray_resources
into_slime = _moved_into(("slime",))  # recipe.slime.KEY


def load(raw: Any) -> tuple[type, Any]:
    """(the backend's class, its config) for a `recipe.backend` value; PluginError naming `recipe.backend[.KEY]`."""
    name, keys = kind_of(raw)
    try:
        cls = plugins.resolve(plugins.BACKENDS, name, "trainer backend")
        if missing := plugins.missing(TrainerBackend, cls):
            raise plugins.PluginError(f"trainer backend {name!r} is not a TrainerBackend (no {missing[0]})")
    except plugins.PluginError as exc:
        raise plugins.PluginError(f"recipe.backend: {exc}") from None
    try:
        return cls, schema.parse(cls.Config, keys, "recipe.backend")
    except ValueError as exc:  # SchemaError, or the config's own check
        raise plugins.PluginError(str(exc)) from None


def json_schema() -> dict[str, Any]:
    """`recipe.backend` for editors: a kind's name, or a mapping of `kind` and that kind's own keys."""
    kinds = plugins.name_schema(plugins.BACKENDS, "local: `python -m reefd.train` subprocesses; ray: a Ray "
                                "cluster's job; slime: slime on a Ray cluster; or pkg.mod:Class, a backend of yours.")
    branches = []
    for name in plugins.BACKENDS:
        sub = schema.dataclass_schema(plugins.resolve(plugins.BACKENDS, name, "trainer backend").Config)
        sub["properties"] = {"kind": {"const": name}, **sub["properties"]}
        branches.append({"if": {"properties": {"kind": {"const": name}}, "required": ["kind"]}, "then": sub})
    return {"anyOf": [kinds, {"type": "object", "properties": {"kind": kinds}, "required": ["kind"],
                              "allOf": branches}], "default": "local", "description": "Where weight jobs run."}


class Backends:
    """The trainer backends in use, one per kind and config, each built on first use."""

    def __init__(self, work_dir: Path, max_jobs: int) -> None:
        self.work_dir, self.max_jobs = work_dir, max_jobs
        self._built: dict[str, TrainerBackend] = {}

    def get(self, raw: Any) -> TrainerBackend:
        """The backend a `recipe.backend` value names (PluginError: none usable; a scenario's load checks first)."""
        name, keys = kind_of(raw)
        key = name if not keys else f"{name}@{json.dumps(keys, sort_keys=True, default=str)}"
        if key not in self._built:
            cls, cfg = load(raw)
            backend = cls(self.work_dir if name in plugins.BACKENDS else self.work_dir / "backends" / name,
                          self.max_jobs, cfg)
            if (backend.detachable and not isinstance(backend, Stoppable)) or \
                    (backend.pushes and not isinstance(backend, PushesWeights)):
                raise plugins.PluginError(f"recipe.backend: {name!r} is detachable without stop, or pushes without "
                                          "pushed_version")
            self._built[key] = backend
        return self._built[key]

    def prewarm(self, names: Iterable[Any]) -> None:
        """Get these backends ready ahead of their first job (one that cannot be loaded is logged)."""
        for backend in {id(b): b for b in map(self._loaded, names) if b is not None}.values():
            backend.prewarm()

    def _loaded(self, raw: Any) -> TrainerBackend | None:
        try:
            return self.get(raw)
        except plugins.PluginError as exc:
            log.warning("cannot prepare trainer backend %s: %s", raw, exc)
            return None

    async def close(self) -> None:
        await asyncio.gather(*(b.close() for b in self._built.values()), return_exceptions=True)
