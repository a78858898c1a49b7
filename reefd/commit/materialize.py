"""A release's artifacts from the chain into a scenario's engine: adapter folders (STATE/serving/<scenario>/<release>)
and weights folders (STATE/weights/<tree id>) written once, then loaded, swapped in, and unloaded once unused;
harnesses parsed. Does what the reconciler decides; knows nothing about pins, heads or trials."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import shutil
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from reefd.commit import chain as releases
from reefd.commit.chain import Release, ReleaseChain, ReleaseError
from reefd.commit.proofs import Proofs, ReferenceFailed, probe_of
from reefd.commit.trees import tree_id
from reefd.engines import Drained, Engine, EngineError, EngineUnavailable, Proves, Weights, WeightSwap, WeightTrial
from reefd.engines.proof import ProofFailed
from reefd.harness import Harness, HarnessError
from reefd.serve.scenarios import Binding, Registry, Scenario

log = logging.getLogger("reefd.commit.reconcile")


def read_harness(chain: ReleaseChain, release_id: str) -> Harness | None:
    """A release's harness, parsed from its `harness/` tree (None when it has none)."""
    if "harness" not in chain.artifacts(release_id):
        return None
    with tempfile.TemporaryDirectory(dir=chain.path / "lfs" / "tmp") as tmp:
        folder = chain.materialize(release_id, Path(tmp) / "h", "harness")
        try:
            return Harness.from_dir(folder)
        except HarnessError as exc:
            raise ReleaseError(f"{release_id}: its harness does not parse: {exc}") from None


@dataclass(frozen=True)
class Artifacts:
    """A release's artifact trees (None: it has none), and its harness parsed."""

    adapter: str | None
    weights: str | None
    harness: Harness | None
    harness_tree: str | None


class Materializer:
    """Each folder is written once (beside its place, then renamed) and shared by whatever serves it; the event
    loop is never blocked."""

    def __init__(self, registry: Registry, chain: ReleaseChain, state_dir: Path, scenarios_dir: Path):
        self.registry = registry
        self.chain = chain
        self.serving_dir = state_dir / "serving"
        self.weights_dir = state_dir / "weights"
        self.scenarios_dir = scenarios_dir
        self.proofs = Proofs(state_dir)

    @contextlib.asynccontextmanager
    async def base_harness(self, harness_dir: str | None) -> AsyncIterator[Path | None]:
        """A scenario's harness folder, read and rendered canonically into a temporary folder beside the chain's LFS
        objects (None: it has none)."""
        tmp = Path(await asyncio.to_thread(tempfile.mkdtemp, dir=self.chain.path / "lfs" / "tmp"))
        try:
            harness = await asyncio.to_thread(Harness.from_dir, self.scenarios_dir / harness_dir) \
                if harness_dir else None
            if harness is not None:
                await asyncio.to_thread(harness.render, tmp / "harness")
            yield tmp / "harness" if harness is not None else None
        finally:
            await asyncio.to_thread(shutil.rmtree, tmp, True)

    async def artifacts(self, rel: Release, current: Binding | None) -> Artifacts:
        """The release's artifacts, its adapter checked against its weights (an adapter serves only on the weights
        it was trained on), and its harness (the current binding's, when the tree is the same)."""
        found = await asyncio.to_thread(self.chain.artifacts, rel.id)
        tree, weights, harness_tree = found.get("adapter"), found.get("weights"), found.get("harness")
        claim = releases.trained_on(rel.meta) if tree is not None else None
        if claim is not None and claim.get("tree") != weights:
            made_on = claim.get("release") or "the base model"
            raise ReleaseError(f"{rel.id}: its adapter was trained on the weights of {made_on}, not on the "
                               "weights this release carries; it is not served")
        harness = None if harness_tree is None else current.harness if current is not None and \
            current.harness_tree == harness_tree else await asyncio.to_thread(read_harness, self.chain, rel.id)
        rendered = tree_id(harness.files()) if harness is not None else None
        if rendered != harness_tree:  # what is injected is the release's own tree
            raise ReleaseError(f"{rel.id}: the harness read from its tree {harness_tree} renders as tree "
                               f"{rendered}; it is not served")
        return Artifacts(tree, weights, harness, harness_tree)

    async def load(self, scenario: Scenario, release_id: str) -> str:
        """The release's adapter, loaded on the scenario's engine under its release id (once)."""
        if release_id not in scenario.engine.adapters:
            await self._wait_ready(scenario)
            folder = await self.adapter(scenario.name, release_id)
            engine = scenario.engine
            weights = engine.weights if isinstance(engine, WeightSwap) else Weights()
            await self._expect(scenario, release_id, weights.version, release_id, weights.path, folder)
            await engine.load_adapter(release_id, folder)
        return release_id

    async def _expect(self, scenario: Scenario, release_id: str, version: str | None, adapter: str | None,
                      weights: Path | None, folder: Path | None) -> None:
        """Hold the engine's processes to the release's fingerprint on weights `version` with `adapter` (its
        folder `folder`, on the weights folder `weights`; None: the launch model's) before they load it."""
        engine, cfg = scenario.engine, scenario.cfg.release.proof
        base = engine.model_folder()
        if not cfg.enabled or not isinstance(engine, Proves) or base is None:
            return
        if not await asyncio.to_thread(base.is_dir):  # an attached engine's model on another machine
            log.warning("%s: %s is not proven: its model folder %s is not on this machine, where the reference "
                        "runs", scenario.name, release_id, base)
            return
        rel = await asyncio.to_thread(self.chain.get, release_id)
        trees = await asyncio.to_thread(self.chain.artifacts, release_id)
        try:
            fp = await self.proofs.of(rel.meta, (trees.get("weights"), trees.get("adapter")), probe_of(cfg),
                                      weights or base, folder, base)
        except ReferenceFailed as exc:
            raise ProofFailed(f"{release_id} cannot be proven, so it is not served: {exc}") from None
        engine.proofs[(version, adapter)] = fp.within(cfg.tolerance)

    async def swap_weights(self, scenario: Scenario, rel: Release, found: Artifacts) -> None:
        """Serve a release whose weights differ from what serves: the engine swaps them (holding new requests on
        one process, rolling across replicas) and moves the binding at the moment the new weights serve."""
        engine = scenario.engine
        if not isinstance(engine, WeightSwap):
            raise EngineError(f"{rel.id} carries full weights, which a {engine.kind} engine cannot load")
        self._own_engine(scenario, rel)
        await self._wait_ready(scenario)
        path, adapter = await self._weights_of(scenario, rel, found)
        # the weights on trial, promoted: served under the version their replicas loaded them as (not loaded again)
        version = engine.staged.version if isinstance(engine, WeightTrial) and engine.staged is not None and \
            engine.staged.path == path and engine.staged.version is not None else rel.id
        if adapter is not None:
            adapter = (version, adapter[1])
        await self._expect(scenario, rel.id, version, version if adapter else None, path,
                           adapter[1] if adapter else None)
        binding = Binding(rel.id, version if adapter else None, found.adapter, found.harness, found.harness_tree,
                          found.weights, version)
        report = await engine.swap_weights(path, version, adapter,
                                           functools.partial(setattr, scenario, "binding", binding),
                                           self._drained(scenario))
        log.info("%s: serving %s on its weights (%s)", scenario.name, rel.id, report)
        await self._drop_unused_weights()
        # adapters of the old weights: unloaded (a promoted trial's serves under the name it was staged with)
        await self.drop_adapters(f"{scenario.name}/*", keep=binding.adapter or rel.id)

    def _own_engine(self, scenario: Scenario, rel: Release) -> None:
        sharing = [name for name in self.registry.sharing(scenario.engine) if name != scenario.name]
        if sharing:
            raise EngineError(f"{rel.id} carries full weights, but scenario(s) {', '.join(sharing)} share this "
                              f"model's engine; give {scenario.name} a model of its own (another model.name) to "
                              "serve weights releases")

    async def _drop_unused_weights(self) -> None:
        """Weights folders nothing serves (nor stages for a trial): removed (a rollback writes them again)."""
        keep = {s.binding.weights for s in self.registry.scenarios.values() if s.binding is not None}
        keep |= {p.name for e in self.registry.engines.values() if isinstance(e, WeightSwap)
                 for p in (e.weights.path, e.staged.path if isinstance(e, WeightTrial) and e.staged else None) if p}
        for folder in await asyncio.to_thread(lambda: list(self.weights_dir.glob("*"))):
            if folder.name not in keep and not folder.name.startswith("."):
                await asyncio.to_thread(shutil.rmtree, folder, True)

    async def stage_weights(self, scenario: Scenario, rel: Release, found: Artifacts, share: float) -> Binding:
        """Put a release whose weights differ from what serves on trial on some of the engine's replicas
        (WeightTrial): the binding of its side, whose requests go to them."""
        engine = scenario.engine
        if not isinstance(engine, WeightTrial):
            raise EngineError(f"{rel.id} carries full weights, which a {engine.kind} engine cannot put on trial")
        self._own_engine(scenario, rel)
        await self._wait_ready(scenario)
        path, adapter = await self._weights_of(scenario, rel, found)
        await self._expect(scenario, rel.id, rel.id, rel.id if adapter else None, path,
                           adapter[1] if adapter else None)
        await engine.stage_weights(path, rel.id, adapter, share, self._drained(scenario))
        return Binding(rel.id, rel.id if adapter else None, found.adapter, found.harness, found.harness_tree,
                       found.weights, rel.id)

    async def end_staged(self, scenario: Scenario, on_trial: str | None) -> None:
        """Weights staged for a trial that has ended (`on_trial`: the weight version the trial now serves): their
        replicas back on the weights that serve, once the requests on them are done."""
        engine = scenario.engine
        if isinstance(engine, WeightTrial) and engine.staged is not None and engine.staged.version != on_trial:
            await engine.end_staged(self._drained(scenario))
            await self._drop_unused_weights()

    @staticmethod
    def unstaged(scenario: Scenario, trial: Binding, current: Binding) -> bool:
        """Whether a trial of other weights than `current`'s has lost its replicas (their stage ended meanwhile)."""
        engine = scenario.engine
        return trial.weights != current.weights and isinstance(engine, WeightTrial) and \
            (engine.staged is None or engine.staged.version != trial.weights_version)

    async def _weights_of(self, scenario: Scenario, rel: Release, found: Artifacts
                          ) -> tuple[Path | None, tuple[str, Path] | None]:
        """The release's weights folder (written once, shared; None: the launch model's) and its adapter."""
        path = None if found.weights is None else \
            await asyncio.to_thread(self._write_once, self.weights_dir / found.weights, rel.id, "weights")
        adapter = (rel.id, await self.adapter(scenario.name, rel.id)) if found.adapter else None
        return path, adapter

    def _drained(self, scenario: Scenario) -> Drained:
        engine, timeout = scenario.engine, scenario.cfg.serve.request_timeout_s

        async def drained(version: str | None) -> None:
            await self.registry.drained(engine, version, timeout)

        return drained

    async def retire(self, engine: Engine, old: Binding, drain_s: float) -> None:
        """Unload an adapter no scenario serves any more, once the requests that started on it are done."""
        name = old.adapter
        assert name is not None
        deadline = time.monotonic() + drain_s
        while self.registry.in_flight(engine, name) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if name in self.registry.adapters(engine) or name not in engine.adapters:
            return  # served again meanwhile (or on trial), or already gone
        try:
            await engine.unload_adapter(name)
        except (EngineError, EngineUnavailable) as exc:
            log.warning("unloading adapter %s failed: %s", name, exc)
            return
        await self.drop_adapters(f"*/{name}")
        log.info("unloaded adapter %s", name)

    async def _wait_ready(self, scenario: Scenario) -> None:
        deadline = time.monotonic() + scenario.cfg.model.startup_timeout_s
        while not scenario.engine.ready:
            if scenario.engine.describe()["state"] == "failed" or time.monotonic() > deadline:
                raise EngineUnavailable(f"engine for model {scenario.cfg.model.name!r} is "
                                        f"{scenario.engine.describe()['state']}")
            await asyncio.sleep(0.1)

    async def adapter(self, scenario: str, release_id: str) -> Path:
        """The release's adapter folder under STATE/serving/<scenario>/<release>."""
        return await asyncio.to_thread(self._write_once, self.serving_dir / scenario / release_id, release_id,
                                       "adapter")

    async def drop_adapters(self, pattern: str, keep: str | None = None) -> None:
        """Remove the adapter folders matching `pattern` (<scenario>/<release> globs) but `keep`."""
        for folder in await asyncio.to_thread(lambda: list(self.serving_dir.glob(pattern))):
            if folder.name != keep:
                await asyncio.to_thread(shutil.rmtree, folder, True)

    def _write_once(self, dest: Path, release_id: str, folder: str) -> Path:
        """`dest`, holding the release's `folder` from the chain: written beside it, then renamed into place."""
        if dest.is_dir():
            return dest
        tmp = dest.with_name(f".{dest.name}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        self.chain.materialize(release_id, tmp, folder=folder)
        tmp.rename(dest)
        return dest
