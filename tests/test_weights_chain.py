"""Full-weights releases in the chain (a real bare repo, the real git and git-lfs CLIs): LFS storage with each
distinct file stored once, the adapter a weights release replaces, and adapters bound to the weights they were
trained on."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from reefd.commit import policy
from reefd.commit.chain import BaseMismatch, Candidate, ReleaseChain, trained_on
from tests.test_releases import adapter_dir, git


def weights_dir(tmp_path: Path, name: str, shards: dict[str, bytes]) -> Path:
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text('{"model_type": "llama", "architectures": ["LlamaForCausalLM"]}\n')
    (d / "tokenizer.json").write_text('{"version": "1.0"}\n')
    for file, data in shards.items():
        (d / file).write_bytes(data)
    return d


def lfs_objects(chain: ReleaseChain) -> set[str]:
    return {p.name for p in (chain.path / "lfs" / "objects").rglob("*") if p.is_file()}


@pytest.fixture
def chain(tmp_path: Path) -> ReleaseChain:
    return ReleaseChain(tmp_path / "releases.git")


def test_weights_are_lfs_objects_stored_once(chain: ReleaseChain, tmp_path: Path) -> None:
    one, two, three = os.urandom(200_000), os.urandom(200_000), os.urandom(200_000)
    base = chain.publish("w", expected_head=None, kind="base", artifact_dir=None, meta={})
    first = chain.publish("w", expected_head=base.id, kind="weights", meta={},
                          artifact_dir=weights_dir(tmp_path, "a", {"model-1.safetensors": one,
                                                                   "model-2.safetensors": two}))
    assert lfs_objects(chain) == {hashlib.sha256(one).hexdigest(), hashlib.sha256(two).hexdigest()}
    # a second release that changes one shard stores that shard only
    second = chain.publish("w", expected_head=first.id, kind="weights", meta={},
                           artifact_dir=weights_dir(tmp_path, "b", {"model-1.safetensors": one,
                                                                    "model-2.safetensors": three}))
    assert lfs_objects(chain) == {hashlib.sha256(x).hexdigest() for x in (one, two, three)}
    # rolling back to the first weights stores nothing new, and serves the same tree
    back = chain.rollback("w", first.id, expected_head=second.id)
    assert len(lfs_objects(chain)) == 3
    assert chain.artifacts(back.id)["weights"] == chain.artifacts(first.id)["weights"]
    assert chain.weights(back.id) == {"tree": chain.artifacts(first.id)["weights"], "release": back.id}
    assert chain.weights(base.id) == {"tree": None, "release": base.id}
    pointers = chain.lfs_pointers(second.id)
    assert set(pointers) == {"weights/model-1.safetensors", "weights/model-2.safetensors"}
    git(tmp_path, f"--git-dir={chain.path}", "fsck", "--strict")


def test_a_weights_release_drops_the_adapter_of_the_old_weights(chain: ReleaseChain, tmp_path: Path) -> None:
    base = chain.publish("w", expected_head=None, kind="base", artifact_dir=None, meta={})
    ad = chain.publish("w", expected_head=base.id, kind="adapter", artifact_dir=adapter_dir(tmp_path),
                       meta={"weights": chain.weights(base.id)})
    assert "adapter" in chain.artifacts(ad.id)
    w = chain.publish("w", expected_head=ad.id, kind="weights", meta={},
                      artifact_dir=weights_dir(tmp_path, "a", {"model.safetensors": os.urandom(1000)}))
    assert set(chain.artifacts(w.id)) == {"weights"}
    assert chain.weights(w.id) == {"tree": chain.artifacts(w.id)["weights"], "release": w.id}
    # an adapter trained on those weights names them, and carries them in its tree
    on_w = chain.publish("w", expected_head=w.id, kind="adapter", artifact_dir=adapter_dir(tmp_path, "art2"),
                         meta={"weights": chain.weights(w.id)})
    assert set(chain.artifacts(on_w.id)) == {"weights", "adapter"}
    assert chain.weights(on_w.id)["release"] == w.id
    assert trained_on(chain.get(on_w.id).meta) == {"tree": chain.artifacts(w.id)["weights"], "release": w.id}
    # through a copy too
    back = chain.rollback("w", on_w.id, expected_head=on_w.id)
    assert trained_on(back.meta) == trained_on(on_w.meta)


def test_an_adapter_made_on_other_weights_is_refused(chain: ReleaseChain, tmp_path: Path) -> None:
    base = chain.publish("w", expected_head=None, kind="base", artifact_dir=None, meta={})
    claim = chain.weights(base.id)  # a job starts on the base model's weights ...
    w = chain.publish("w", expected_head=base.id, kind="weights", meta={},
                      artifact_dir=weights_dir(tmp_path, "a", {"model.safetensors": os.urandom(1000)}))
    # ... and finishes after a weights release moved the head: rebasing it would serve it on the wrong model
    cand = Candidate("adapter", {"weights": claim}, artifact=adapter_dir(tmp_path), built_on=base.id,
                     verdict={"verdict": "pass"})
    with pytest.raises(BaseMismatch) as e:
        policy.commit(chain, "w", cand, pin=None, on_conflict="rebase")
    assert "trained on the base model's weights" in str(e.value) and w.id in str(e.value)
    assert chain.head("w") == w
    kept = policy.commit(chain, "w", cand, pin=None, on_conflict="rebase", keep_refused=True)
    assert kept.status == "rejected" and "trained on the base model's weights" in kept.meta["refused"]
    assert chain.head("w") == w
    # the same adapter made on the weights that serve is appended
    ok = policy.commit(chain, "w", Candidate("adapter", {"weights": chain.weights(w.id)},
                                               artifact=adapter_dir(tmp_path, "art2")), pin=None, on_conflict="rebase")
    assert chain.head("w") == ok and ok.parent == w.id


def test_a_refused_weights_candidate_is_kept_without_the_old_adapter(chain: ReleaseChain, tmp_path: Path) -> None:
    base = chain.publish("w", expected_head=None, kind="base", artifact_dir=None, meta={})
    ad = chain.publish("w", expected_head=base.id, kind="adapter", artifact_dir=adapter_dir(tmp_path),
                       meta={"weights": chain.weights(base.id)})
    cand = Candidate("weights", {}, artifact=weights_dir(tmp_path, "a", {"model.safetensors": os.urandom(100)}),
                     built_on=ad.id, verdict={"verdict": "fail"})
    kept = policy.commit(chain, "w", cand, pin=None, on_conflict="discard")
    assert kept.status == "rejected" and set(chain.artifacts(kept.id)) == {"weights"}
    assert chain.head("w") == ad
