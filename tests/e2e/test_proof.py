"""Proof before serving, through the real daemon and real worker processes: a release's fingerprint (the reference's
greedy answers on the probe set) is kept in the release, and every engine process that loads it must answer the
same before the binding moves. Workers launched with a test fault (`--fault`, in the scenario's launch_args) say
"success" to a load and serve something else; each is refused, and not one answer comes from the wrong weights."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.conftest import Daemon, make_scenarios, sdk
from tests.e2e.test_reefctl import reefctl
from tests.loras import make_lora

pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")  # peft, make_lora
PROMPT = [{"role": "user", "content": "Which release are you?"}]
FAULTS = ("empty-adapters", "corrupt-adapters")  # a stale adapter: tests/e2e/test_engines.py, on every engine


def scenario(fault: str | None) -> str:
    """The tiny model, as an engine of its own (one per fault), answering greedily."""
    model = "  name: tiny\n" if fault is None else \
        f"  name: tiny-{fault}\n  launch_args: [--fault, {fault}]\n"
    return ("defaults:\n  - model: tiny\n  - release: follow\n  - _self_\nserve:\n  default_max_tokens: 8\n"
            f"model:\n{model}")


@pytest.fixture(scope="module")
def d(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    base = tmp_path_factory.mktemp("proof")
    extra = {"good": scenario(None), **{fault: scenario(fault) for fault in FAULTS}}
    daemon = Daemon(scenarios=make_scenarios(base / "scenarios", names=(), extra=extra), state=base / "state",
                    log_path=base / "reefd.log", proof=True)
    daemon.start()
    yield daemon
    if daemon.proc is not None and daemon.proc.poll() is None:
        daemon.stop()


@pytest.fixture(scope="module")
def loras(d: Daemon, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("loras")
    model = d.state / "models" / "tiny"
    return {name: make_lora(model, root / name, seed=seed, scale=2.0) for name, seed in (("a", 1), ("b", 2))}


def ask(d: Daemon, name: str) -> tuple[str, str]:
    """(text, release) of one greedy answer."""
    c = sdk(openai.OpenAI(base_url=d.url + "/v1", api_key=d.token, max_retries=0,
                          default_headers={"x-reef-scenario": name}))
    raw = c.chat.completions.with_raw_response.create(model=name, messages=PROMPT, max_tokens=8, temperature=0)
    return raw.parse().choices[0].message.content or "", raw.headers["x-reef-release-id"]


def publish(d: Daemon, name: str, adapter: Path) -> dict[str, Any]:
    out = reefctl(d, "publish", name, "--adapter", str(adapter), "-o", "json")
    assert out.returncode == 0, out.stderr
    return dict(json.loads(out.stdout))


def status(d: Daemon, name: str) -> dict[str, Any]:
    data = json.loads(d.get("/reef/status")[1])
    return dict(next(s for s in data["scenarios"] if s["name"] == name))


def test_a_proven_release_carries_its_fingerprint_and_serves(d: Daemon, loras: dict[str, Path]) -> None:
    base_text, base = ask(d, "good")
    published = publish(d, "good", loras["a"])
    release = published["release"]
    proof = release["meta"]["proof"]
    assert len(proof["prompts"]) == 3 and all(len(t) == 8 for t in proof["tokens"])
    assert published["serving"] == release["id"]
    text, served = ask(d, "good")
    assert served == release["id"] and text != base_text and served != base


@pytest.mark.parametrize("fault", FAULTS)
def test_a_process_that_serves_something_else_is_refused_and_the_old_release_keeps_serving(
        d: Daemon, loras: dict[str, Path], fault: str) -> None:
    """An adapter load that answers success and serves the base model, or a damaged tensor:
    the proof fails, the adapter is taken off the process, and every answer still comes from the release before,
    with that release's own text; status says why."""
    before_text, before = ask(d, fault)
    published = publish(d, fault, loras["b"])
    new = published["release"]["id"]
    assert published["serving"] == before != new
    for _ in range(5):
        assert ask(d, fault) == (before_text, before)  # 0 answers from the release that failed its proof
    state = status(d, fault)
    assert state["release"] == before and new not in state["engine"]["adapters"]  # taken off again
    drift = state["releases"]["drift"]
    assert any("does not answer as adapter" in reason for reason in drift), drift
