"""What an engine kind declares it cannot swap to in place (reefd/engines SwapLimits: vLLM 0.32 and tied
embeddings), and every writer of full weights asking it before the chain is touched: the commit path
(reefd/loop.py `write`), the publish route's answer (409, before the upload), a Grow job before it trains, and the
engine's own swap, which refuses before it holds, drains or reloads anything. The vLLM server itself is not
started here (tests/e2e/test_engines.py publishes tied weights to a real one); where an engine's process would be
reached, nothing is (that is what is checked). Model folders are config.json files alone: the refusal reads
nothing else."""

from __future__ import annotations

import asyncio
import contextlib
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from aiohttp import web

from reefd import loop
from reefd.api.errors import _from_chain
from reefd.commit.chain import Candidate
from reefd.commit.chain_types import WeightsRefused
from reefd.engines import EngineError, ModelConfig, SwapLimits, Weights
from reefd.engines.sglang import SGLangEngine, WorkerEngine
from reefd.engines.vllm import VLLMEngine
from reefd.engines.vllm_client import TIED_EMBEDDINGS
from reefd.grow.job_kinds import JobFailed
from reefd.grow.job_kinds.weight_job import WeightsKind
from reefd.grow.job_store import Job
from reefd.serve.scenarios import Scenario


def model(folder: Path, tied: bool) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "tie_word_embeddings": tied}))
    return folder


def vllm(path: Path) -> VLLMEngine:
    return VLLMEngine(ModelConfig(name="t", engine="vllm", path=str(path)), path, None)


def scenario(engine: Any) -> Scenario:
    """A scenario as the registry builds it (what its engine declares is read once here); its config holds only
    what the refusal reads."""
    cfg = SimpleNamespace(name="tied", recipe=SimpleNamespace(backend="local"))
    return Scenario(cfg=cfg, engine=engine)  # type: ignore[arg-type]


def test_each_kind_declares_what_it_cannot_swap_to(tmp_path: Path) -> None:
    tied, untied = model(tmp_path / "tied", True), model(tmp_path / "untied", False)
    assert VLLMEngine.swap_limits == SwapLimits(tied_embeddings=TIED_EMBEDDINGS)
    assert VLLMEngine.swap_limits.refusal(tied) == TIED_EMBEDDINGS and "engine: worker" in TIED_EMBEDDINGS
    assert VLLMEngine.swap_limits.refusal(untied) is None
    VLLMEngine.swap_limits.refuse(None, "r1")  # no model folder yet: nothing to refuse
    for kind in (WorkerEngine, SGLangEngine):  # they reload tied weights in place right
        assert kind.swap_limits.refusal(tied) is None
    assert scenario(vllm(tied)).weights_refusal(tied) == TIED_EMBEDDINGS
    upstream = SimpleNamespace(kind="upstream")  # no full-weights ability at all
    assert scenario(upstream).weights_refusal(untied) == "its upstream engine loads no full weights"


def test_a_refused_swap_touches_nothing_that_serves(tmp_path: Path) -> None:
    """Refused before the admin lock: no request is held, nothing drained, nothing switched, no process reached
    (the engine has none: reaching one would fail otherwise), and the weights serving stay."""
    tied = model(tmp_path / "tied", True)
    engine = vllm(tied)
    calls: list[str] = []

    async def drained(version: str | None) -> None:
        calls.append("drained")

    async def go() -> None:
        with pytest.raises(EngineError, match="tied embeddings") as swap:
            await engine.swap_weights(tied, "r2", None, lambda: calls.append("switch"), drained)
        assert swap.value.status == 400 and str(swap.value).startswith("r2: vLLM 0.32")
        with pytest.raises(EngineError, match="tied embeddings"):
            await engine.stage_weights(tied, "r3", None, 0.5, drained)

    asyncio.run(go())
    assert calls == [] and engine._admission.is_set() and not engine._admin.locked()
    assert engine.weights == Weights() and engine.staged is None and engine.last_swap is None


def test_the_commit_path_refuses_weights_the_engine_cannot_serve(tmp_path: Path) -> None:
    """`write` asks the scenario's engine before the chain (or anything else of the app: this app has none) is
    touched; the API answers 409 `weights_refused`, saying nothing was written, as for other refused publishes."""
    tied = model(tmp_path / "tied", True)
    cand = Candidate("weights", {"source": "publish"}, artifact=tied)
    with pytest.raises(WeightsRefused) as refused:
        asyncio.run(loop.write(web.Application(), scenario(vllm(tied)), cand))
    assert str(refused.value) == f"scenario 'tied' cannot serve these full weights: {TIED_EMBEDDINGS}"
    answer = _from_chain(refused.value)
    assert answer is not None and (answer.status, answer.code) == (409, "weights_refused")
    assert str(answer).endswith("; nothing was written") and "tied embeddings" in str(answer)


def test_a_job_is_refused_before_it_trains_full_weights_the_engine_cannot_serve(tmp_path: Path) -> None:
    """`target: full` on a vLLM scenario whose model ties its embeddings: the job fails before its trainer runs
    (nothing trained, no gate, nothing committed), with the reason on the job."""
    tied = model(tmp_path / "tied", True)
    ran: list[Path] = []

    async def run(spec: Path, on_event: Any, timeout_s: float) -> int:
        ran.append(spec)
        return 0

    backend = SimpleNamespace(full_weights=False, pushes=False, run=run)
    runner = SimpleNamespace(backends=SimpleNamespace(get=lambda name: backend))
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"target": "full", "base_model": str(tied)}))
    job = Job("j-1", "tied", "manual", "sao", built_on="r1-abcdef0")

    async def train() -> None:
        async with contextlib.AsyncExitStack() as stack:
            await WeightsKind(runner).train(job, scenario(vllm(tied)), spec, stack)  # type: ignore[arg-type]

    with pytest.raises(JobFailed, match="not trained: scenario 'tied' cannot serve full weights") as failed:
        asyncio.run(train())
    assert TIED_EMBEDDINGS in str(failed.value) and ran == []
