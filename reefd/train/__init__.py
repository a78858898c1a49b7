"""Trainer jobs: `python -m reefd.train --spec FILE` turns scored rollouts into a candidate. The trainer process and
its job contract: `spec` is torch-free (reefd imports it), `training`, `batch` and `objective` import torch; losses
live with their recipes. Where a job runs is the daemon's concern (reefd/grow/backends).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


class NonFinite(RuntimeError):
    """A NaN/inf loss or gradient: the job stops before the optimizer applies it (exit 3)."""


class Terminated(Exception):
    """SIGTERM arrived (a cancel, a job timeout, a cluster's `stop_job`, which kills 3 s later): the job stops at
    once and keeps the optimizer steps it finished."""


_deferred = False  # inside `uninterrupted`: a SIGTERM waits for the block's end
_pending = False


def on_sigterm(signum: int, frame: Any) -> None:
    """The trainer process's SIGTERM handler: raise Terminated where the job is, unless a block that must not stop
    half-way (an optimizer step, a save) is running; that block raises it when it ends."""
    global _pending
    if _deferred:
        _pending = True
        return
    raise Terminated()


def sigterm_pending() -> bool:
    """A SIGTERM arrived inside a block that then failed: the process was asked to go."""
    return _pending


@contextmanager
def uninterrupted() -> Iterator[None]:
    """Run a block that must complete or not start (an optimizer step: parameters half updated are worse than
    either side); a SIGTERM that arrives meanwhile raises Terminated once the block ends."""
    global _deferred, _pending
    if _deferred:  # nested: the outer block decides
        yield
        return
    _deferred = True
    try:
        yield
    finally:
        _deferred = False
    if _pending:
        _pending = False
        raise Terminated()


@contextmanager
def quiet_peft() -> Iterator[None]:
    """peft 0.21 reads transformers' deprecated `is_gradient_checkpointing` when it wraps, loads or saves an
    adapter; that FutureWarning tells a user nothing. Torch-free: the worker uses it too."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*is_gradient_checkpointing.*", FutureWarning)
        yield
