"""Full weights on a canary trial across replicas behind the real sglang-router, on the tiny model: the release on
trial is staged on one of two replicas, out of the router, and the sessions placed on its side are sent there;
the same sequential test on the client's reports decides, and its decision is a release: a promote returns the
staged replica to the router and rolls the other onto its weights, a rollback puts the staged replica back on
the stable weights once its requests are done. Under load throughout, no request fails, and every answer's
record names the weights that really produced it. With one replica a weights release is refused for a canary.
One reefd for the module, a scenario (on an engine of its own) per test."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import Daemon, shared_daemon
from tests.e2e.test_canary import PROMPTS, Traffic, ask, head
from tests.e2e.test_reefctl import reefctl
from tests.e2e.test_weights import Load, check_weights_of_answers, engine, record
from tests.loras import make_weights

pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")


@pytest.fixture(scope="module")
def wcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    yield from shared_daemon(tmp_path_factory.mktemp("weights-canary"))


def scenario(replicas: int) -> str:
    """A canary scenario on an engine of its own; one request at a time per replica, so that the greedy answers
    the client scores never share a batch (which can move the tiny model's answers). The client's scores differ
    by 1 with no spread, so the first look (4 scores a side) decides."""
    return f"""defaults:
  - model: tiny
  - release: follow
  - _self_
model:
  name: wcanary-{replicas}
  replicas: {replicas}
  max_batch: 1
serve:
  default_max_tokens: 6
  temperature: 0
release:
  canary: {{share: 0.5, min_reports: 4, max_drop: 0.1, confidence: 0.95, max_age_s: 600}}
"""


def started(d: Daemon, own_scenario: Callable[..., str], tmp_path: Path, seed: int
            ) -> tuple[str, str, dict[str, str], Path]:
    """A two-replica canary scenario with both replicas in the router: its name, base release, the base's greedy
    answers to PROMPTS, and full weights that answer otherwise."""
    name = own_scenario(d, scenario(2), prefix="wc")
    deadline = time.monotonic() + 120
    while not all(r["in_router"] for r in engine(d, name)["replicas"]) and time.monotonic() < deadline:
        time.sleep(0.2)
    base = head(d, name)["id"]
    answers = {p: ask(d, name, [{"role": "user", "content": p}], f"ref-{i}")[0] for i, p in enumerate(PROMPTS)}
    weights = make_weights(d.state / "models" / "tiny", tmp_path / "weights", seed=seed, scale=1.0)  # (all 6 differ)
    return name, base, answers, weights


def publish_weights(d: Daemon, name: str, weights: Path) -> dict[str, Any]:
    out = reefctl(d, "publish", name, "--weights", str(weights), "-o", "json")
    assert out.returncode == 0, out.stderr
    return dict(json.loads(out.stdout))


def staged(d: Daemon, name: str, release: str | None) -> list[dict[str, Any]]:
    """The replicas; with `release`, asserting one serves it on trial out of the router, the other the base in it."""
    replicas = list(engine(d, name)["replicas"])
    if release is not None:
        assert sorted((r["state"], r["weights"], r["in_router"]) for r in replicas) == \
            [("ready", None, True), ("trial", release, False)], replicas
    return replicas


def until_all_on(d: Daemon, name: str, weights: str | None) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if all(r["state"] == "ready" and r["in_router"] and r["weights"] == weights for r in staged(d, name, None)):
            return
        time.sleep(0.1)
    raise AssertionError(f"replicas not all on {weights}: {staged(d, name, None)}")


def check_traffic(d: Daemon, traffic: Traffic, load: Load, trial: str, stable: str, expected: dict[str, str | None]
                  ) -> None:
    """Sessions kept their side; both sides served; no request failed; every answer came from its release's
    weights."""
    assert load.failures == []
    sides = {releases[0] for releases in traffic.served.values() if releases[0] in (trial, stable)}
    assert sides == {trial, stable}
    for releases in traffic.served.values():  # sticky: a session's turns before the decision stay on its side
        before = [r for r in releases if r in (trial, stable)]
        assert len(set(before)) <= 1, releases
    results = [*load.results, *({"receipt": rc, "release": rel} for rc, rel in traffic.receipts)]
    check_weights_of_answers(d, results, expected)


def test_full_weights_on_canary_across_replicas_are_promoted(wcd: Daemon, own_scenario: Callable[..., str],
                                                             tmp_path: Path) -> None:
    """The client prefers any answer other than the base model's: the new weights win."""
    d = wcd
    name, base, answers, weights = started(d, own_scenario, tmp_path, seed=1)
    with Load(d, name, clients=1) as load:
        published = publish_weights(d, name, weights)
        trial = published["release"]["id"]
        assert published["serving"] == base and published["trial"]["release"] == trial
        staged(d, name, trial)
        traffic = Traffic(d, name, answers, score=lambda prompt, answer: answer != answers[prompt])
        decided = traffic.until_decided(trial, turns=2)
        evidence = decided["meta"]["canary"]
        assert decided["kind"] == "promote" and evidence["decision"] == "promote", decided
        assert evidence["canary"]["mean"] == 1.0 and evidence["stable"]["mean"] == 0.0, evidence
        until_all_on(d, name, trial)  # the staged replica kept its weights; the other took them
        load.wait(4)
    swap = engine(d, name)["last_swap"]
    assert swap["promoted"] == 1 and swap["held_s"] == 0.0, swap
    check_traffic(d, traffic, load, trial, base, {base: None, trial: trial, decided["id"]: trial})
    _, release, receipt = ask(d, name, [{"role": "user", "content": PROMPTS[0]}], "after")
    assert release == decided["id"] and record(d, receipt)["engine_weights"] == trial


def test_full_weights_on_canary_across_replicas_are_rolled_back(wcd: Daemon, own_scenario: Callable[..., str],
                                                                tmp_path: Path) -> None:
    """The client wants the base model's answers: the new weights lose, and their replica goes back to the base
    weights and into the router, with no request failed; one that restarts meanwhile comes back on trial."""
    d = wcd
    name, base, answers, weights = started(d, own_scenario, tmp_path, seed=1)
    with Load(d, name, clients=1) as load:
        trial = publish_weights(d, name, weights)["release"]["id"]
        pid = next(r["pid"] for r in staged(d, name, trial) if r["state"] == "trial")
        os.kill(pid, signal.SIGKILL)  # the staged replica dies: its restart stages it again, out of the router
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            replicas = staged(d, name, None)
            if any(r["state"] == "trial" and r["pid"] != pid for r in replicas):
                break
            time.sleep(0.2)
        staged(d, name, trial)
        traffic = Traffic(d, name, answers)
        decided = traffic.until_decided(trial, turns=2)
        evidence = decided["meta"]["canary"]
        assert decided["kind"] == "rollback" and decided["meta"]["target"] == base, decided
        assert evidence["canary"]["mean"] == 0.0 and evidence["stable"]["mean"] == 1.0, evidence
        until_all_on(d, name, None)
        load.wait(4)
    check_traffic(d, traffic, load, trial, base, {base: None, trial: trial, decided["id"]: None})
    answer, release, _ = ask(d, name, [{"role": "user", "content": PROMPTS[0]}], "after")
    assert release == decided["id"] and answer == answers[PROMPTS[0]]


def test_one_replica_refuses_full_weights_for_a_canary(wcd: Daemon, own_scenario: Callable[..., str],
                                                       tmp_path: Path) -> None:
    d = wcd
    name = own_scenario(d, scenario(1), prefix="wc")
    weights = make_weights(d.state / "models" / "tiny", tmp_path / "weights", seed=3, scale=0.5)
    before = head(d, name)["id"]
    out = reefctl(d, "publish", name, "--weights", str(weights))
    assert out.returncode != 0
    assert "puts new releases on a canary trial" in out.stderr and "model.replicas: 2 or more" in out.stderr, \
        out.stderr
    assert "trial_needs_replicas" in out.stderr or "409" in out.stderr, out.stderr
    assert head(d, name)["id"] == before
