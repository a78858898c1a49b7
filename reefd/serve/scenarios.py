"""The scenario registry: composed configs bound to running engines, and what serves each scenario now.

Scenarios whose models are identical share one engine. A request takes its scenario's `Binding` when it starts
(`serving`) and keeps it, so neither a reload nor a release swap takes its engine or adapter away mid-answer.
Knows nothing about HTTP, wire formats, records or the chain (the reconciler sets the bindings).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp

from reefd.commit import trials as canary
from reefd.config import ScenarioConfig
from reefd.engines import Admits, Engine, ModelConfig, SamplesTokens, WeightSwap, build_engine, turn_limits
from reefd.grow import recipes
from reefd.grow.recipes import Recipe
from reefd.harness import Harness
from reefd.serve.admission import Admission
from reefd.serve.tenancy import Users

log = logging.getLogger("reefd")


class UnknownScenario(LookupError):
    """No scenario of that name is served."""

    def __init__(self, name: str, known: list[str]) -> None:
        super().__init__(f"unknown scenario {name!r}")
        self.name, self.known = name, known


class NotServing(RuntimeError):
    """The scenario has no release bound yet (or could not bind the one declared): retry shortly."""

    def __init__(self, name: str, why: str | None) -> None:
        super().__init__(f"scenario {name!r} is not serving yet" + (f": {why}" if why else ""))
        self.name, self.why = name, why


@dataclass(frozen=True)
class Binding:
    """What serves a scenario's new requests: a release, the engine's name for its adapter (if it has one), and
    its harness (if it has one)."""

    release: str
    adapter: str | None = None
    artifact: str | None = None  # the adapter's tree id: releases with equal trees share one loaded adapter
    harness: Harness | None = None
    harness_tree: str | None = None
    weights: str | None = None  # the tree id of the release's `weights/` folder (None: the model's own weights)
    weights_version: str | None = None  # the engine's name for those weights: the release they were swapped in as


@dataclass(frozen=True)
class Trial:
    """A release on trial beside the scenario's binding (reefd/commit/trials.py): a canary serves `share` of the
    sessions; a shadow answers a copy of them, never returned."""

    mode: str  # canary | shadow
    binding: Binding  # what the release on trial serves
    stable: str  # the release that serves everyone else
    share: float

    def takes(self, session: str | None, sticky: str | None) -> bool:
        """Whether a turn of `session` (whose previous turn was served by `sticky`) goes to the release on trial."""
        return canary.takes(self.binding.release, self.share, session,
                            sticky if self.mode == "canary" else None, self.stable)


@dataclass(frozen=True)
class Route:
    """What picks a request's side of a canary: its session, and the release its session's previous turn had."""

    session: str | None = None
    sticky: str | None = None


@dataclass
class Scenario:
    cfg: ScenarioConfig
    engine: Engine
    binding: Binding | None = None  # what serves new requests, once the reconciler has bound a release
    error: str | None = None  # why the reconciler could not make it serve what is declared
    recipe: Recipe | None = None  # its recipe, for what it asks of serving (top-K capture) and judging
    trial: Trial | None = None  # a release on trial beside `binding` (canary or shadow)
    settled: bool = False  # the reconciler has served what is declared once, trial included (readiness waits)
    # what the engine and the recipe declare, read once here rather than on every request:
    admits: Admits | None = field(init=False)  # the engine holds new requests while it swaps weights
    weight_swap: WeightSwap | None = field(init=False)  # the engine serves full-weight releases
    samples_tokens: SamplesTokens | None = field(init=False)  # the engine samples from a prompt of token ids
    capture_top_k: int = field(init=False)  # top-K logprobs the recipe wants for every token (0: none)

    def __post_init__(self) -> None:
        self.admits = self.engine if isinstance(self.engine, Admits) else None
        self.weight_swap = self.engine if isinstance(self.engine, WeightSwap) else None
        self.samples_tokens = self.engine if isinstance(self.engine, SamplesTokens) else None
        self.capture_top_k = self.recipe.capture_top_k if isinstance(self.recipe, recipes.CapturesTopK) else 0

    @property
    def name(self) -> str:
        return self.cfg.name

    def weights_refusal(self, folder: Path) -> str | None:
        """Why this scenario's engine cannot serve the full weights in model folder `folder` (None: it can), from
        what the engine declares (`weight_swap`, its `swap_limits`); asked before such a release is written."""
        if self.weight_swap is None:
            return f"its {self.engine.kind} engine loads no full weights"
        return self.weight_swap.swap_limits.refusal(folder)

    @property
    def release(self) -> str | None:
        """The id of the release serving new requests."""
        return self.binding.release if self.binding else None

    def harness_text(self, harness: Harness | None, role: str | None = None) -> str:
        """What a request this scenario serves with `harness` gets in its system prompt: the applied prompt, the
        rules and the skills, as its `harness:` settings say (Harness.prompt_block); "" without a harness.

        With `role`, what a subagent of that role works under: the role's instructions (its agent sends them as the
        subagent's system prompt), then the text reefd adds to every request. Gates and GEPA judge a role so."""
        if harness is None:
            return ""
        text = harness.prompt_block(inline_skills=self.cfg.harness.inline_skills, prompt=self.cfg.harness.prompt)
        if role is None:
            return text
        return "\n\n".join(t for t in (harness[("role", role)].config["body"], text.rstrip("\n")) if t) + "\n"


def _recipe(cfg: ScenarioConfig) -> Recipe | None:
    try:
        return recipes.build(cfg.recipe.name, cfg.recipe.params)
    except recipes.RecipeError:  # checked when the scenario loaded; a plug-in that changed since stays unused
        log.exception("%s: recipe %s cannot be built", cfg.name, cfg.recipe.name)
        return None


ADMISSION_FIELDS = ("max_queue", "max_queue_wait_s")  # a reload changes these on the running engine


def _model_key(cfg: ModelConfig) -> str:
    return json.dumps({k: v for k, v in asdict(cfg).items() if k not in ADMISSION_FIELDS}, sort_keys=True)


async def _until(condition: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        await asyncio.sleep(0.25)


Bind = Callable[[Scenario], Awaitable[object]]
"""Binds a scenario that is not installed yet to its declared release (the reconciler's `bind`)."""


class Serving:
    """One request's hold on its scenario's engine, as an `async with` block that gives the binding: a turn in the
    engine's line, then (once the engine admits: a weight load makes requests wait) the release it serves with,
    counted in flight so neither a reload nor a release swap takes its engine, adapter or weights away mid-answer.
    A class, not a generator: it runs on every turn."""

    __slots__ = ("background", "held", "left", "line", "own", "preempt", "registry", "route", "scenario", "stop")

    def __init__(self, registry: Registry, scenario: Scenario, line: Admission | None,
                 left: Callable[[], bool] | None, route: Route | None, background: bool = False,
                 preempt: bool = False, own: Binding | None = None) -> None:
        self.registry, self.scenario, self.line, self.left, self.route = registry, scenario, line, left, route
        self.own = own  # a user's own release: it serves whatever the scenario's binding and trial are
        self.background = background  # practice: a turn only from the idle part of the engine (Admission)
        self.preempt = preempt  # background: only on an idle engine, and `stop` is set when a request asks
        self.stop: asyncio.Event | None = None
        self.held: tuple[int, str | None, str | None] | None = None  # engine (by id), adapter, weights

    async def __aenter__(self) -> Binding:
        if self.line is not None:
            if self.background:
                self.stop = await self.line.enter_background(self.preempt)
            else:
                await self.line.enter(self.left)
        try:
            if self.scenario.admits is not None:
                await self.scenario.admits.admit()
            binding = self.scenario.binding
            if binding is None:  # the chain has not named this scenario's release yet
                raise NotServing(self.scenario.name, self.scenario.error)
            if self.own is not None and self.own.weights_version != binding.weights_version:
                raise NotServing(self.scenario.name, "its weights changed while this turn waited; retry")
        except BaseException:
            if self.line is not None:
                self.line.leave(self.background, self.stop)
            raise
        trial, route = self.scenario.trial, self.route
        if self.own is not None:  # (its weights checked above: a swap may have come while it waited in line)
            binding = self.own
        elif trial is not None and trial.mode == "canary" and route is not None and \
                trial.takes(route.session, route.sticky):
            binding = trial.binding
        self.held = (id(self.scenario.engine), binding.adapter, binding.weights_version)
        self.registry.count(*self.held, 1)
        return binding

    async def __aexit__(self, *exc: object) -> None:
        if self.held is not None:
            self.registry.count(*self.held, -1)
        if self.line is not None:
            self.line.leave(self.background, self.stop)


class Registry:
    def __init__(self, configs: dict[str, ScenarioConfig], state_dir: Path, session: aiohttp.ClientSession):
        self.state_dir = state_dir
        self.session = session
        self.users = Users(state_dir / "users")  # of the scenarios that learn per user
        self.engines: dict[str, Engine] = {}
        self.admissions: dict[int, Admission] = {}  # by id(engine): the line of requests in front of it
        self._retiring: dict[str, tuple[Engine, asyncio.Task[None]]] = {}  # unused engines, stopped once drained
        self.scenarios: dict[str, Scenario] = {}
        self.scenarios, _ = self._bind(configs)
        self._inflight: Counter[int] = Counter()  # requests per engine (by id), for draining
        self._uses: Counter[tuple[int, str | None]] = Counter()  # requests per (engine, adapter)
        self._weights: Counter[tuple[int, str | None]] = Counter()  # requests per (engine, weight version)
        self._resident: dict[tuple[int, str], set[str]] = {}  # (engine, adapter) -> users it is resident for
        self._reloading = asyncio.Lock()

    def _bind(self, configs: dict[str, ScenarioConfig]) -> tuple[dict[str, Scenario], list[str]]:
        """Scenarios bound to engines (building engines for new models), and the new engines' keys."""
        fresh: list[str] = []
        scenarios = {}
        for name, cfg in sorted(configs.items()):
            key = _model_key(cfg.model)
            if key in self._retiring:  # a model that a reload dropped comes back before its engine stopped
                engine, task = self._retiring.pop(key)
                task.cancel()
                self.engines[key] = engine
            if key not in self.engines:
                self.engines[key] = build_engine(cfg.model, self.state_dir, self.session)
                fresh.append(key)
            self._admit_to(self.engines[key], cfg)
            old = self.scenarios.get(name)
            same_engine = old is not None and old.engine is self.engines[key]
            scenarios[name] = Scenario(cfg, self.engines[key], old.binding if old and same_engine else None,
                                       old.error if old and same_engine else None, _recipe(cfg),
                                       old.trial if old and same_engine else None,
                                       settled=bool(old and same_engine and old.settled))
        return scenarios, fresh

    async def start(self) -> None:
        for engine in self.engines.values():
            await engine.start()

    async def stop(self) -> None:
        retiring, self._retiring = list(self._retiring.values()), {}
        for _, task in retiring:
            task.cancel()
        await asyncio.gather(*(task for _, task in retiring), return_exceptions=True)
        for engine in [*self.engines.values(), *(engine for engine, _ in retiring)]:  # draining or not
            await engine.stop()

    def _admit_to(self, engine: Engine, cfg: ScenarioConfig) -> None:
        """The line in front of `engine`, with the bounds its model config declares (a reload may change them)."""
        limits = turn_limits(cfg.model)
        if limits is None:
            self.admissions.pop(id(engine), None)
            return
        line = self.admissions.get(id(engine))
        if line is None:
            self.admissions[id(engine)] = Admission(cfg.model.name or cfg.name, *limits, cfg.model.max_queue_wait_s)
        else:
            line.resize(*limits, cfg.model.max_queue_wait_s)

    def serving(self, scenario: Scenario, left: Callable[[], bool] | None = None,
                route: Route | None = None, own: Binding | None = None) -> Serving:
        """Wait for a turn at the scenario's engine (Overloaded when its line is full or the wait runs out; Left
        when `left()` says the client went away meanwhile), then serve with that turn held: `own` (a user's own
        release), else the release on canary when `route` falls on its side, else the scenario's binding."""
        return Serving(self, scenario, self.admissions.get(id(scenario.engine)), left, route, own=own)

    def practicing(self, scenario: Scenario, preempt: bool) -> Serving:
        """As `serving`, for practice: a background turn (requests go first; with `preempt`, only on an idle engine,
        and its `stop` is set when a request asks), on the scenario's binding, never a release on trial."""
        return Serving(self, scenario, self.admissions.get(id(scenario.engine)), None, None, background=True,
                       preempt=preempt)

    def count(self, engine: int, adapter: str | None, weights: str | None, n: int) -> None:
        """`n` more requests in flight on `engine` (by id), with `adapter` and `weights` (see Serving)."""
        self._inflight[engine] += n
        self._uses[(engine, adapter)] += n
        self._weights[(engine, weights)] += n

    async def drained(self, engine: Engine, version: str | None, timeout_s: float) -> None:
        """Until no request taken on `engine` with weight version `version` is in flight (or `timeout_s`)."""
        deadline = time.monotonic() + timeout_s
        while self._weights[(id(engine), version)] > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)

    def sharing(self, engine: Engine) -> list[str]:
        """The scenarios served by `engine`."""
        return sorted(name for name, s in self.scenarios.items() if s.engine is engine)

    @contextlib.contextmanager
    def using(self, engine: Engine, adapter: str | None) -> Iterator[None]:
        """Keep `adapter` loaded on `engine` while a non-request user (a gate) generates with it."""
        self._uses[(id(engine), adapter)] += 1
        try:
            yield
        finally:
            self._uses[(id(engine), adapter)] -= 1

    def hold(self, engine: Engine, adapter: str | None) -> Callable[[], None]:
        """Keep `adapter` loaded on `engine` until the returned function is called (a second call does nothing):
        for a user that starts now and finishes in another task (a shadow copy)."""
        key = (id(engine), adapter)
        self._uses[key] += 1
        held = [True]

        def release() -> None:
            if held.pop() if held else False:
                self._uses[key] -= 1

        return release

    def hold_resident(self, engine: Engine, adapter: str, user: str) -> None:
        """`adapter` serves `user`'s turns on `engine` (reefd/commit/user_lines.py): kept loaded until released."""
        self._resident.setdefault((id(engine), adapter), set()).add(user)

    def release_resident(self, engine: Engine, adapter: str, user: str) -> None:
        users = self._resident.get((id(engine), adapter))
        if users is not None:
            users.discard(user)
            if not users:
                del self._resident[(id(engine), adapter)]

    def adapters(self, engine: Engine) -> set[str]:
        """The adapters that scenarios served by `engine` serve now (their bindings and trials, and the adapters
        resident for their users)."""
        out = {adapter for (key, adapter) in self._resident if key == id(engine)}
        for s in self.scenarios.values():
            if s.engine is engine:
                for binding in (s.binding, s.trial.binding if s.trial is not None else None):
                    if binding is not None and binding.adapter is not None:
                        out.add(binding.adapter)
        return out

    def in_flight(self, engine: Engine, adapter: str | None) -> int:
        """Requests running on `engine` with `adapter`."""
        return self._uses[(id(engine), adapter)]

    @contextlib.asynccontextmanager
    async def borrow(self, cfg: ModelConfig) -> AsyncIterator[Engine]:
        """The engine for `cfg` (a recipe's proposer model): a scenario's, when one serves that model, else a
        temporary one, started now and stopped on exit."""
        key = _model_key(cfg)
        engine = self.engines.get(key)
        if engine is not None:
            yield engine
            return
        engine = build_engine(cfg, self.state_dir, self.session)
        await engine.start()
        try:
            yield engine
        finally:
            await engine.stop()

    async def reload(self, configs: dict[str, ScenarioConfig], bind: Bind) -> None:
        """Apply a re-read scenario folder without dropping requests.

        New engines start and get until their start-up deadline to generate before any route moves to them:
        `bind` gives a scenario moving to a new engine its release there first, and one whose new engine fails
        keeps its old binding. Requests in flight keep the engine they resolved, and an engine no scenario uses
        any more is stopped in the background once its requests have finished.
        """
        async with self._reloading:
            scenarios, fresh = self._bind(configs)
            for key in fresh:
                await self.engines[key].start()
            deadline = max((s.cfg.model.startup_timeout_s for s in scenarios.values()), default=0)
            await _until(lambda: all(self.engines[k].ready or
                                     self.engines[k].describe()["state"] == "failed"
                                     for k in fresh), deadline)
            for name, scenario in scenarios.items():
                old = self.scenarios.get(name)
                if old is None or old.engine is scenario.engine:
                    continue
                if scenario.engine.ready:  # bind its release on the new engine before the route moves
                    await bind(scenario)
                if not scenario.engine.ready or (scenario.binding is None and old.binding is not None):
                    log.error("reload: scenario %s keeps its previous model; the new one is %s%s", name,
                              scenario.engine.describe()["state"], f" ({scenario.error})" if scenario.error else "")
                    scenarios[name] = old
            for name, scenario in scenarios.items():  # swaps made while this reload waited still hold
                old = self.scenarios.get(name)
                if old is not None and old is not scenario and old.engine is scenario.engine:
                    scenario.binding, scenario.trial, scenario.error, scenario.settled = \
                        old.binding, old.trial, old.error, old.settled
            self.scenarios = scenarios
            used = {id(s.engine) for s in scenarios.values()}
            drain = max((s.cfg.serve.request_timeout_s for s in scenarios.values()), default=600.0)
            for key, engine in list(self.engines.items()):
                if id(engine) not in used:
                    del self.engines[key]
                    self._retiring[key] = (engine, asyncio.create_task(self._retire(key, engine, drain)))

    async def _retire(self, key: str, engine: Engine, drain_s: float) -> None:
        """Stop an engine no scenario uses once its requests have finished (or reefd stops), unless a reload
        takes it back first."""
        try:
            await _until(functools.partial(self._idle, engine), drain_s)
        finally:
            if self._retiring.get(key, (None,))[0] is engine:  # not taken back by a reload
                del self._retiring[key]
                self.admissions.pop(id(engine), None)
                await engine.stop()

    def _idle(self, engine: Engine) -> bool:
        return self._inflight[id(engine)] == 0

    @property
    def ready(self) -> bool:
        """Every scenario's engine generates and serves what its chain declares: at start, not before a reconcile
        has served its declared release and any trial beside it (a canary restored after a restart is in place
        before traffic comes; one that cannot be restored keeps reefd unready until it is, or is rolled back)."""
        return not self.unready()

    def unready(self) -> list[str]:
        """The scenarios that are not `ready`: their engine does not generate yet, or they do not serve what
        their chain declares yet."""
        return sorted(name for name, s in self.scenarios.items() if not (s.engine.ready and s.binding and s.settled))

    def get(self, name: str) -> Scenario:
        """UnknownScenario when no scenario of that name is served."""
        try:
            return self.scenarios[name]
        except KeyError:
            raise UnknownScenario(name, sorted(self.scenarios)) from None
