"""Users' release lines in the chain: each forks from the shared line and has every guarantee it has (append-only,
a CAS head, rollback, promote, refused candidates), against a real bare repo and the real git and git-lfs CLIs.
A line's expected head is what its next release is made on: for a user with no release yet, the shared head."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from reefd.commit.chain import HeadConflict, InvalidName, NoRelease, ReleaseChain, UnknownRelease, WrongScenario
from tests.test_releases import adapter_dir, git_env


@pytest.fixture
def chain(tmp_path: Path) -> ReleaseChain:
    return ReleaseChain(tmp_path / "releases.git")


def test_a_users_line_forks_from_the_shared_head_and_moves_alone(chain: ReleaseChain, tmp_path: Path) -> None:
    with pytest.raises(NoRelease):  # a user's line forks from the shared line: there must be one
        chain.publish("assist", expected_head=None, kind="adapter", artifact_dir=adapter_dir(tmp_path, "a0"),
                      meta={}, user="alice")
    base = chain.publish("assist", expected_head=None, kind="base", artifact_dir=None, meta={"source": "tiny"})
    mine = chain.publish("assist", expected_head=base.id, kind="adapter", artifact_dir=adapter_dir(tmp_path, "a1"),
                         meta={"source": "sao"}, user="alice")
    assert (mine.user, mine.parent, mine.seq) == ("alice", base.id, 1)
    assert chain.head("assist") == base and chain.head("assist", "alice") == mine and chain.head("assist", "bob") \
        is None
    assert chain.get(mine.id) == mine and chain.users("assist") == ["alice"]
    assert [r.id for r in chain.history("assist", user="alice")] == [mine.id, base.id]
    assert [r.id for r in chain.history("assist")] == [base.id] and chain.history("assist", user="bob") == []
    shared = chain.publish("assist", expected_head=base.id, kind="adapter", artifact_dir=adapter_dir(tmp_path, "s1"),
                           meta={})
    assert chain.head("assist", "alice") == mine  # the shared line moved; alice's did not
    with pytest.raises(HeadConflict, match=rf"scenario 'assist' \(user 'alice'\): expected head {base.id}, found "
                                           rf"{mine.id}"):
        chain.publish("assist", expected_head=base.id, kind="adapter", artifact_dir=adapter_dir(tmp_path, "a2"),
                      meta={}, user="alice")  # a stale head (CAS)
    second = chain.publish("assist", expected_head=mine.id, kind="adapter", artifact_dir=adapter_dir(tmp_path, "a3"),
                           meta={}, user="alice")
    assert second.parent == mine.id and chain.head("assist", "alice") == second
    with pytest.raises(ValueError, match="on a user's line: adapter, harness or bundle"):
        chain.publish("assist", expected_head=second.id, kind="weights", artifact_dir=adapter_dir(tmp_path, "w"),
                      meta={}, user="alice")
    assert chain.line_head("assist", "bob") == shared  # bob has no line yet: his next release forks from here
    bob = chain.publish("assist", expected_head=shared.id, kind="adapter", artifact_dir=adapter_dir(tmp_path, "b1"),
                        meta={}, user="bob")
    assert bob.parent == shared.id and chain.users("assist") == ["alice", "bob"]  # forked from the head then


def test_rollback_promote_and_rejected_candidates_stay_on_their_line(chain: ReleaseChain, tmp_path: Path) -> None:
    base = chain.publish("assist", expected_head=None, kind="base", artifact_dir=None, meta={})
    one = chain.publish("assist", expected_head=base.id, kind="adapter", artifact_dir=adapter_dir(tmp_path, "a1"),
                        meta={}, user="alice")
    two = chain.publish("assist", expected_head=one.id, kind="adapter", artifact_dir=adapter_dir(tmp_path, "a2"),
                        meta={}, user="alice")
    back = chain.rollback("assist", expected_head=two.id, user="alice")
    assert back.user == "alice" and back.meta["target"] == one.id and chain.artifacts(back.id) == \
        chain.artifacts(one.id)
    to_base = chain.rollback("assist", to=base.id, expected_head=back.id, user="alice")  # back to the shared tree
    assert chain.artifacts(to_base.id) == chain.artifacts(base.id) and chain.head("assist") == base
    refused = chain.reject("assist", built_on=to_base.id, kind="adapter", artifact_dir=adapter_dir(tmp_path, "r"),
                           meta={"gate": {"verdict": "fail"}}, user="alice")
    assert [r.id for r in chain.rejected("assist", "alice")] == [refused.id] and chain.rejected("assist") == []
    again = chain.promote("assist", refused.id, expected_head=to_base.id, user="alice")
    assert again.user == "alice" and chain.artifacts(again.id) == chain.artifacts(refused.id)
    with pytest.raises(WrongScenario, match=r"release of scenario 'assist' \(user 'alice'\), not of scenario "
                                            r"'assist'$"):
        chain.promote("assist", two.id, expected_head=base.id)  # the shared line never carries a user's release
    with pytest.raises(WrongScenario, match=r"\(user 'alice'\), not of scenario 'assist' \(user 'bob'\)"):
        chain.promote("assist", two.id, expected_head=base.id, user="bob")
    empty = ReleaseChain(tmp_path / "empty.git")
    with pytest.raises(UnknownRelease, match=r"scenario 'assist' \(user 'bob'\) has no releases"):
        empty.rollback("assist", expected_head=None, user="bob")


@pytest.mark.parametrize("user", ["../x", "a/b", "x.lock", ""])
def test_a_name_that_cannot_be_a_ref_component_is_refused(chain: ReleaseChain, user: str) -> None:
    chain.publish("assist", expected_head=None, kind="base", artifact_dir=None, meta={})
    with pytest.raises(InvalidName):
        chain.head("assist", user)


def test_a_users_line_is_plain_git_and_lfs(chain: ReleaseChain, tmp_path: Path) -> None:
    """`git` sees the user's head under refs/reef/scenarios/<s>/users/<u>/head, and `git lfs fsck` passes."""
    chain.publish("assist", expected_head=None, kind="base", artifact_dir=None, meta={})
    base = chain.head("assist")
    assert base is not None
    mine = chain.publish("assist", expected_head=base.id, kind="adapter", artifact_dir=adapter_dir(tmp_path, "a1"),
                         meta={}, user="alice@example.com")
    env = git_env(tmp_path)
    refs = subprocess.run(["git", "--git-dir", str(chain.path), "for-each-ref", "--format=%(refname) %(objectname)"],
                          env=env, check=True, capture_output=True, text=True).stdout
    assert f"refs/reef/scenarios/assist/users/alice@example.com/head {mine.commit}" in refs
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(chain.path), str(clone)], env=env, check=True, capture_output=True)
    subprocess.run(["git", "-C", str(clone), "fetch", "-q", "origin",
                    "refs/reef/scenarios/assist/users/alice@example.com/head:alice"], env=env, check=True)
    subprocess.run(["git", "-C", str(clone), "checkout", "-q", "alice"], env=env, check=True, capture_output=True)
    fsck = subprocess.run(["git", "-C", str(clone), "lfs", "fsck", "--pointers"], env=env, capture_output=True,
                          text=True)
    assert fsck.returncode == 0, fsck.stderr
    assert (clone / "adapter" / "adapter_config.json").is_file()
