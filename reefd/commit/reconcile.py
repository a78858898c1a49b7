"""The reconciler: declared release (YAML pin, else the chain head) ↔ release chain ↔ serving engine.

It runs when told to (reefd/loop.py wires it): at start, after every commit through reefd (before the caller is
answered), and on SIGHUP; a reconcile that failed is tried again after RETRY_S, doubling while it keeps failing
(at most RETRY_MAX_S). reefd is the chain's only
writer, so nothing else moves a head. For each scenario it:

1. records the base release on a scenario's first start;
2. if the YAML pins a release whose artifacts differ from the head's, appends a rollback release
   carrying the pinned tree (the chain never rewinds);
3. swaps the engine to the head: an adapter is materialized from the chain and loaded under a new
   name (its release id), the scenario's binding moves to it for new requests, and the previous
   adapter is unloaded once the requests that started on it have finished.

Requests capture a scenario's `Binding` when they start, so each answers and is recorded with the
release that served it. It decides what to bind; materialize.py writes, loads and unloads. Knows the chain and
the engine contract; nothing about wire formats.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from reefd.commit import policy
from reefd.commit import trials as canary
from reefd.commit.chain import (
    Candidate,
    HeadConflict,
    Release,
    ReleaseChain,
    ReleaseError,
    UnknownRelease,
    WrongScenario,
)
from reefd.commit.identity import model_identity
from reefd.commit.materialize import Materializer
from reefd.commit.user_lines import UserLines
from reefd.engines import EngineError, EngineUnavailable, WeightSwap, kind_config, trial_replicas
from reefd.harness import HarnessError
from reefd.ops.background import Background
from reefd.serve.scenarios import Binding, Registry, Scenario, Trial

log = logging.getLogger("reefd.commit.reconcile")


class Reconciler:
    RETRY_S = 30.0  # a swap that failed is tried again after this (an engine restarting, a corrupt object),
    RETRY_MAX_S = 600.0  # then twice as long after each failure in a row, at most this: a release that keeps
    # failing (a proof that does not match) does not take a replica out of the router every 30 s for ever

    def __init__(self, registry: Registry, chain: ReleaseChain, state_dir: Path, scenarios_dir: Path):
        self.registry = registry
        self.chain = chain
        self.files = Materializer(registry, chain, state_dir, scenarios_dir)  # what binding needs, on the engine
        self.users = UserLines(registry, chain, self.files)  # users' own releases, paged in per turn
        self._locks: dict[str, asyncio.Lock] = {}
        self._background = Background(log)  # swaps kicked off, adapters being retired
        self._retries: dict[str, asyncio.TimerHandle] = {}  # scenario -> its next try after a failure
        self._failures: dict[str, int] = {}  # scenario -> its reconciles that failed in a row
        self._listeners: list[Callable[[Scenario, Release], None]] = []

    # ------------------------------------------------------------ triggers

    def start(self) -> None:
        self.kick_all()

    def kick_all(self) -> None:
        for name in self.registry.scenarios:
            self.kick(name)

    def kick(self, name: str) -> None:
        """Reconcile `name` in the background."""
        self._background.spawn(self._kick(name), f"reconcile-{name}")

    async def _kick(self, name: str) -> None:
        scenario = self.registry.scenarios.get(name)
        if scenario is not None:
            await self.reconcile(scenario)

    async def bind(self, scenario: Scenario) -> None:
        """Bind a scenario a reload has not installed yet (it moves to a new engine) to its declared release."""
        await self.reconcile(scenario, pending=True)

    async def stop(self) -> None:
        for handle in self._retries.values():
            handle.cancel()
        await self._background.cancel()
        await self.files.proofs.reference.close()

    # ------------------------------------------------------------ the loop

    async def reconcile(self, scenario: Scenario, *, pending: bool = False) -> Binding | None:
        """Make a scenario serve its declared release; returns what serves it afterwards.

        The scenario served now is the one reconciled, even when the caller holds an object from before a
        reload; `pending` is for a reload's new object, bound before it is installed."""
        live = self.registry.scenarios.get(scenario.name)
        if not pending and live is not None:
            scenario = live
        lock = self._locks.setdefault(scenario.name, asyncio.Lock())
        async with lock:
            retry = self._retries.pop(scenario.name, None)
            if retry is not None:
                retry.cancel()
            try:
                head, problem = await self._declared_head(scenario)
                await self._serve(scenario, head)
                if scenario.cfg.users is not None:
                    await self.users.read_heads(scenario)
                scenario.error, scenario.settled = problem, True
                self._failures.pop(scenario.name, None)
                if problem:
                    log.error("%s: %s", scenario.name, problem)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # recorded on the scenario (status shows it) and tried again later
                delay = self.retry_after(scenario.name)
                if not pending:
                    self._retries[scenario.name] = asyncio.get_running_loop().call_later(
                        delay, self.kick, scenario.name)
                scenario.error = str(exc) or type(exc).__name__
                expected = (EngineError, EngineUnavailable, ReleaseError, HarnessError, OSError)
                log.error("%s: %s (tried again in %.0f s)", scenario.name, exc, delay,
                          exc_info=not isinstance(exc, expected))
            return scenario.binding

    def retry_after(self, name: str) -> float:
        """One more failure in a row for scenario `name`: the seconds until it is tried again."""
        self._failures[name] = failures = self._failures.get(name, 0) + 1
        return min(self.RETRY_S * 2 ** min(failures - 1, 16), self.RETRY_MAX_S)

    async def _declared_head(self, scenario: Scenario) -> tuple[Release, str | None]:
        """The chain head after recording the base and applying the pin (appending a rollback if needed),
        and what is wrong with the pin if it cannot be applied (the head then serves)."""
        name, pin = scenario.name, scenario.cfg.release.pin
        head = await asyncio.to_thread(self.chain.head, name)
        if head is None:
            head = await self._record_base(scenario)
        elif pin is None and scenario.cfg.harness.dir and \
                "harness" not in await asyncio.to_thread(self.chain.artifacts, head.id):
            head = await self._import_harness(scenario, head)  # a harness added to a scenario that had none
        if pin is None or pin == head.id:
            return head, None
        try:
            target = await asyncio.to_thread(self.chain.target, name, pin)
        except UnknownRelease:
            return head, f"release.pin: {pin} is not a release of scenario {name!r}; serving the chain head"
        except WrongScenario as exc:
            return head, f"release.pin: {exc}; serving the chain head"
        if await self._same_artifacts(target.id, head.id):
            return head, None
        rel = await self._commit(scenario, Candidate(
            "rollback", {"source": "pin", "summary": f"release.pin in the scenario file: {pin}"}, target=pin,
            built_on=head.id, applies_pin=True), on_conflict="rebase")  # a head moved meanwhile: the pin still wins
        log.info("%s: pinned to %s; appended rollback release %s", name, pin, rel.id)
        return rel, None

    async def _commit(self, scenario: Scenario, cand: Candidate, on_conflict: str = "discard") -> Release:
        return await asyncio.to_thread(policy.commit, self.chain, scenario.name, cand, pin=scenario.cfg.release.pin,
                                       on_conflict=on_conflict)

    async def _same_artifacts(self, a: str, b: str) -> bool:
        return bool(await asyncio.to_thread(self.chain.artifacts, a)
                    == await asyncio.to_thread(self.chain.artifacts, b))

    async def _record_base(self, scenario: Scenario) -> Release:
        """A scenario's first start: its base release records the model's identity."""
        deadline = time.monotonic() + scenario.cfg.model.startup_timeout_s
        remote = kind_config(scenario.cfg.model.engine).remote  # a provider's model has no folder to wait for
        while (model_dir := scenario.engine.model_folder()) is None and not remote:
            if scenario.engine.describe()["state"] == "failed" or time.monotonic() > deadline:
                raise EngineUnavailable(f"engine for model {scenario.cfg.model.name!r} did not start; "
                                        "no base release recorded")
            await asyncio.sleep(0.25)  # a built-in model is still being prepared
        ident = await asyncio.to_thread(model_identity, scenario.cfg.model, model_dir)
        meta: dict[str, Any] = {"source": "import", "identity": ident}
        async with self.files.base_harness(scenario.cfg.harness.dir) as harness:
            if harness is not None:
                meta["summary"] = f"base harness from {scenario.cfg.harness.dir}"
            try:
                head = await self._commit(scenario, Candidate("base", meta, artifact=harness, folder="harness",
                                                              exact=True))
                log.info("%s: recorded base release %s", scenario.name, head.id)
                return head
            except HeadConflict:  # recorded meanwhile (a reload's reconcile, say): serve that
                again = await asyncio.to_thread(self.chain.head, scenario.name)
                assert again is not None
                return again

    async def _import_harness(self, scenario: Scenario, head: Release) -> Release:
        async with self.files.base_harness(scenario.cfg.harness.dir) as folder:
            rel = await self._commit(scenario, Candidate(
                "harness", {"source": "import", "summary": f"harness imported from {scenario.cfg.harness.dir}"},
                artifact=folder, built_on=head.id, exact=True))
        log.info("%s: imported its harness as release %s", scenario.name, rel.id)
        return rel

    def subscribe(self, listener: Callable[[Scenario, Release], None]) -> None:
        """Call `listener(scenario, head)` on the event loop each time a scenario serves what its chain declares."""
        self._listeners.append(listener)

    async def _serve(self, scenario: Scenario, head: Release) -> None:
        """Serve the head, or, while it is on trial (reefd/commit/trials.py), its stable release to everyone and the
        head beside it as the scenario's trial."""
        spec = canary.active(scenario.cfg.release, head)
        stable = None
        if spec is not None:
            stable = await asyncio.to_thread(self.chain.get, spec.stable)
            if trial_replicas(scenario.engine) < 2 and await asyncio.to_thread(self._weights_of, stable.id) != \
                    await asyncio.to_thread(self._weights_of, head.id):
                log.warning("%s: %s is on trial with other weights than %s; one engine process serves one set of "
                            "weights, so it serves everyone", scenario.name, head.id, stable.id)
                spec = stable = None
        old, before = scenario.trial, scenario.binding
        if spec is None or stable is None:
            await self._serve_one(scenario, head, old, retire=False)
            scenario.trial = None
        else:
            await self._serve_one(scenario, stable, old, retire=False)
            side = await self._side(scenario, head, old, spec.share)
            scenario.trial = Trial(spec.mode, side, stable.id, spec.share)
            if old is None or old.binding.release != head.id:
                log.info("%s: %s %s on %g of sessions; %s serves the rest", scenario.name, spec.mode, head.id,
                         spec.share, stable.id)
        # only now that both the binding and the trial are set: what neither serves any more is unloaded, and
        # weights staged for a trial that ended go back to serving everyone (once their requests are done)
        await self.files.end_staged(scenario, scenario.trial.binding.weights_version if scenario.trial else None)
        for gone in (before, old.binding if old is not None else None):
            if gone is not None and gone.adapter is not None and \
                    gone.adapter not in self.registry.adapters(scenario.engine):
                self._background.spawn(self.files.retire(scenario.engine, gone, scenario.cfg.serve.request_timeout_s),
                            f"retire-{gone.adapter}")
        for listener in list(self._listeners):
            try:
                listener(scenario, head)
            except Exception:  # a listener's bug must not fail a swap already made
                log.exception("a reconcile listener failed")

    def _weights_of(self, release_id: str) -> str | None:
        return self.chain.artifacts(release_id).get("weights")

    async def _side(self, scenario: Scenario, rel: Release, old: Trial | None, share: float) -> Binding:
        """The binding of a release on trial: its adapter (loaded beside the stable one, or shared when the bytes
        are the same) and its harness, on the weights that serve; or, for other weights, on replicas of its own."""
        current = scenario.binding
        assert current is not None
        if old is not None and old.binding.release == rel.id and \
                not self.files.unstaged(scenario, old.binding, current):
            return old.binding
        found = await self.files.artifacts(rel, current)
        if found.weights != current.weights:
            scenario.trial = None  # the trial it replaces takes no new session while its replicas change
            return await self.files.stage_weights(scenario, rel, found, share)
        tree, harness, harness_tree = found.adapter, found.harness, found.harness_tree
        adapter = None
        if tree is not None:
            reuse = [b for b in (current, old.binding if old else None)
                     if b is not None and b.artifact == tree and b.adapter is not None]
            if reuse:
                adapter = reuse[0].adapter
            else:
                adapter = await self.files.load(scenario, rel.id)
        return Binding(rel.id, adapter, tree, harness, harness_tree, current.weights, current.weights_version)

    async def _serve_one(self, scenario: Scenario, rel: Release, trial: Trial | None = None, *,
                         retire: bool = True) -> None:
        current = scenario.binding
        if current is not None and current.release == rel.id:
            return
        found = await self.files.artifacts(rel, current)
        tree, weights, harness, harness_tree = found.adapter, found.weights, found.harness, found.harness_tree
        engine = scenario.engine
        served = engine.weights.version if isinstance(engine, WeightSwap) else None  # what the engine really has
        if weights != (current.weights if current is not None else None) or (current is None and served is not None):
            await self.files.swap_weights(scenario, rel, found)
            return
        on = {"weights": weights, "weights_version": current.weights_version if current is not None else None}
        if tree is None:
            binding = Binding(rel.id, harness=harness, harness_tree=harness_tree, **on)
        elif current is not None and current.artifact == tree and current.adapter is not None:
            # same adapter bytes (a rollback's copy, a harness-only release): keep the loaded one
            binding = Binding(rel.id, current.adapter, tree, harness, harness_tree, **on)
        elif trial is not None and trial.binding.artifact == tree and trial.binding.adapter is not None:
            # the adapter of the release that was on trial (its promotion): already loaded
            binding = Binding(rel.id, trial.binding.adapter, tree, harness, harness_tree, **on)
        else:
            binding = Binding(rel.id, await self.files.load(scenario, rel.id), tree, harness, harness_tree, **on)
        scenario.binding = binding  # new requests take it from here; running ones keep theirs
        log.info("%s: serving %s%s", scenario.name, rel.id, f" (was {current.release})" if current else "")
        if retire and current is not None and current.adapter is not None and current.adapter != binding.adapter:
            self._background.spawn(self.files.retire(engine, current, scenario.cfg.serve.request_timeout_s),
                        f"retire-{current.adapter}")

    # ------------------------------------------------------------ reporting

    def drift(self, scenario: Scenario, head: Release | None) -> list[str]:
        """Why what serves differs from what is declared (empty when in sync)."""
        reasons = []
        serving = scenario.binding.release if scenario.binding else None
        pin = scenario.cfg.release.pin
        if scenario.error:
            reasons.append(scenario.error)
        trial = scenario.trial
        if trial is not None and head is not None and trial.binding.release == head.id:
            serving = head.id  # on trial beside the stable release: what the chain declares
        if head is not None and serving != head.id:
            lock = self._locks.get(scenario.name)
            busy = " (swap in progress)" if lock is not None and lock.locked() else ""
            reasons.append(f"serving {serving or 'nothing'} but the chain head is {head.id}{busy}")
        if pin is not None and head is not None and pin != head.id and not scenario.error:
            try:
                same = self.chain.artifacts(pin) == self.chain.artifacts(head.id)
            except ReleaseError:
                same = False
            if not same:
                reasons.append(f"declared release {pin} differs from the chain head {head.id}")
        return reasons
