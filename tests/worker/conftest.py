"""Fixtures for the engine worker: the tiny model (built once), an in-process engine, a real worker subprocess."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from reefd.worker.prepare import prepare
from tests.worker.support import Worker

# The worker subprocesses are forked after tokenizers ran here; keep its fork warning quiet.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The project's tiny random Llama, built once per session."""
    return prepare("tiny", tmp_path_factory.mktemp("models") / "tiny")


@pytest.fixture(scope="session")
def engine(tiny_model: Path) -> Any:
    from reefd.worker.model import Model

    return Model(tiny_model, device="cpu")


@pytest.fixture(scope="session")
def worker(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Worker]:
    """One worker subprocess shared by the read-only HTTP tests."""
    w = Worker(tiny_model, tmp_path_factory.mktemp("worker") / "worker.log", ["--max-batch", "8", "--threads", "1"])
    w.start()
    yield w
    code = w.stop()
    assert code == 0, w.logs()


@pytest.fixture
def fresh_worker(tiny_model: Path, tmp_path: Path) -> Iterator[Worker]:
    """A worker of the test's own (not started), for tests that stop it."""
    w = Worker(tiny_model, tmp_path / "worker.log")
    yield w
    if w.proc is not None and w.proc.poll() is None:
        w.proc.kill()
        w.proc.wait()
