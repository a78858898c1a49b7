"""Full-weights releases through the real daemon, real worker processes and (with 2 replicas) the real
sglang-router, on the tiny model: `reefctl publish --weights` under load fails no request; with one engine new
requests are held while the weights load, with two the swap rolls one replica at a time and holds nothing; every
answer's release names the weights that really produced it (the engine's own weight_version, in its record);
adapters ride on the weights they were trained on; and a weights release comes back byte-exact from a plain
`git clone` + `git lfs pull`. Full weights on a canary trial are staged on one of two replicas, out of the router:
the trial's sessions are sent there, the client's reports decide, and a promote or a rollback fails no request
(one replica refuses a weights canary). One reefd for the module, a scenario (on an engine of its own) per
test."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import signal
import tarfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.conftest import Daemon, sdk, shared_daemon
from tests.e2e.test_canary import PROMPTS, Traffic, ask, head
from tests.e2e.test_reefctl import reefctl
from tests.loras import make_lora, make_weights
from tests.test_releases import git

pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")


@pytest.fixture(scope="module")
def weightsd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    yield from shared_daemon(tmp_path_factory.mktemp("weights"))


def scenario(replicas: int) -> str:
    """A scenario on an engine of its own (a model config no other scenario has: one engine serves one set of
    weights)."""
    return f"""defaults:
  - model: tiny
  - _self_
model:
  name: weights-{replicas}
  replicas: {replicas}
serve:
  temperature: 0.0
"""


class Load:
    """Clients of the official SDK (no retries) asking in a loop, streamed and not, each on its own session, until
    stopped; every answer's status, release header and receipt is kept."""

    def __init__(self, d: Daemon, name: str, clients: int = 3) -> None:
        self.d, self.name = d, name
        self.results: list[dict[str, Any]] = []
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(clients)]

    def __enter__(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(120)

    def wait(self, answers: int, timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        start = len(self.results)
        while len(self.results) < start + answers and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(self.results) >= start + answers, (self.failures, len(self.results))

    def _run(self, i: int) -> None:
        client = sdk(openai.OpenAI(base_url=self.d.url + "/v1", api_key=self.d.token, max_retries=0,
                                   default_headers={"x-reef-scenario": self.name, "x-reef-session": f"s{i}"}))
        n = 0
        while not self._stop.is_set():
            n += 1
            stream = n % 2 == 0
            started = time.monotonic()
            try:
                if stream:
                    with client.chat.completions.with_streaming_response.create(
                            model=self.name, messages=[{"role": "user", "content": f"count {n}"}], stream=True,
                            max_tokens=8) as resp:
                        lines = [line for line in resp.iter_lines() if line]
                        headers = resp.headers
                    if lines[-1] != "data: [DONE]":
                        raise AssertionError(f"stream ended without [DONE]: {lines[-2:]}")
                else:
                    raw = client.chat.completions.with_raw_response.create(
                        model=self.name, messages=[{"role": "user", "content": f"count {n}"}], max_tokens=8)
                    headers = raw.headers
                self.results.append({"receipt": headers["x-reef-agent-record-id"],
                                     "release": headers["x-reef-release-id"], "stream": stream,
                                     "latency_s": time.monotonic() - started})
            except Exception as exc:  # a failed request: the test fails on it
                self.failures.append(f"{type(exc).__name__}: {exc}")


def publish_under_load(d: Daemon, name: str, *args: str, clients: int, answers: int
                       ) -> tuple[dict[str, Any], Load]:
    """`reefctl publish NAME ARGS -o json` while `clients` ask without pause, with `answers` answers before and
    after it: reefd's answer and the load."""
    with Load(d, name, clients=clients) as load:
        load.wait(answers)
        out = reefctl(d, "publish", name, *args, "-o", "json")
        assert out.returncode == 0, out.stderr
        load.wait(answers)
    return dict(json.loads(out.stdout)), load


def record(d: Daemon, receipt: str) -> dict[str, Any]:
    code, body = d.get(f"/reef/records/{receipt}")
    assert code == 200, body
    return dict(json.loads(body))


def engine(d: Daemon, name: str) -> dict[str, Any]:
    found = [s for s in json.loads(d.get("/reef/status")[1])["scenarios"] if s["name"] == name]
    return dict(found[0]["engine"])


def all_in_router(d: Daemon, name: str, replicas: int | None = None) -> None:
    """Until every replica of the scenario's engine (and at least `replicas` of them) is in the router."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        listed = engine(d, name).get("replicas") or []
        if listed and all(r["in_router"] for r in listed) and len(listed) >= (replicas or 0):
            return
        time.sleep(0.2)


def check_weights_of_answers(d: Daemon, results: list[dict[str, Any]], expected: dict[str, str | None]) -> None:
    """Every answer's record: the weights its release serves are the weights the engine says answered it."""
    for r in results:
        rec = record(d, r["receipt"])
        assert rec["release"] == r["release"]
        assert r["release"] in expected, (r, expected)
        want = expected[r["release"]]
        assert rec["weights"] == want, (rec["release"], rec["weights"], want)
        assert rec["engine_weights"] == want, (rec["release"], rec["engine_weights"], want)


def greedy(d: Daemon, name: str) -> tuple[str, str]:
    code, body, headers = d.post("/v1/chat/completions", {
        "model": name, "messages": [{"role": "user", "content": "tell me a story"}], "max_tokens": 12,
        "temperature": 0}, headers={"x-reef-scenario": name})
    assert code == 200, body
    return body["choices"][0]["message"]["content"], headers["x-reef-release-id"]


PAIR = """defaults:
  - model: tiny
  - _self_
model:
  max_batch: 4
"""


def test_weights_release_on_one_engine(weightsd: Daemon, own_scenario: Callable[..., str], tmp_path: Path) -> None:
    d = weightsd
    name = own_scenario(d, scenario(1), prefix="w", files={"pair.yaml": PAIR, "pair2.yaml": PAIR})
    base_text, base = greedy(d, name)
    tiny = d.state / "models" / "tiny"
    weights = make_weights(tiny, tmp_path / "weights", seed=1, scale=0.5)

    # a folder that is not the base's architecture is refused, and nothing is published
    bad = tmp_path / "bad"
    shutil.copytree(weights, bad)
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 7}))
    out = reefctl(d, "publish", name, "--weights", str(bad))
    assert out.returncode == 1 and "num_hidden_layers is 7" in out.stderr, out.stderr
    code, body, _ = d.post(f"/reef/scenarios/{name}/releases?kind=weights", tar_of(bad),
                           headers={"content-type": "application/x-tar"})
    assert code == 400 and body["error"]["code"] == "invalid_weights", body
    assert [r["id"] for r in json.loads(d.get(f"/reef/scenarios/{name}/releases")[1])["data"]] == [base]

    # scenarios that share one engine cannot take full weights: the others would answer from them too
    code, body, _ = d.post("/reef/scenarios/pair/releases?kind=weights", tar_of(weights),
                           headers={"content-type": "application/x-tar"})
    assert code == 409 and body["error"]["code"] == "engine_shared" and "pair2" in body["error"]["message"]

    answer, load = publish_under_load(d, name, "--weights", str(weights), "--summary", "noisy", clients=3, answers=6)
    w = answer["release"]["id"]
    assert answer["serving"] == w and answer["release"]["kind"] == "weights"
    assert load.failures == []
    assert {r["release"] for r in load.results} == {base, w}
    check_weights_of_answers(d, load.results, {base: None, w: w})
    swap = engine(d, name)["last_swap"]
    assert swap["replicas"] == 1 and swap["version"] == w and swap["held_s"] > 0
    text, served = greedy(d, name)
    assert served == w and text != base_text

    # an adapter on top names the weights it was trained on and serves on them
    lora = make_lora(weights, tmp_path / "lora", seed=3, scale=2.0)
    out = reefctl(d, "publish", name, "--adapter", str(lora), "-o", "json")
    assert out.returncode == 0, out.stderr
    on_w = json.loads(out.stdout)["release"]
    assert on_w["meta"]["weights"]["release"] == w
    shown = json.loads(d.get(f"/reef/releases/{on_w['id']}")[1])
    assert {f["path"].split("/")[0] for f in shown["files"]} >= {"weights", "adapter"}
    adapted, served = greedy(d, name)
    assert served == on_w["id"] and adapted != text
    assert record(d, load_one(d, name))["engine_weights"] == w

    # rollback to the base: the launch weights serve again, as that rollback release
    out = reefctl(d, "rollback", name, "--to", base, "-o", "json")
    assert out.returncode == 0, out.stderr
    back = json.loads(out.stdout)["release"]["id"]
    again, served = greedy(d, name)
    assert served == back and again == base_text
    assert record(d, load_one(d, name))["engine_weights"] == back

    # promote the weights release again: its tree is already in the chain
    out = reefctl(d, "promote", name, w, "-o", "json")
    assert out.returncode == 0, out.stderr
    assert greedy(d, name)[0] == text

    # a plain git clone + git lfs pull restores the weights byte for byte
    work = tmp_path / "work"
    git(tmp_path, "lfs", "install", "--skip-repo")
    git(tmp_path, "clone", "-q", (d.state / "releases.git").as_uri(), str(work))
    git(tmp_path, "fetch", "-q", "origin", "refs/reef/*:refs/reef/*", cwd=work)
    commit = json.loads(d.get(f"/reef/releases/{w}")[1])["commit"]
    git(tmp_path, "checkout", "-q", commit, cwd=work, extra={"GIT_LFS_SKIP_SMUDGE": "1"})
    git(tmp_path, "lfs", "pull", cwd=work)
    for f in weights.iterdir():
        assert (work / "weights" / f.name).read_bytes() == f.read_bytes(), f.name
    assert "weights/model.safetensors" in git(tmp_path, "lfs", "ls-files", cwd=work)
    assert "Git LFS fsck OK" in git(tmp_path, "lfs", "fsck", cwd=work)


def tar_of(folder: Path) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for f in sorted(folder.iterdir()):
            tar.add(f, arcname=f.name)
    return buf.getvalue()


def load_one(d: Daemon, name: str) -> str:
    code, body, headers = d.post("/v1/chat/completions", {"model": name, "messages": [{"role": "user", "content": "x"}],
                                                         "max_tokens": 2}, headers={"x-reef-scenario": name})
    assert code == 200, body
    return str(headers["x-reef-agent-record-id"])


def test_weights_roll_across_two_replicas(weightsd: Daemon, own_scenario: Callable[..., str], tmp_path: Path) -> None:
    d = weightsd
    name = own_scenario(d, scenario(2), prefix="w")
    all_in_router(d, name)
    base_text, base = greedy(d, name)
    weights = make_weights(d.state / "models" / "tiny", tmp_path / "weights", seed=1, scale=0.5)
    answer, load = publish_under_load(d, name, "--weights", str(weights), clients=4, answers=8)
    w = answer["release"]["id"]
    assert load.failures == []
    assert {r["release"] for r in load.results} == {base, w}
    check_weights_of_answers(d, load.results, {base: None, w: w})
    status = engine(d, name)
    swap = status["last_swap"]
    assert swap["replicas"] == 2 and swap["held_s"] == 0.0, swap
    assert [r["weights"] for r in status["replicas"]] == [w, w]
    text = reefctl(d, "status").stdout
    assert text.count(f"weights {w}") == 2 and f"last weights swap: {w} on 2 process(es)" in text, text
    assert all(r["in_router"] and r["state"] == "ready" for r in status["replicas"])
    text, served = greedy(d, name)
    assert served == w and text != base_text
    # both replicas answer with the new weights (sessions pin each to one replica)
    for session in ("a", "b", "c", "d"):
        code, body, headers = d.post("/v1/chat/completions", {
            "model": name, "messages": [{"role": "user", "content": "tell me a story"}], "max_tokens": 12,
            "temperature": 0}, headers={"x-reef-scenario": name, "x-reef-session": session})
        assert code == 200 and body["choices"][0]["message"]["content"] == text
        assert record(d, headers["x-reef-agent-record-id"])["engine_weights"] == w
    # an adapter release on those weights reaches both replicas under load, failing nothing
    lora = make_lora(weights, tmp_path / "lora", seed=3, scale=2.0)
    answer, load = publish_under_load(d, name, "--adapter", str(lora), clients=4, answers=8)
    on_w = answer["release"]["id"]
    assert load.failures == []
    assert {r["release"] for r in load.results} == {w, on_w}
    check_weights_of_answers(d, load.results, {w: w, on_w: w})
    assert all(r["adapters"] == [on_w] for r in engine(d, name)["replicas"])


def test_a_replica_that_ignores_a_weights_swap_never_serves_the_release(
        weightsd: Daemon, own_scenario: Callable[..., str], tmp_path: Path) -> None:
    """Two processes behind the router, one of them a worker that answers "success" to a weights update and keeps
    its old weights (`--fault ignore-weights`, attached by `workers:`). The release's proof catches it during the
    roll: it never takes traffic on the new weights, and every answer under a release comes from that release's
    weights: no answer of a mixed fleet, none failed."""
    from tests.worker.support import Worker

    d = weightsd
    faulty = Worker(d.state / "models" / "tiny", tmp_path / "faulty.log",
                    extra=["--fault", "ignore-weights", "--threads", "1"]).start()
    try:
        name = own_scenario(d, scenario(1).replace("  replicas: 1\n",
                                                   f"  replicas: 1\n  workers: [{faulty.url}]\n"), prefix="w",
                            proof=True)
        all_in_router(d, name, 2)
        base_text, base = greedy(d, name)
        weights = make_weights(d.state / "models" / "tiny", tmp_path / "weights", seed=1, scale=0.5)
        answer, load = publish_under_load(d, name, "--weights", str(weights), clients=3, answers=6)
        w = answer["release"]["id"]
        assert load.failures == []
        by_release: dict[str, set[str]] = {}
        for session in "abcdefgh":  # sessions spread over both processes when both serve
            code, body, headers = d.post("/v1/chat/completions", {
                "model": name, "messages": [{"role": "user", "content": "tell me a story"}], "max_tokens": 12,
                "temperature": 0}, headers={"x-reef-scenario": name, "x-reef-session": session})
            assert code == 200, body
            by_release.setdefault(headers["x-reef-release-id"], set()).add(body["choices"][0]["message"]["content"])
        assert all(len(texts) == 1 for texts in by_release.values()), by_release  # never two weights under one
        replicas = engine(d, name)["replicas"]
        attached = next(r for r in replicas if r["url"] == faulty.url)
        if answer["serving"] == w:  # the good replica rolled first: the faulty one is out of the router
            assert by_release.keys() == {w} and by_release[w] != {base_text}
            assert not attached["in_router"], replicas
        else:  # the faulty one came first: the roll was undone and the old weights serve everywhere
            assert answer["serving"] == base and by_release == {base: {base_text}}
        assert f"{faulty.url} does not answer as its weights" in d.log_path.read_text()  # why, in the log
    finally:
        faulty.stop()


# ------------------------------------------------------------ full weights on a canary trial across replicas

def canary_scenario(replicas: int) -> str:
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
    name = own_scenario(d, canary_scenario(2), prefix="wc")
    all_in_router(d, name)
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


def until_staged(d: Daemon, name: str, release: str, timeout_s: float = 600) -> list[dict[str, Any]]:
    """staged(d, name, release), once it holds (a replica restarting comes back on trial in its own time)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return staged(d, name, release)
        except AssertionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def until_all_on(d: Daemon, name: str, weights: str | None) -> None:
    deadline = time.monotonic() + 600  # a state to wait for, however busy the machine
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


def test_full_weights_on_canary_across_replicas_are_promoted(weightsd: Daemon, own_scenario: Callable[..., str],
                                                             tmp_path: Path) -> None:
    """The client prefers any answer other than the base model's: the new weights win. A reefd restart in the
    middle stages them again before /readyz says ready."""
    d = weightsd
    name, base, answers, weights = started(d, own_scenario, tmp_path, seed=1)
    with Load(d, name, clients=1) as staging:
        published = publish_weights(d, name, weights)
        trial = published["release"]["id"]
        assert published["serving"] == base and published["trial"]["release"] == trial
        staged(d, name, trial)
        staging.wait(2)
    assert staging.failures == []
    check_weights_of_answers(d, staging.results, {base: None, trial: trial})
    assert d.stop() == 0
    d.start(wait_ready=False)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            if d.get("/readyz")[0] == 200:
                break
        time.sleep(0.1)
    staged(d, name, trial)  # ready: the trial is staged again, not served to everyone
    with Load(d, name, clients=1) as load:
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


def test_full_weights_on_canary_across_replicas_are_rolled_back(weightsd: Daemon, own_scenario: Callable[..., str],
                                                                tmp_path: Path) -> None:
    """The client wants the base model's answers: the new weights lose, and their replica goes back to the base
    weights and into the router, with no request failed; one that restarts meanwhile comes back on trial."""
    d = weightsd
    name, base, answers, weights = started(d, own_scenario, tmp_path, seed=1)
    with Load(d, name, clients=1) as load:
        trial = publish_weights(d, name, weights)["release"]["id"]
        pid = next(r["pid"] for r in until_staged(d, name, trial) if r["state"] == "trial")
        os.kill(pid, signal.SIGKILL)  # the staged replica dies: its restart stages it again, out of the router
        deadline = time.monotonic() + 600
        while not any(r["state"] == "trial" and r["pid"] != pid for r in staged(d, name, None)):
            assert time.monotonic() < deadline, f"the killed replica never came back on trial: {staged(d, name, None)}"
            time.sleep(0.2)
        until_staged(d, name, trial)
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


def test_one_replica_refuses_full_weights_for_a_canary(weightsd: Daemon, own_scenario: Callable[..., str],
                                                       tmp_path: Path) -> None:
    d = weightsd
    name = own_scenario(d, canary_scenario(1), prefix="wc")
    weights = make_weights(d.state / "models" / "tiny", tmp_path / "weights", seed=3, scale=0.5)
    before = head(d, name)["id"]
    out = reefctl(d, "publish", name, "--weights", str(weights))
    assert out.returncode != 0
    assert "puts new releases on a canary trial" in out.stderr and "model.replicas: 2 or more" in out.stderr, \
        out.stderr
    assert "trial_needs_replicas" in out.stderr or "409" in out.stderr, out.stderr
    assert head(d, name)["id"] == before
