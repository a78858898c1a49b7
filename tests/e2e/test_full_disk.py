"""A full disk, for real: reefd's state folder on a small tmpfs, filled to the last byte. A chat turn, a train and a
publish each answer 503 with `Retry-After` and say "no space left on device"; nothing half-written is left behind
and nothing is listed that is not on disk; once space is back, each works again."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import Daemon, make_scenarios
from tests.e2e.test_weights import tar_of
from tests.loras import make_lora

# peft 0.21 still reads transformers' deprecated `is_gradient_checkpointing` (a FutureWarning) in make_lora
pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")
SCENARIO = "defaults:\n  - model: tiny\n  - release: follow\n  - _self_\nrecipe:\n  name: sao\n"


@pytest.fixture(scope="module")
def disk(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Daemon, Path]]:
    root = tmp_path_factory.mktemp("full-disk")
    state = root / "state"
    state.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=48m", "tmpfs", str(state)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"filling a real disk needs a tmpfs of its own (mount: {mounted.stderr.decode().strip()})")
    d = Daemon(scenarios=make_scenarios(root / "scenarios", names=(), extra={"tiny": SCENARIO}), state=state,
               log_path=root / "reefd.log")
    try:
        d.start()
        yield d, state
    finally:
        if d.proc is not None and d.proc.poll() is None:
            d.stop()
        subprocess.run(["umount", "-l", str(state)], check=False)


def fill(state: Path) -> Path:
    """Take every free byte of the state folder's filesystem; the file's removal gives them back."""
    filler = state / "filler"
    free = subprocess.run(["df", "--output=avail", "-B1", str(state)], capture_output=True, text=True, check=True)
    subprocess.run(["fallocate", "-l", free.stdout.split()[-1], str(filler)], check=True)
    with filler.open("ab", buffering=0) as f:  # what fallocate's rounding left
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError:
            pass
    return filler


def full_error(status: int, body: dict[str, Any], headers: dict[str, str]) -> str:
    assert status == 503, body
    assert {k.lower(): v for k, v in headers.items()}.get("retry-after"), headers
    message = str(body["error"]["message"])
    assert "no space left on device" in message.lower(), message
    return str(body["error"]["code"])


def leftovers(state: Path) -> list[str]:
    """Half-written files: an upload's folder, a temporary LFS object, a job file's temporary copy."""
    places = [*(state / "releases.git" / "lfs" / "tmp").iterdir(), *(state / "jobs").glob(".*.tmp")]
    return sorted(str(p.relative_to(state)) for p in places)


def test_a_full_disk_is_a_503_that_says_so_and_leaves_nothing_half_written(
        disk: tuple[Daemon, Path], tmp_path: Path) -> None:
    d, state = disk
    adapter = tar_of(make_lora(state / "models" / "tiny", tmp_path / "lora"))
    jobs_before = json.loads(d.get("/reef/jobs")[1])["data"]
    head_before = json.loads(d.get("/reef/scenarios/tiny/releases")[1])["data"][0]["id"]
    filler = fill(state)
    try:
        chat = d.post("/v1/chat/completions", {"model": "t", "max_tokens": 4,
                                                "messages": [{"role": "user", "content": "hi"}]})
        assert full_error(*chat) == "storage_unavailable"
        train = d.post("/reef/scenarios/tiny/train", {})
        assert full_error(*train) == "storage_full"
        published = d.post("/reef/scenarios/tiny/releases?kind=adapter", adapter,
                           headers={"content-type": "application/x-tar"})
        assert full_error(*published) == "storage_full"
        assert json.loads(d.get("/reef/jobs")[1])["data"] == jobs_before  # no job listed that is not on disk
        assert json.loads(d.get("/reef/scenarios/tiny/releases")[1])["data"][0]["id"] == head_before
        assert leftovers(state) == []
    finally:
        filler.unlink()
    status, body, _ = d.post("/reef/scenarios/tiny/releases?kind=adapter", adapter,
                             headers={"content-type": "application/x-tar"})
    assert status == 201, body
    status, body, _ = d.post("/reef/scenarios/tiny/train", {})
    assert status in (200, 202), body
