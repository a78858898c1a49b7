"""How an engine process starts. `python -m reefd.worker` is forked from a fork server (the standard library's
`multiprocessing` one) that has imported torch, transformers and the worker's modules once: a worker's start, a
replica's or a restart's, skips their imports (about 3 s of CPU each here), and its replicas share those pages.
Any other program (SGLang, vLLM, the router) is executed as it is. Knows nothing about what the process serves."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import multiprocessing
import os
import runpy
import select
import signal
import sys
import threading
from collections.abc import Callable
from typing import Protocol

log = logging.getLogger("reefd.engines")

FORKED = frozenset({"reefd.worker"})
"""Modules launched from the fork server, which has imported what they import (reefd.worker.preload)."""

_CTX = multiprocessing.get_context("forkserver")
# "__main__": a reefd started by its console script is imported once in the server, not again in every child
_CTX.set_forkserver_preload(["__main__", "reefd.engines.launch", "reefd.worker.preload"])


_PR_SET_PDEATHSIG = 1


def _load_prctl() -> Callable[..., int] | None:
    try:
        prctl: Callable[..., int] = ctypes.CDLL("libc.so.6", use_errno=True).prctl
        return prctl
    except (OSError, AttributeError):  # not glibc Linux: children are still stopped on clean exits
        return None


_prctl = _load_prctl()  # loaded now: after fork, a threaded parent's child must not load libraries


def die_with_parent() -> None:
    """Runs in a child before exec: take SIGTERM when its parent dies, even by SIGKILL."""
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class Launched(Protocol):
    """A started engine process: what the supervisor watches and stops (asyncio's Process is one)."""

    pid: int

    @property
    def returncode(self) -> int | None:
        """Its exit code once it ended (negative: the signal that ended it), else None."""

    async def wait(self) -> int:
        """Until it ends; its exit code."""

    def terminate(self) -> None:
        """SIGTERM, while it runs (returncode None)."""


async def launch(argv: list[str], env: dict[str, str] | None) -> Launched:
    """Start `argv` in a session of its own (its group is killed with it), tied to reefd (it gets SIGTERM when
    reefd dies, even by SIGKILL), with stdin from /dev/null and reefd's stdout and stderr. `env`: its whole
    environment (None: reefd's). `[sys.executable, "-m", M, ...]` with M in FORKED is forked, unless
    REEF_FORKSERVER=0 (then everything is executed)."""
    if argv[:2] == [sys.executable, "-m"] and argv[2] in FORKED and os.environ.get("REEF_FORKSERVER", "1") != "0":
        for attempt in (1, 2):
            proc = _CTX.Process(target=_run_module, name=argv[2], daemon=True,  # daemon: reefd's exit stops it
                                args=(argv[2], argv[3:], dict(os.environ if env is None else env), os.getpid()))
            try:
                await asyncio.to_thread(proc.start)  # the first start waits for the server's imports
                return Forked(proc)
            except (EOFError, ConnectionError) as exc:  # the server ended as it was asked (killed, say)
                if attempt == 2:
                    raise
                log.warning("the fork server ended while starting %s (%r): starting it again", argv[2], exc)
                await asyncio.sleep(0.2)  # a server killed a moment ago is reaped, so the next start makes one
    return await asyncio.create_subprocess_exec(*argv, stdin=asyncio.subprocess.DEVNULL, env=env,
                                                preexec_fn=die_with_parent, start_new_session=True)


def _run_module(module: str, args: list[str], env: dict[str, str], owner: int) -> None:
    """In the forked child: what `python -m module args...` would do, in the launch's environment."""
    os.setsid()
    _die_with(owner)  # with reefd, not with the fork server: a server that dies alone takes no engine down
    if _parent_of(os.getppid()) not in (owner, None):
        # reefd (`owner`) died while the server was importing, before it could tie itself to reefd; the request
        # was already queued. Serve nothing: this child ending leaves the server nobody to keep it alive.
        raise SystemExit(1)
    os.environ.clear()
    os.environ.update(env)
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


def _die_with(owner: int) -> None:
    """In the forked child: SIGTERM to itself once reefd (`owner`) has ended, as a launched process gets from
    die_with_parent, watched through reefd's pidfd by a thread of its own. Its parent is the fork server, which
    may be killed alone: that must not end an engine that serves. Without pidfds (Linux < 5.3), the server's
    death is the signal, as before."""
    try:
        fd = os.pidfd_open(owner)
    except ProcessLookupError:  # reefd ended while the server was forking this child
        os.kill(os.getpid(), signal.SIGTERM)
        return
    except (OSError, AttributeError):
        die_with_parent()
        return

    def watch() -> None:
        select.select([fd], [], [])  # readable once reefd has ended
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="reefd-watch", daemon=True).start()


def _pidfd(pid: int) -> int | None:
    """A pidfd of `pid` (None: it has ended and been reaped, or pidfds are not supported)."""
    try:
        return os.pidfd_open(pid)
    except (OSError, AttributeError):
        return None


def _settle(ended: asyncio.Future[None]) -> None:
    if not ended.done():
        ended.set_result(None)


def _parent_of(pid: int) -> int | None:
    """A process's parent (None: not known, e.g. no /proc)."""
    try:
        return int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


SERVER_GONE = 255  # multiprocessing's exit code for a child whose fork server ended before reporting one


class Forked:
    """A process from the fork server, watched through the exit report the server writes to its sentinel (it is
    the server's child, not reefd's). A server killed alone reports nothing: the sentinel ends with no code
    (SERVER_GONE) while the process still runs, and from then on its pidfd says when it ends (its exit code is
    then unknown: SERVER_GONE). The next launch starts a new server."""

    def __init__(self, proc: multiprocessing.process.BaseProcess):
        self._proc = proc
        assert proc.pid is not None
        self.pid: int = proc.pid
        self._code: int | None = None
        self._pidfd: int | None = None  # once the server is gone
        self._watched = proc.sentinel  # what wait() reads: the sentinel, then the pidfd
        self._ended: asyncio.Future[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def returncode(self) -> int | None:
        if self._code is None and self._pidfd is None and self._proc.exitcode is not None:
            code = self._proc.exitcode
            self._unwatch()
            if code == SERVER_GONE and (fd := _pidfd(self.pid)) is not None:
                self._pidfd = fd  # the server is gone, not the process (or it is a zombie: the pidfd is ready)
            else:
                self._code = code
                self._proc.close()  # its sentinel: the code is kept here
        if self._pidfd is not None and select.select([self._pidfd], [], [], 0)[0]:
            self._unwatch()
            os.close(self._pidfd)
            self._pidfd, self._code = None, SERVER_GONE
            self._proc.close()
        return self._code

    async def wait(self) -> int:
        while self.returncode is None:
            if self._ended is None:  # one reader for every waiter: a waiter's timeout leaves it in place
                self._loop = asyncio.get_running_loop()
                self._ended = self._loop.create_future()
                self._watched = self._proc.sentinel if self._pidfd is None else self._pidfd
                self._loop.add_reader(self._watched, _settle, self._ended)
            await asyncio.shield(self._ended)
            self._unwatch()
        assert self._code is not None
        return self._code

    def terminate(self) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGTERM)

    def _unwatch(self) -> None:
        if self._ended is not None:  # a waiter blocked on it wakes and finds the exit code
            _settle(self._ended)
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._watched)
        self._loop = self._ended = None
