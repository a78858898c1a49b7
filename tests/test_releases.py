"""Release chain against real temporary bare repos, the real git and git-lfs CLIs, and real OS processes."""

from __future__ import annotations

import itertools
import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pygit2
import pytest

from reefd.commit.chain import (
    HeadConflict,
    InvalidName,
    Release,
    ReleaseChain,
    ReleaseError,
    UnknownRelease,
    WrongScenario,
    clear_stale_locks,
    head_ref,
)

ROOT = Path(__file__).resolve().parents[1]


def git_env(tmp_path: Path) -> dict[str, str]:
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    return {**os.environ, "HOME": str(home), "GIT_CONFIG_NOSYSTEM": "1", "GIT_TERMINAL_PROMPT": "0"}


def git(tmp_path: Path, *args: str, cwd: Path | None = None, extra: dict[str, str] | None = None) -> str:
    env = {**git_env(tmp_path), **(extra or {})}
    return subprocess.run(["git", *args], cwd=cwd, env=env, check=True, capture_output=True, text=True).stdout


def adapter_dir(tmp_path: Path, name: str = "art", size: int = 4096) -> Path:
    d = tmp_path / name
    d.mkdir()
    (d / "adapter_model.safetensors").write_bytes(os.urandom(size))
    (d / "adapter_config.json").write_text('{"r": 8, "lora_alpha": 16}\n')
    return d


@pytest.fixture
def chain(tmp_path: Path) -> ReleaseChain:
    return ReleaseChain(tmp_path / "releases.git")


def base_and_adapter(chain: ReleaseChain, art: Path) -> tuple[Release, Release]:
    base = chain.publish("support", expected_head=None, kind="base", artifact_dir=None, meta={"source": "SmolLM2"})
    meta = {"source": "sao", "metrics": {"reward": 0.7}, "gate": {"verdict": "pass"}, "receipts": ["01J"]}
    return base, chain.publish("support", expected_head=base.id, kind="adapter", artifact_dir=art, meta=meta)


def test_publish_ids_history_and_release_json(chain: ReleaseChain, tmp_path: Path) -> None:
    base, ad = base_and_adapter(chain, adapter_dir(tmp_path))
    assert base.id.startswith("r0-") and ad.id.startswith("r1-") and ad.id == f"r1-{ad.commit[:7]}"
    assert (ad.parent, ad.kind, ad.scenario) == (base.id, "adapter", "support")
    assert [r.id for r in chain.history("support")] == [ad.id, base.id]
    assert chain.head("support") == ad == chain.get(ad.id)
    assert chain.head("other") is None and chain.history("other") == []
    reopened = ReleaseChain(tmp_path / "releases.git")
    assert reopened.get(base.id) == base
    commit = chain.repo[ad.commit].peel(pygit2.Commit)
    doc = json.loads(chain.repo[commit.tree["release.json"].id].peel(pygit2.Blob).data)
    assert doc["parent"] == base.id and doc["seq"] == 1 and doc["kind"] == "adapter"
    assert doc["meta"]["gate"] == {"verdict": "pass"} and doc["meta"]["receipts"] == ["01J"]
    assert sorted(str(e.name) for e in commit.tree) == [".gitattributes", "adapter", "release.json"]
    attrs = chain.repo[commit.tree[".gitattributes"].id].peel(pygit2.Blob).data.decode()
    assert "*.safetensors filter=lfs diff=lfs merge=lfs -text" in attrs


def test_lfs_pointers_objects_and_materialize(chain: ReleaseChain, tmp_path: Path) -> None:
    art = adapter_dir(tmp_path)
    payload = (art / "adapter_model.safetensors").read_bytes()
    _, ad = base_and_adapter(chain, art)
    tree = chain.repo[ad.commit].peel(pygit2.Commit).tree
    blob = chain.repo[tree["adapter/adapter_model.safetensors"].id].peel(pygit2.Blob).data.decode()
    oid = __import__("hashlib").sha256(payload).hexdigest()
    assert blob == f"version https://git-lfs.github.com/spec/v1\noid sha256:{oid}\nsize {len(payload)}\n"
    obj = tmp_path / "releases.git" / "lfs" / "objects" / oid[:2] / oid[2:4] / oid
    assert obj.read_bytes() == payload
    assert chain.lfs_pointers(ad.id) == {"adapter/adapter_model.safetensors": (oid, len(payload))}
    out = chain.materialize(ad.id, tmp_path / "mat")
    assert (out / "adapter" / "adapter_model.safetensors").read_bytes() == payload
    assert (out / "adapter" / "adapter_config.json").read_text() == (art / "adapter_config.json").read_text()
    git(tmp_path, f"--git-dir={tmp_path / 'releases.git'}", "fsck", "--strict")


def test_git_clone_and_lfs_pull_restore_release(chain: ReleaseChain, tmp_path: Path) -> None:
    art = adapter_dir(tmp_path, size=300_000)
    payload = (art / "adapter_model.safetensors").read_bytes()
    _, ad = base_and_adapter(chain, art)
    url = (tmp_path / "releases.git").as_uri()
    work = tmp_path / "work"
    git(tmp_path, "lfs", "install", "--skip-repo")
    git(tmp_path, "clone", "-q", url, str(work))
    git(tmp_path, "fetch", "-q", "origin", "refs/reef/*:refs/reef/*", cwd=work)
    assert git(tmp_path, "rev-parse", head_ref("support"), cwd=work).strip() == ad.commit
    git(tmp_path, "checkout", "-q", ad.commit, cwd=work, extra={"GIT_LFS_SKIP_SMUDGE": "1"})
    target = work / "adapter" / "adapter_model.safetensors"
    assert target.read_bytes().startswith(b"version https://git-lfs.github.com/spec/v1\n")  # only the pointer so far
    git(tmp_path, "lfs", "pull", cwd=work)  # file:// remote: git-lfs reads <bare repo>/lfs/objects directly
    assert target.read_bytes() == payload
    assert "Git LFS fsck OK" in git(tmp_path, "lfs", "fsck", cwd=work)
    assert git(tmp_path, "status", "--porcelain", cwd=work) == ""
    listed = git(tmp_path, "lfs", "ls-files", "--long", cwd=work)
    assert "adapter/adapter_model.safetensors" in listed


def test_stale_expected_head_is_refused(chain: ReleaseChain, tmp_path: Path) -> None:
    base, ad = base_and_adapter(chain, adapter_dir(tmp_path))
    with pytest.raises(HeadConflict) as e:
        chain.publish("support", expected_head=base.id, kind="harness", artifact_dir=None, meta={})
    assert (e.value.expected, e.value.actual) == (base.id, ad.id)
    with pytest.raises(HeadConflict):
        chain.publish("support", expected_head=None, kind="base", artifact_dir=None, meta={})
    with pytest.raises(HeadConflict):
        chain.publish("fresh", expected_head=ad.id, kind="base", artifact_dir=None, meta={})
    assert chain.head("support") == ad and chain.head("fresh") is None
    assert len(chain.history("support")) == 2


RACER = textwrap.dedent(
    """
    import json, sys, time
    from pathlib import Path
    from reefd.commit.chain import HeadConflict, ReleaseChain
    chain, tag, art = ReleaseChain(Path(sys.argv[1])), sys.argv[2], Path(sys.argv[3])
    ready, go = Path(sys.argv[4] + "." + tag), Path(sys.argv[4])
    ready.touch()
    while not go.exists():  # start line: both processes are warm before either publishes
        time.sleep(0.001)
    won, conflicts = [], 0
    for i in range(50):
        while True:
            head = chain.head("race")
            try:
                rel = chain.publish("race", expected_head=head.id, kind="adapter", artifact_dir=art,
                                    meta={"source": f"{tag}-{i}"})
            except HeadConflict:
                conflicts += 1
                continue
            won.append(rel.id)
            break
    print(json.dumps({"won": won, "conflicts": conflicts}))
    """
)


def test_two_processes_race_for_the_head(chain: ReleaseChain, tmp_path: Path) -> None:
    base = chain.publish("race", expected_head=None, kind="base", artifact_dir=None, meta={})
    procs = []
    for tag in ("a", "b"):
        art = tmp_path / f"art-{tag}"
        art.mkdir()
        (art / "adapter_model.safetensors").write_bytes(tag.encode() * 16)
        cmd = [sys.executable, "-c", RACER, str(tmp_path / "releases.git"), tag, str(art), str(tmp_path / "go")]
        procs.append(subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    while not all((tmp_path / f"go.{tag}").exists() for tag in "ab"):
        assert all(p.poll() is None for p in procs)
        time.sleep(0.01)
    (tmp_path / "go").touch()
    results = []
    for p in procs:
        out, err = p.communicate(timeout=240)
        assert p.returncode == 0, err
        results.append(json.loads(out))
    won = results[0]["won"] + results[1]["won"]
    print("race conflicts (retried):", [r["conflicts"] for r in results])
    history = chain.history("race")
    assert len(history) == 101 and len(won) == 100 and len(set(won)) == 100
    assert {r.id for r in history[:-1]} == set(won) and history[-1] == base
    assert [r.seq for r in history] == list(range(100, -1, -1))
    for newer, older in itertools.pairwise(history):
        assert newer.parent == older.id
        assert [str(p) for p in chain.repo[newer.commit].peel(pygit2.Commit).parent_ids] == [older.commit]
    sources = sorted(r.meta["source"] for r in history[:-1])
    assert sources == sorted(f"{t}-{i}" for t in "ab" for i in range(50))
    git(tmp_path, f"--git-dir={tmp_path / 'releases.git'}", "fsck")


CRASHER = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from reefd.commit.chain import ReleaseChain
    chain = ReleaseChain(Path(sys.argv[1]))
    head = chain.head(sys.argv[2])
    chain.publish(sys.argv[2], expected_head=head.id if head else None, kind="adapter",
                  artifact_dir=Path(sys.argv[3]), meta={"crash": True})
    """
)


def assert_heads_complete(chain: ReleaseChain, tmp_path: Path) -> None:
    for ref in chain.repo.references:
        if not ref.startswith("refs/reef/scenarios/"):
            continue
        for rel in chain.history(ref.split("/")[3]):
            for oid, size in chain.lfs_pointers(rel.id).values():
                assert chain.lfs_object(oid).stat().st_size == size
    git(tmp_path, f"--git-dir={tmp_path / 'releases.git'}", "fsck", "--strict")


@pytest.mark.parametrize("point", ["after_lfs", "after_commit", "before_ref"])
@pytest.mark.parametrize("first", [True, False])
def test_kill_at_each_step_leaves_a_complete_head(
    chain: ReleaseChain, tmp_path: Path, point: str, first: bool
) -> None:
    old = None if first else base_and_adapter(chain, adapter_dir(tmp_path, "old"))[1]
    art = adapter_dir(tmp_path, "new", size=200_000)
    env = {**os.environ, "REEF_RELEASE_FAULT": point}
    cmd = [sys.executable, "-c", CRASHER, str(tmp_path / "releases.git"), "support", str(art)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 137, proc.stderr
    reopened = ReleaseChain(tmp_path / "releases.git")
    assert reopened.head("support") == old  # every fault point is before the ref moves
    assert_heads_complete(reopened, tmp_path)
    again = reopened.publish("support", expected_head=old.id if old else None, kind="adapter", artifact_dir=art,
                             meta={"after_crash": True})
    assert reopened.head("support") == again
    assert_heads_complete(reopened, tmp_path)


def test_rollback_and_promote_append(chain: ReleaseChain, tmp_path: Path) -> None:
    base, ad = base_and_adapter(chain, adapter_dir(tmp_path))
    rb = chain.rollback("support", None, expected_head=ad.id)
    assert (rb.kind, rb.parent, rb.seq, rb.meta["target"]) == ("rollback", ad.id, 2, base.id)
    assert chain.diff(base.id, rb.id)["added"] == [] and chain.diff(ad.id, rb.id)["removed"] == [
        "adapter/adapter_config.json", "adapter/adapter_model.safetensors"]
    pr = chain.promote("support", ad.id, expected_head=rb.id)
    assert chain.diff(ad.id, pr.id)["added"] == chain.diff(ad.id, pr.id)["changed"] == []
    assert [r.kind for r in chain.history("support")] == ["promote", "rollback", "adapter", "base"]
    with pytest.raises(HeadConflict):
        chain.promote("support", ad.id, expected_head=rb.id)


def test_diff_reports_changed_lfs_file(chain: ReleaseChain, tmp_path: Path) -> None:
    _, a1 = base_and_adapter(chain, adapter_dir(tmp_path, "one"))
    a2 = chain.publish("support", expected_head=a1.id, kind="adapter", artifact_dir=adapter_dir(tmp_path, "two"),
                       meta={"source": "sao", "metrics": {"reward": 0.9}})
    d = chain.diff(a1.id, a2.id)
    assert d["changed"] == ["adapter/adapter_model.safetensors"] and d["added"] == d["removed"] == []
    assert d["meta"]["metrics"] == ({"reward": 0.7}, {"reward": 0.9})


@pytest.mark.parametrize("name", ["../x", "a/../../b", "a\0b", "", "..", ".hidden", "a/b", "x" * 65, "a.lock"])
def test_invalid_scenario_names(chain: ReleaseChain, name: str) -> None:
    with pytest.raises(InvalidName):
        chain.publish(name, expected_head=None, kind="base", artifact_dir=None, meta={})
    with pytest.raises(InvalidName):
        chain.head(name)
    assert list(chain.repo.references) == []


def test_unknown_and_foreign_releases(chain: ReleaseChain, tmp_path: Path) -> None:
    base, ad = base_and_adapter(chain, adapter_dir(tmp_path))
    other = chain.publish("other", expected_head=None, kind="base", artifact_dir=None, meta={})
    for bad in ["r9-0000000", "nope", f"r5-{ad.commit[:7]}", "", "r1-zzzzzzz"]:
        with pytest.raises(UnknownRelease):
            chain.get(bad)
    with pytest.raises(WrongScenario):
        chain.rollback("support", other.id, expected_head=ad.id)
    with pytest.raises(WrongScenario):
        chain.promote("other", base.id, expected_head=other.id)
    with pytest.raises(UnknownRelease):
        chain.rollback("other", None, expected_head=other.id)  # a base has nothing to roll back to
    refused = chain.repo.create_commit(None, chain.repo[ad.commit].peel(pygit2.Commit).author,
                                       chain.repo[ad.commit].peel(pygit2.Commit).author, "x",
                                       chain.repo[ad.commit].peel(pygit2.Commit).tree_id, [pygit2.Oid(hex=ad.commit)])
    with pytest.raises(UnknownRelease):  # an unreachable candidate commit is not a release
        chain.get(f"r1-{str(refused)[:7]}")
    assert chain.head("support") == ad and chain.head("other") == other


def test_a_stale_head_lock_blocks_publishing_until_cleared(tmp_path: Path) -> None:
    chain = ReleaseChain(tmp_path / "releases.git")
    base = chain.publish("s", expected_head=None, kind="base", artifact_dir=None, meta={})
    lock = tmp_path / "releases.git" / "refs" / "reef" / "scenarios" / "s" / "head.lock"
    lock.write_text("left by a killed writer")
    with pytest.raises(HeadConflict):
        chain.publish("s", expected_head=base.id, kind="adapter", artifact_dir=None, meta={})
    assert clear_stale_locks(chain.path) == [lock] and not lock.exists()
    nxt = chain.publish("s", expected_head=base.id, kind="adapter", artifact_dir=None, meta={})
    assert chain.head("s") == nxt


def test_rejected_candidates_are_kept_visible_but_never_released(chain: ReleaseChain, tmp_path: Path) -> None:
    base, good = base_and_adapter(chain, adapter_dir(tmp_path))
    bad = chain.reject("support", built_on=good.id, kind="adapter", artifact_dir=adapter_dir(tmp_path, "bad"),
                       meta={"source": "sao", "gate": {"verdict": "fail", "score": 0.1}})
    assert bad.status == "rejected" and bad.parent == good.id and bad.seq == 2
    assert chain.head("support") == good  # the head did not move
    assert [r.id for r in chain.history("support")] == [good.id, base.id]
    everything = chain.history("support", include_rejected=True)
    assert [(r.id, r.status) for r in everything] == [(bad.id, "rejected"), (good.id, "released"),
                                                      (base.id, "released")]
    with pytest.raises(UnknownRelease):
        chain.get(bad.id)  # not a release: rollback targets and pins never resolve to it
    assert chain.get(bad.id, include_rejected=True) == bad
    with pytest.raises(UnknownRelease):
        chain.rollback("support", bad.id, expected_head=good.id)
    promoted = chain.promote("support", bad.id, expected_head=good.id)  # an operator's override
    assert promoted.kind == "promote" and promoted.meta["target"] == bad.id
    assert chain.artifacts(promoted.id) == chain.artifacts(bad.id) != chain.artifacts(good.id)
    assert chain.artifacts(base.id) == {}
    folder = chain.materialize(promoted.id, tmp_path / "out", folder="adapter")
    assert sorted(p.name for p in folder.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    restored = (folder / "adapter_model.safetensors").read_bytes()
    assert restored == (tmp_path / "bad" / "adapter_model.safetensors").read_bytes()


def test_diff_shows_text_diffs_of_text_files_only(chain: ReleaseChain, tmp_path: Path) -> None:
    _, first = base_and_adapter(chain, adapter_dir(tmp_path))
    art = adapter_dir(tmp_path, "second")
    (art / "adapter_config.json").write_text('{"r": 16, "lora_alpha": 16}\n')
    (art / "notes.md").write_text("no newline at the end")
    second = chain.publish("support", expected_head=first.id, kind="adapter", artifact_dir=art, meta={})
    d = chain.diff(first.id, second.id)
    assert d["changed"] == ["adapter/adapter_config.json", "adapter/adapter_model.safetensors"]
    assert d["added"] == ["adapter/notes.md"]
    assert sorted(d["text"]) == ["adapter/adapter_config.json", "adapter/notes.md"]  # LFS files: hashes only
    assert d["text"]["adapter/adapter_config.json"] == (
        "--- a/adapter/adapter_config.json\n+++ b/adapter/adapter_config.json\n@@ -1 +1 @@\n"
        '-{"r": 8, "lora_alpha": 16}\n+{"r": 16, "lora_alpha": 16}\n')
    assert d["text"]["adapter/notes.md"] == ("--- /dev/null\n+++ b/adapter/notes.md\n@@ -0,0 +1 @@\n"
                                             "+no newline at the end\n\\ No newline at end of file\n")
    assert chain.diff(second.id, second.id)["text"] == {}


def test_a_harness_tree_id_is_computed_as_git_writes_it_and_a_harness_that_is_not_its_tree_is_refused(
        chain: ReleaseChain, tmp_path: Path) -> None:
    """What reefd injects must be the release's own tree: the tree id of the harness it parsed (rendered again) is
    computed without git, equal to the one the chain stores, and a release whose tree does not render back to
    itself is not served."""
    import asyncio

    from reefd.commit.materialize import Materializer
    from reefd.commit.trees import tree_id
    from reefd.harness import Harness

    harness = Harness.from_dir(Path(__file__).parent.parent / "scenarios" / "coder-harness")
    canonical = harness.render(tmp_path / "h")
    odd = {"a.md": b"x", "b/c.md": b"y", "b-x.md": b"z", "b/d/e.md": b"w"}  # git sorts a folder as "b/"
    for rel, data in odd.items():
        (tmp_path / "odd" / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "odd" / rel).write_bytes(data)
    base = chain.publish("s", expected_head=None, kind="base", artifact_dir=canonical, meta={}, folder="harness")
    assert chain.artifacts(base.id)["harness"] == tree_id(harness.files())
    assert chain.artifacts(chain.publish("o", expected_head=None, kind="base", artifact_dir=tmp_path / "odd",
                                         meta={}, folder="harness").id)["harness"] == tree_id(odd)
    files = Materializer(None, chain, tmp_path / "state", tmp_path)  # type: ignore[arg-type]
    assert asyncio.run(files.artifacts(base, None)).harness == harness
    (tmp_path / "edited" / "rules").mkdir(parents=True)
    shutil.copytree(canonical, tmp_path / "edited", dirs_exist_ok=True)
    rule = next((tmp_path / "edited" / "rules").glob("*.md"))
    rule.write_bytes(rule.read_bytes().rstrip(b"\n") + b"\n\n\n")  # parses, but renders otherwise
    edited = chain.publish("s", expected_head=base.id, kind="harness", artifact_dir=tmp_path / "edited", meta={})
    with pytest.raises(ReleaseError, match="renders as tree"):
        asyncio.run(files.artifacts(edited, None))
