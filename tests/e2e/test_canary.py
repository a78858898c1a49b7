"""Canary and shadow trials through the real daemon on the tiny model.

The scorer is the test's client: it rates an answer 1 when it is the reference answer to its prompt, else 0. The
references are what adapter `good` answers greedily, served by a scenario without a trial on the same engine. So
`good` is the better release against the base model, and `bad` (another adapter) is the worse one against `good`.
Every decision must come from the reports the client posts; nothing is told which side answered.
"""

from __future__ import annotations

import contextlib
import json
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import Daemon, make_scenarios
from tests.e2e.test_reefctl import reefctl
from tests.loras import make_lora

pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")

PROMPTS = [f"Question number {i}: what comes next?" for i in range(6)]
BASE = ("defaults:\n  - model: tiny\n  - release: follow\n  - _self_\n"
        "serve:\n  default_max_tokens: 6\n  temperature: 0\n")
CANARY = "release:\n  canary: {share: 0.5, min_reports: 6, max_drop: 0.1, confidence: 0.95, max_age_s: 600}\n"
SHADOW = ("release:\n  shadow: {share: 1.0, min_reports: 6, max_drop: 0.1, confidence: 0.95, max_age_s: 600, "
          "scorer: 'tests.e2e.canary_scorer:score'}\n")


@pytest.fixture(scope="module")
def d(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    base = tmp_path_factory.mktemp("canary")
    scenarios = {"ref": BASE, "canary": BASE + CANARY, "resume": BASE + CANARY, "pinned": BASE + CANARY,
                 "shadow": BASE + SHADOW, "operator": BASE + CANARY, "unready": BASE + CANARY}
    folder = make_scenarios(base / "scenarios", names=(), extra=scenarios)
    daemon = Daemon(scenarios=folder, state=base / "state", log_path=base / "reefd.log",
                    env={"REEF_TEST_SCENARIOS": str(folder)}, proof=True)  # each release proven as it is bound
    (folder / "references.json").write_text("{}")
    daemon.start()
    yield daemon
    if daemon.proc is not None and daemon.proc.poll() is None:
        daemon.stop()


@pytest.fixture(scope="module")
def loras(d: Daemon, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("loras")
    model = d.state / "models" / "tiny"
    return {name: make_lora(model, root / name, seed=seed, scale=2.0)
            for name, seed in (("good", 11), ("bad", 12), ("other", 13))}


def ask(d: Daemon, scenario: str, messages: list[dict[str, Any]], session: str) -> tuple[str, str, str]:
    """(answer, release header, receipt) of one greedy turn of `session`."""
    status, body, headers = d.post("/v1/chat/completions", {"model": scenario, "messages": messages},
                                   headers={"x-reef-scenario": scenario, "x-reef-session": session})
    assert status == 200, body
    lower = {k.lower(): v for k, v in headers.items()}
    return body["choices"][0]["message"]["content"], lower["x-reef-release-id"], lower["x-reef-agent-record-id"]


def report(d: Daemon, scenario: str, receipt: str, score: float) -> None:
    status, body, _ = d.post("/reef/report", {"score": score, "references": [receipt]},
                             headers={"x-reef-scenario": scenario})
    assert status in (200, 201), body


def publish(d: Daemon, scenario: str, adapter: Path) -> dict[str, Any]:
    out = reefctl(d, "publish", scenario, "--adapter", str(adapter), "-o", "json")
    assert out.returncode == 0, out.stderr
    return dict(json.loads(out.stdout))


def head(d: Daemon, scenario: str) -> dict[str, Any]:
    page = json.loads(d.get(f"/reef/scenarios/{scenario}/releases")[1])
    return dict(page["data"][0])


def status(d: Daemon, scenario: str) -> dict[str, Any]:
    data = json.loads(d.get("/reef/status")[1])
    return dict(next(s for s in data["scenarios"] if s["name"] == scenario))


@pytest.fixture(scope="module")
def references(d: Daemon, loras: dict[str, Path]) -> dict[str, str]:
    """What `good` answers to each prompt (the scorer's reference answers)."""
    publish(d, "ref", loras["good"])
    return {p: ask(d, "ref", [{"role": "user", "content": p}], f"ref-{i}")[0] for i, p in enumerate(PROMPTS)}


class Traffic:
    """Sessions of three turns each; the first turn of every session is scored and reported."""

    def __init__(self, d: Daemon, scenario: str, references: dict[str, str],
                 score: Callable[[str, str], bool] | None = None) -> None:
        self.d, self.scenario, self.references = d, scenario, references
        self.score = score or (lambda prompt, answer: answer == self.references[prompt])  # the client's scorer
        self.receipts: list[tuple[str, str]] = []  # (receipt, release) of every turn
        self.sessions = 0
        self.served: dict[str, list[str]] = {}  # session -> the release of each of its turns

    def session(self, turns: int = 3) -> None:
        name = f"{self.scenario}-s{self.sessions}"
        prompt = PROMPTS[self.sessions % len(PROMPTS)]
        self.sessions += 1
        messages: list[dict[str, Any]] = [{"role": "user", "content": prompt}]
        for turn in range(turns):
            answer, release, receipt = ask(self.d, self.scenario, messages, name)
            self.served.setdefault(name, []).append(release)
            self.receipts.append((receipt, release))
            if turn == 0:
                report(self.d, self.scenario, receipt, 1.0 if self.score(prompt, answer) else 0.0)
            messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "go on"}]

    def until_decided(self, on_trial: str, timeout_s: float = 120.0, turns: int = 3) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            now = head(self.d, self.scenario)
            if now["id"] != on_trial:
                return now
            self.session(turns)
        raise AssertionError(f"no decision in {timeout_s} s: {status(self.d, self.scenario).get('canary')}")


def test_a_better_release_is_promoted_and_a_worse_one_rolled_back(d: Daemon, loras: dict[str, Path],
                                                                  references: dict[str, str]) -> None:
    base = head(d, "canary")["id"]
    published = publish(d, "canary", loras["good"])
    good = published["release"]["id"]
    assert published["serving"] == base  # the stable release still serves everyone else
    assert published["trial"] == {"mode": "canary", "release": good, "share": 0.5, "stable": base}
    trial = published["release"]["meta"]["canary"]
    assert (trial["mode"], trial["stable"], trial["share"]) == ("canary", base, 0.5)
    traffic = Traffic(d, "canary", references)
    for _ in range(4):
        traffic.session()
    progress = status(d, "canary")["canary"]
    assert progress["release"] == good and progress["stable_release"] == base
    assert progress["canary"]["n"] + progress["stable"]["n"] == 4
    shown = reefctl(d, "status")
    assert shown.returncode == 0 and f"scenario canary: canary {good} on 50% of sessions vs {base}" in shown.stdout

    promoted = traffic.until_decided(good)
    assert promoted["kind"] == "promote" and promoted["meta"]["source"] == "canary"
    evidence = promoted["meta"]["canary"]
    assert evidence["decision"] == "promote" and evidence["release"] == good
    assert evidence["canary"]["mean"] == 1.0 and evidence["stable"]["mean"] == 0.0
    assert min(evidence["canary"]["n"], evidence["stable"]["n"]) >= 6
    assert evidence["interval"][0] > -0.1 and evidence["test"]["kind"] == "Welch t, one-sided"
    sides = {releases[0] for releases in traffic.served.values()}
    assert sides == {good, base}  # both sides served sessions
    for session, releases in traffic.served.items():  # sticky by session while the canary runs (the decision
        during = [r for r in releases if r in (good, base)]  # then moves everyone to the promoted release)
        assert len(set(during)) == 1 and releases[len(during):] == [promoted["id"]] * (len(releases) - len(during)), \
            f"session {session} flipped: {releases}"
    assert "canary" not in status(d, "canary")
    answer, release, _ = ask(d, "canary", [{"role": "user", "content": PROMPTS[0]}], "after-promote")
    assert (answer, release) == (references[PROMPTS[0]], promoted["id"])  # everyone gets the promoted release

    worse = publish(d, "canary", loras["bad"])["release"]["id"]
    traffic = Traffic(d, "canary", references)
    rolled = traffic.until_decided(worse)
    assert rolled["kind"] == "rollback" and rolled["meta"]["source"] == "canary"
    evidence = rolled["meta"]["canary"]
    assert evidence["decision"] == "rollback" and evidence["stable_release"] == promoted["id"]
    assert evidence["canary"]["mean"] < evidence["stable"]["mean"] and evidence["interval"][1] < -0.1
    assert rolled["meta"]["target"] == promoted["id"]
    answer, release, _ = ask(d, "canary", [{"role": "user", "content": PROMPTS[1]}], "after-rollback")
    assert (answer, release) == (references[PROMPTS[1]], rolled["id"])
    history = reefctl(d, "history", "canary")
    assert history.returncode == 0
    assert "canary rolled back" in history.stdout and "canary promoted" in history.stdout


def test_a_restart_resumes_the_canary_with_its_counts(d: Daemon, loras: dict[str, Path],
                                                      references: dict[str, str]) -> None:
    """And reefd is ready only once every trial is back: one whose adapter cannot be restored (its object gone
    from the chain's LFS store) keeps /readyz at 503, with the reason in status, until it is back."""
    good = publish(d, "resume", loras["good"])["release"]["id"]
    other = publish(d, "unready", loras["other"])["release"]["id"]
    traffic = Traffic(d, "resume", references)
    for _ in range(5):  # at most 5 scores a side: no look yet
        traffic.session(turns=1)
    before = status(d, "resume")["canary"]
    assert before["canary"]["n"] + before["stable"]["n"] == 5
    first_session = "resume-s0"
    side = traffic.served[first_session][0]

    oid = next(f["sha256"] for f in json.loads(d.get(f"/reef/releases/{other}")[1])["files"]
               if f["path"].endswith(".safetensors"))
    assert d.stop() == 0
    lfs = d.state / "releases.git" / "lfs" / "objects" / oid[:2] / oid[2:4] / oid
    lfs.rename(lfs.with_suffix(".away"))
    d.start(wait_ready=False)
    deadline, unready = time.monotonic() + 120, None
    while time.monotonic() < deadline:  # until both have been reconciled: one with its trial, one without
        with contextlib.suppress(OSError):
            if status(d, "resume").get("canary", {}).get("loaded") and \
                    len((unready := status(d, "unready"))["releases"]["drift"]) == 2:
                break
        time.sleep(0.2)
    assert unready is not None and "canary" not in unready, unready
    assert d.get("/readyz")[0] == 503
    assert f"serving {unready['release']} but the chain head is {other}" in unready["releases"]["drift"], unready
    lfs.with_suffix(".away").rename(lfs)
    d.reload()  # a reconcile now: the trial is back, reefd ready
    assert status(d, "unready")["canary"]["release"] == other
    after = status(d, "resume")["canary"]
    deadline = time.monotonic() + 30
    while not after["loaded"] and time.monotonic() < deadline:
        time.sleep(0.2)
        after = status(d, "resume")["canary"]
    assert (after["canary"], after["stable"]) == (before["canary"], before["stable"])
    assert after["started_at"] == before["started_at"]
    messages = [{"role": "user", "content": PROMPTS[0]}]
    first = ask(d, "resume", messages, first_session)  # a session from before the restart keeps its side
    assert first[1] == side
    decided = traffic.until_decided(good)
    assert decided["kind"] == "promote" and decided["meta"]["canary"]["decision"] == "promote"


def test_a_pin_in_the_file_overrides_the_canary(d: Daemon, loras: dict[str, Path],
                                                references: dict[str, str]) -> None:
    base = head(d, "pinned")["id"]
    good = publish(d, "pinned", loras["good"])["release"]["id"]
    assert status(d, "pinned")["canary"]["release"] == good
    (d.scenarios / "pinned.yaml").write_text(BASE + CANARY.replace("release:\n", f"release:\n  pin: {base}\n"))
    assert d.proc is not None
    d.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 30
    while head(d, "pinned")["id"] == good and time.monotonic() < deadline:
        time.sleep(0.1)
    pinned = head(d, "pinned")
    assert pinned["kind"] == "rollback" and pinned["meta"]["source"] == "pin"
    assert "canary" not in status(d, "pinned")
    traffic = Traffic(d, "pinned", references)
    for _ in range(16):  # what would decide a canary decides nothing here: the pin serves everyone
        traffic.session(turns=1)
    assert {r for releases in traffic.served.values() for r in releases} == {pinned["id"]}
    assert head(d, "pinned")["id"] == pinned["id"]


def test_a_shadow_answers_copies_and_is_promoted_on_its_scores(d: Daemon, loras: dict[str, Path],
                                                               references: dict[str, str]) -> None:
    base = head(d, "shadow")["id"]
    (d.scenarios / "references.json").write_text(json.dumps(references))
    good = publish(d, "shadow", loras["good"])["release"]["id"]
    traffic = Traffic(d, "shadow", references)
    decided = None
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        traffic.session(turns=1)
        if head(d, "shadow")["id"] != good:
            decided = head(d, "shadow")
            break
        time.sleep(0.05)
    assert decided is not None, status(d, "shadow").get("canary")
    served = {r for releases in traffic.served.values() for r in releases}
    assert served - {decided["id"]} == {base}  # until the decision the copies' answers were never returned
    evidence = decided["meta"]["canary"]
    assert decided["kind"] == "promote" and evidence["mode"] == "shadow" and evidence["decision"] == "promote"
    assert evidence["pairs"]["n"] >= 6 and evidence["test"]["kind"] == "paired t, one-sided"
    records = json.loads(d.get("/reef/scenarios/shadow/records?limit=200")[1])["data"]
    shadows = [r for r in records if r.get("turn_kind") == "shadow"]
    assert shadows and all(r["release"] == good for r in shadows)
    # a copy may share a batch with the next turn, which can move a greedy answer of the tiny model: most match
    assert sum(r["shadow"]["score"] for r in shadows) / len(shadows) > 0.5 > \
        sum(r["shadow"]["served_score"] for r in shadows) / len(shadows), \
        [(r["shadow"], r["messages"][-1]["content"]) for r in shadows]
    originals = {r["id"] for r in records if r.get("turn_kind") != "shadow"}
    assert all(r["shadow"]["of"] in originals for r in shadows)


def test_a_new_candidate_replaces_the_canary_and_an_operators_rollback_goes_to_the_stable_release(
        d: Daemon, loras: dict[str, Path]) -> None:
    base = head(d, "operator")["id"]
    first = publish(d, "operator", loras["good"])["release"]["id"]
    second = publish(d, "operator", loras["bad"])
    assert second["trial"]["stable"] == base  # against the same stable release
    assert second["release"]["meta"]["canary"]["supersedes"]["release"] == first
    out = reefctl(d, "rollback", "operator", "-o", "json")
    assert out.returncode == 0, out.stderr
    rolled = json.loads(out.stdout)
    assert (rolled["from"], rolled["to"]) == (second["release"]["id"], base)  # not the superseded canary
    evidence = rolled["release"]["meta"]["canary"]
    assert (evidence["decision"], evidence["reason"]) == ("rollback", "decided by an operator")
    assert "trial" not in rolled and rolled["serving"] == rolled["release"]["id"]
    assert "canary" not in status(d, "operator")
