"""Where a gate finds the serving release's per-task scores (reefd/commit/gates/memory.py, as reefd/grow/runner.py asks
it): what this process measured, keyed by adapter tree, else the `candidate` column of the gate that admitted the
release, in its release.json, following a rollback or promote to the release it copies. A real release chain; no
engine, no daemon."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from reefd.commit.chain import Release, ReleaseChain
from reefd.commit.gates.memory import ScoreMemory
from reefd.grow.runner import serving_key
from reefd.serve.scenarios import Binding


def adapter(tmp_path: Path, name: str) -> Path:
    d = tmp_path / name
    d.mkdir()
    (d / "adapter_model.safetensors").write_bytes(os.urandom(256))
    (d / "adapter_config.json").write_text('{"r": 8}\n')
    return d


def gate(fp: str, candidate: list[Any], current: list[Any]) -> dict[str, Any]:
    return {"verdict": "pass", "fingerprint": fp,
            "per_task": [{"candidate": c, "current": k} for c, k in zip(candidate, current, strict=True)]}


@pytest.fixture
def setup(tmp_path: Path) -> tuple[ScoreMemory, ReleaseChain, Release, Release]:
    chain = ReleaseChain(tmp_path / "releases.git")
    base = chain.publish("s", expected_head=None, kind="base", artifact_dir=None, meta={})
    r1 = chain.publish("s", expected_head=base.id, kind="adapter", artifact_dir=adapter(tmp_path, "a1"),
                       meta={"gate": gate("fp", [0.25, 1.0], [0.75, 0.0])})
    return ScoreMemory(lambda release: chain.get(release, include_rejected=True).meta), chain, base, r1


def known(memory: ScoreMemory, binding: Binding, digest: str) -> list[float] | None:
    """What the runner's gate stage asks for the serving side `binding`."""
    return memory.known(serving_key(binding), binding.release if binding.artifact is not None else None, digest)


def bound(chain: ReleaseChain, rel: Release) -> Binding:
    return Binding(rel.id, rel.id, chain.artifacts(rel.id)["adapter"])


def test_the_admitting_gate_candidate_column_is_the_serving_release_score(setup: Any) -> None:
    memory, chain, _, r1 = setup
    assert known(memory, bound(chain, r1), "fp") == [0.25, 1.0]  # not the current column
    assert known(memory, bound(chain, r1), "other") is None


def test_a_rollback_finds_the_scores_of_the_release_it_copies(setup: Any, tmp_path: Path) -> None:
    memory, chain, _, r1 = setup
    r2 = chain.publish("s", expected_head=r1.id, kind="adapter", artifact_dir=adapter(tmp_path, "a2"),
                       meta={"gate": gate("fp", [0.0, 0.0], [0.25, 1.0])})
    assert known(memory, bound(chain, r2), "fp") == [0.0, 0.0]
    back = chain.rollback("s", r1.id, expected_head=r2.id)
    assert back.kind == "rollback" and "gate" not in back.meta
    assert known(memory, bound(chain, back), "fp") == [0.25, 1.0]


def test_measured_scores_are_remembered_by_adapter_tree_and_base(setup: Any) -> None:
    memory, chain, base, r1 = setup
    serving = bound(chain, r1)
    memory.remember(serving.artifact, "fp2", [0.5, 0.0])
    assert known(memory, serving, "fp2") == [0.5, 0.0]
    assert known(memory, Binding(base.id), "fp2") is None  # the base model is another side
    memory.remember("base", "fp2", [1.0, 1.0])
    assert known(memory, Binding(base.id), "fp2") == [1.0, 1.0]
    memory.remember(serving.artifact, "fp3", [0.5, None])  # an unscored task: nothing kept
    assert known(memory, serving, "fp3") is None


def test_a_malformed_gate_record_is_not_used(setup: Any, tmp_path: Path) -> None:
    memory, chain, _, r1 = setup
    bad = chain.publish("s", expected_head=r1.id, kind="adapter", artifact_dir=adapter(tmp_path, "a3"),
                        meta={"gate": gate("fp", [1.0, None], [0.0, 0.0])})
    assert known(memory, bound(chain, bad), "fp") is None
