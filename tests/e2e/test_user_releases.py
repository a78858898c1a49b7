"""Users' own releases, served by the real daemon on the tiny model: a user's adapter answers that user alone,
`x-reef-release-id` names it, adapters are paged in and out of one resident slot with no request failing, and a
user's line is rolled back alone.

Adapters are real PEFT LoRA folders for the daemon's tiny model; each changes what the model says, so a greedy
answer tells which release produced it.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.conftest import Daemon, sdk, shared_daemon
from tests.e2e.test_grow import jobs, learn_yaml, wait_job
from tests.e2e.test_hot_swap import ctl
from tests.e2e.test_reefctl import reefctl
from tests.loras import make_lora, make_weights

pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")
PROMPT = [{"role": "user", "content": "Whose release are you?"}]
ASSIST = "defaults:\n  - model: tiny\n  - _self_\nserve:\n  default_max_tokens: 8\nusers:\n  slots: 1\n"
# sao, a count trigger at 4 scored records; an engine of its own (assist's takes full weights). The floor gate's
# shared task passes any answer (an empty pattern matches every text); carol's own task passes none.
LEARNERS = learn_yaml(gate="floor", extra="model:\n  max_batch: 4\n") + (
    "gate:\n  scorer: regex\n  min_tasks: 1\n  max_tokens: 4\n  floor: 0.5\n  tasks: gate/learners.jsonl\n"
    "users:\n  tasks: gate/learners-{user}.jsonl\n  share: true\n  share_min_users: 2\n")
GATE_FILES = {"gate/learners.jsonl": json.dumps({"prompt": "Anything?", "answer": ""}) + "\n",
              "gate/learners-carol.jsonl": json.dumps({"prompt": "Anything?", "answer": "(?!)"}) + "\n"}


@pytest.fixture(scope="module")
def d(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    yield from shared_daemon(tmp_path_factory.mktemp("user-releases"), names=(),
                             extra={"assist": ASSIST, "learners": LEARNERS}, files=GATE_FILES)


@pytest.fixture(scope="module")
def loras(d: Daemon, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("user-loras")
    model = d.state / "models" / "tiny"
    return {name: make_lora(model, root / name, seed=seed, scale=2.0) for name, seed in (("alice", 11), ("bob", 12))}


def ask(d: Daemon, user: str | None, scenario: str = "assist") -> tuple[str, str]:
    """(text, x-reef-release-id) of one greedy answer for `user` (None: nobody's)."""
    headers = {"x-reef-scenario": scenario, **({"x-reef-user": user} if user else {})}
    c = sdk(openai.OpenAI(base_url=d.url + "/v1", api_key=d.token, max_retries=0, default_headers=headers))
    raw = c.chat.completions.with_raw_response.create(model=scenario, messages=PROMPT, max_tokens=8,
                                                      temperature=0)
    return raw.parse().choices[0].message.content or "", raw.headers["x-reef-release-id"]


def resident(d: Daemon) -> list[str]:
    status = json.loads(d.get("/reef/status")[1])
    return list(next(s for s in status["scenarios"] if s["name"] == "assist")["engine"]["adapters"])


def test_a_users_release_answers_that_user_alone_paged_through_one_slot(d: Daemon, loras: dict[str, Path]) -> None:
    shared_text, shared = ask(d, None)
    assert shared.startswith("r0-")
    published = {}
    for user in ("alice", "bob"):
        out = ctl(d, "publish", "assist", "--adapter", str(loras[user]), "--user", user)
        assert out["release"]["user"] == user and out["release"]["parent"] == shared, out
        published[user] = out["release"]["id"]
    assert ctl(d, "history", "assist")["head"] == shared  # the shared line did not move
    alone = {user: ask(d, user) for user in ("alice", "bob")}
    assert {user: rel for user, (_, rel) in alone.items()} == published
    assert len({shared_text, alone["alice"][0], alone["bob"][0]}) == 3, alone  # three different models answered
    assert ask(d, "carol") == (shared_text, shared) and ask(d, None) == (shared_text, shared)
    # one slot, two users' adapters: each turn pages its user's in, the other's out; every answer is its own
    for user in ("alice", "bob", "alice", "bob"):
        assert ask(d, user) == alone[user]
        assert resident(d) == [published[user]], resident(d)
    with ThreadPoolExecutor(8) as pool:  # at once: turns wait for the slot, none fails
        answers = list(pool.map(lambda u: (u, ask(d, u)), ["alice", "bob", None, "carol"] * 4))
    for user, answer in answers:
        assert answer == alone.get(str(user), (shared_text, shared)), (user, answer)


def test_a_users_line_has_its_history_and_is_rolled_back_alone(d: Daemon, loras: dict[str, Path]) -> None:
    listed = ctl(d, "users", "assist")
    users = {u["user"]: u for u in listed["data"]}
    mine = users["alice"]["own_release"]
    assert users["alice"]["release"] == mine and users["alice"]["records"] >= 1, users
    assert users["carol"]["own_release"] is None and users["carol"]["release"] == listed["shared_release"]
    page = ctl(d, "history", "assist", "--user", "alice")
    assert [r["id"] for r in page["data"]][:1] == [mine] and page["own_line"] is True
    assert page["data"][1]["id"].startswith("r0-") and "user" not in page["data"][1]  # forked from the shared line
    assert ctl(d, "history", "assist", "--user", "carol")["own_line"] is False
    bob_before = ask(d, "bob")
    out = ctl(d, "rollback", "assist", "--user", "alice")
    assert out["release"]["user"] == "alice" and out["to"] == page["data"][1]["id"] and out["serving"] == \
        out["release"]["id"], out
    shared_text, _ = ask(d, None)
    assert ask(d, "alice") == (shared_text, out["release"]["id"])  # the shared tree, as alice's own release
    assert ask(d, "bob") == bob_before  # bob's line never moved
    bad = reefctl(d, "rollback", "assist", "--user", "a/b")
    assert bad.returncode != 0 and "holds '/'" in bad.stderr, bad.stderr


def test_new_shared_weights_put_a_users_adapter_aside_until_the_weights_it_was_made_on_serve_again(
        d: Daemon, tmp_path: Path) -> None:
    """An adapter serves only on the weights it was made on: full weights on the shared line send bob (whose own
    release forked from the old weights) to the shared release, saying why; rolling the shared line back brings
    his own release back. Nothing of his is deleted."""
    own_text, own = ask(d, "bob")
    weights = make_weights(d.state / "models" / "tiny", tmp_path / "w", seed=5, scale=0.5)
    out = ctl(d, "publish", "assist", "--weights", str(weights))
    shared_text, shared = ask(d, None)
    assert shared == out["release"]["id"]
    assert ask(d, "bob") == (shared_text, shared)
    bob = next(u for u in ctl(d, "users", "assist")["data"] if u["user"] == "bob")
    assert bob["own_release"] == own and bob["release"] == shared and "other weights" in bob["why"], bob
    ctl(d, "rollback", "assist")
    assert ask(d, "bob") == (own_text, own)


def test_a_users_count_trigger_trains_their_line_on_their_records_alone(d: Daemon) -> None:
    """Four scored turns of alice's make a job of her line's; bob's two make none; the job trains on alice's
    records only, and its release answers alice alone while the shared line stays where it was."""
    shared = ctl(d, "history", "learners")["head"]

    bobs = [_scored(d, "bob", f"bob's question {i}") for i in range(2)]
    alices = [_scored(d, "alice", f"alice's question {i}") for i in range(4)]
    job = wait_job(d, name="learners")
    assert job["state"] == "published" and job["user"] == "alice", job
    assert sorted(job["receipts"]) == sorted(alices) and not set(job["receipts"]) & set(bobs)
    assert [j["user"] for j in jobs(d, "learners")] == ["alice"]  # bob's two records start no job
    mine = ctl(d, "history", "learners", "--user", "alice")
    assert mine["own_line"] and mine["data"][0]["id"] == job["release"] and mine["data"][0]["user"] == "alice"
    assert mine["data"][0]["parent"] == shared and ctl(d, "history", "learners")["head"] == shared
    assert ask(d, "alice", "learners")[1] == job["release"] and ask(d, "bob", "learners")[1] == shared
    users = {u["user"]: u for u in ctl(d, "users", "learners")["data"]}
    assert (users["alice"]["records"], users["alice"]["reports"], users["bob"]["records"]) == (5, 4, 3), users  # + ask
    assert users["alice"]["last_job"] == {"id": job["id"], "state": "published", "release": job["release"]}
    assert users["bob"]["last_job"] is None


def test_a_users_own_gate_tasks_judge_their_candidates_and_a_loser_stays_where_it_was(d: Daemon) -> None:
    """users.tasks: carol's candidates are gated on her own file (which no answer passes), so her job is
    rejected and she stays on the shared release; erin, who has no file, is gated on the scenario's tasks."""
    shared = ctl(d, "history", "learners")["head"]
    for user, want in (("carol", "rejected"), ("erin", "published")):
        for i in range(4):
            _scored(d, user, f"{user}'s question {i}", score=float(i % 2))
        job = _last_job(d, user)
        assert (job["user"], job["state"]) == (user, want), job
        assert job["verdict"]["per_task"] and job["verdict"]["floor"] == 0.5, job["verdict"]
    assert ask(d, "carol", "learners")[1] == shared
    assert ask(d, "erin", "learners")[1] == _last_job(d, "erin")["release"] != shared
    refused = ctl(d, "history", "learners", "--user", "carol", "--all")["data"][0]
    assert refused["user"] == "carol" and refused["meta"]["gate"]["verdict"] == "fail", refused


def test_what_consenting_users_releases_learned_is_promoted_into_the_shared_line_naming_them(d: Daemon) -> None:
    """users.share: a promotion trains the shared line on the records that consenting users' own releases
    learned from (alice's and erin's; bob consents but has no release; carol does not consent), through the
    gate; its release names them, in lineage and in `reefctl explain`, and serves everyone without a line."""
    def promote() -> dict[str, Any]:
        job = ctl(d, "train", "learners", "--promote")
        deadline = time.monotonic() + 180
        while job["state"] in ("queued", "running"):
            assert time.monotonic() < deadline, d.logs()
            time.sleep(0.2)
            job = json.loads(d.get(f"/reef/jobs/{job['id']}")[1])
        return dict(job)

    ctl(d, "users", "share", "learners", "alice")
    alone = promote()
    assert alone["state"] == "skipped" and "fewer than users.share_min_users (2)" in alone["error"], alone
    for user in ("erin", "bob"):
        ctl(d, "users", "share", "learners", user)
    taught = {u: {r for rel in ctl(d, "history", "learners", "--user", u)["data"] if rel.get("user") == u
                  for r in rel["meta"].get("receipts") or []} for u in ("alice", "erin", "carol")}
    job = promote()
    assert job["state"] == "published" and job["user"] is None and job["users"] == ["alice", "erin"], job
    # a batch of 4 (sao's batch_size) taken by turns: two of alice's, two of erin's
    assert len(set(job["receipts"]) & taught["alice"]) == len(set(job["receipts"]) & taught["erin"]) == 2, job
    assert not set(job["receipts"]) & taught["carol"]
    head = ctl(d, "history", "learners")
    assert head["head"] == job["release"] and head["data"][0].get("user") is None
    lineage = ctl(d, "explain", job["release"])["releases"][0]
    assert lineage["users"] == ["alice", "erin"]
    assert {e["user"] for e in lineage["learned_from"]} == {"alice", "erin"}
    shown = reefctl(d, "explain", job["release"])
    assert shown.returncode == 0 and "Users:   alice, erin" in shown.stdout, shown.stdout
    assert ask(d, None, "learners")[1] == job["release"] and ask(d, "bob", "learners")[1] == job["release"]
    assert ask(d, "alice", "learners")[1] == ctl(d, "history", "learners", "--user", "alice")["head"]


def test_deleting_a_user_leaves_no_byte_of_theirs_and_the_others_serving(d: Daemon) -> None:
    """dora's records, reports, trained release, its adapter's LFS objects, her job and her sessions are gone
    from the LMDB file, the git object store (after its garbage collection) and the state folder; her receipts
    answer 404; alice's release still serves alice."""
    user = "dora-deleted"
    receipts = [_scored(d, user, f"dora's secret {i}", score=i % 2) for i in range(4)]  # mixed: a real update
    job = wait_job(d, name="learners", seen=tuple(j["id"] for j in jobs(d, "learners") if j["user"] != user))
    assert job["state"] == "published" and job["user"] == user, job
    lfs = [f["sha256"] for f in json.loads(d.get(f"/reef/releases/{job['release']}")[1])["files"] if f["lfs"]]
    assert lfs and all((d.state / "releases.git" / "lfs" / "objects" / o[:2] / o[2:4] / o).is_file() for o in lfs)
    alice = ask(d, "alice", "learners")
    gone = ctl(d, "users", "delete", "learners", user)
    assert (gone["records"], gone["releases"], gone["jobs"]) == (4, [job["release"]], 1), gone
    assert gone["lfs_objects"] >= 1 and gone["shared_releases_learned_from"] == []
    for receipt in receipts:
        assert d.get(f"/reef/records/{receipt}")[0] == 404
    assert d.get(f"/reef/releases/{job['release']}")[0] == 404 and d.get(f"/reef/jobs/{job['id']}")[0] == 404
    assert user not in {u["user"] for u in ctl(d, "users", "learners")["data"]}
    again = reefctl(d, "users", "delete", "learners", user)
    assert again.returncode != 0 and "no user 'dora-deleted'" in again.stderr, again.stderr
    assert ask(d, "alice", "learners") == alice  # the others' lines serve on
    secrets = [user.encode(), *(r.encode() for r in receipts), job["release"].encode(), b"dora's secret"]
    for path in d.state.rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            assert not [s for s in secrets if s in data], path  # LMDB, job files, users, serving, proofs
    objects = subprocess.run(["git", "--git-dir", str(d.state / "releases.git"), "cat-file", "--batch-all-objects",
                              "--batch", "--unordered"], capture_output=True, check=True).stdout
    assert objects and not [s for s in secrets if s in objects]  # every object git still holds, unpacked
    kept = [oid for oid in lfs if (d.state / "releases.git" / "lfs" / "objects" / oid[:2] / oid[2:4] / oid).exists()]
    assert len(kept) < len(lfs)  # her adapter's own bytes went
    assert all(f"oid sha256:{oid}".encode() in objects for oid in kept)  # what stays, another release points to


def _last_job(d: Daemon, user: str) -> dict[str, Any]:
    """`user`'s newest job in `learners`, once it is over."""
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        found = [j for j in jobs(d, "learners") if j["user"] == user]
        if found and found[0]["state"] in ("published", "rejected", "failed", "skipped"):
            return found[0]
        time.sleep(0.2)
    raise AssertionError(f"no job of {user}'s ended: {jobs(d, 'learners')}\n{d.logs()}")


def _scored(d: Daemon, user: str, text: str, score: float = 1.0) -> str:
    """One turn of `user` in `learners`, reported with `score`; its receipt. (Equal scores give sao no advantage
    to learn from: its adapter is then the same bytes for everyone.)"""
    c = sdk(openai.OpenAI(base_url=d.url + "/v1", api_key=d.token, max_retries=0,
                          default_headers={"x-reef-scenario": "learners", "x-reef-user": user}))
    raw = c.chat.completions.with_raw_response.create(model="learners", messages=[
        {"role": "user", "content": text}], max_tokens=8, temperature=1.0)
    receipt = raw.headers["x-reef-agent-record-id"]
    code, body, _ = d.post("/reef/report", {"score": score, "references": [receipt]},
                           headers={"x-reef-scenario": "learners"})
    assert code == 200, body
    return receipt
