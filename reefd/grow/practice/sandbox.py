"""The verification sandbox: one command in a process tree of its own, in a scratch folder it alone may write,
with a time limit, a memory limit, a process limit, a bound on what it writes, and no network. Whatever the
command does (hang, crash, fork, fill its output or its folders, write elsewhere), the caller gets an Outcome
and the tree is gone. Knows nothing about tasks, answers or verdicts.

It is bubblewrap (`bwrap`, Debian's `bubblewrap`) on a root of its own that holds only the system's libraries and
interpreters (SYSTEM, a few files of /etc), the paths the caller exposes (the Python prefix, the verifier's own
program, what a scenario lists), its scratch folder, and a private /tmp, /dev/shm, /dev and /proc: no /root, no
/home, no reefd state, nothing else of the host's. Its writable places are tmpfs mounts of `disk_mb` each, so
nothing it writes reaches the host's disk. It has new network, PID, IPC and UTS namespaces and no capabilities,
and it runs as user nobody (NOBODY): under root, bubblewrap drops to that uid itself (setpriv, before the
command starts, the only capabilities kept until then being the three it needs); under any other user, in a new
user namespace where reefd's own uid is seen as nobody's. util-linux's `prlimit` sets the limits; under root, where
the kernel never applies the process limit to root and nobody's count is the host's, each run also gets a pids
cgroup of its own (cgroup v2, or v1's pids hierarchy) whose pids.max holds it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

PATH = "/usr/local/bin:/usr/bin:/bin"
# bubblewrap's own environment: inside the sandbox its init is PID 1, and /proc/1/environ shows what bwrap was
# started with, whatever --clearenv gives the command. So bwrap starts with this alone, never with reefd's
# environment (REEF_TOKEN, upstream API keys).
WRAPPER_ENV = {"PATH": PATH}
NOBODY = 65534  # the uid and gid a verifier runs as
SYSTEM = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")  # libraries and interpreters
SYSTEM_ETC = ("alternatives", "ld.so.cache", "ld.so.conf", "ld.so.conf.d", "localtime")  # what programs look up


class SandboxUnavailable(RuntimeError):
    """This host cannot make the sandbox (bubblewrap missing, namespaces refused); str() says which and the fix."""


@dataclass(frozen=True)
class Limits:
    timeout_s: float = 10.0  # wall clock, from start to exit; then the whole tree is killed
    memory_mb: int = 512  # address space of each process
    processes: int = 64  # processes and threads at once
    output_bytes: int = 65536  # of stdout and of stderr each, the last ones (a verdict line ends stdout)
    file_mb: int = 64  # the largest file it may write
    disk_mb: int = 256  # what it may write in each of its writable folders: its scratch folder, /tmp, /dev/shm


@dataclass(frozen=True)
class Outcome:
    returncode: int | None  # None: killed at the time limit; negative: the signal that ended it
    stdout: str
    stderr: str
    seconds: float
    timed_out: bool = False
    started: bool = True  # False: the sandbox itself could not be set up (stderr says why)

    @property
    def failure(self) -> str | None:
        """Why the run failed, in a few words; None when it exited 0."""
        if not self.started:
            return f"the sandbox did not start: {' '.join(self.stderr.split())[:300]}"
        if self.timed_out:
            return "timed out"
        if self.returncode is not None and self.returncode < 0:
            return f"killed by signal {-self.returncode}"
        if self.returncode is not None and self.returncode > 128:  # as a shell tells it (bwrap passes it on so)
            return f"killed by signal {self.returncode - 128}"
        if self.returncode:
            return f"exit status {self.returncode}"
        return None


def bwrap() -> str:
    found = shutil.which("bwrap")
    if found is None:
        raise SandboxUnavailable("the verifier sandbox needs bubblewrap: apt-get install bubblewrap "
                                 "(make does this on Debian)")
    return found


def argv_for(command: Sequence[str], scratch: Path, limits: Limits, hide: Sequence[Path] = (),
             env: dict[str, str] | None = None, expose: Sequence[Path] = (), status_fd: int | None = None) -> list[str]:
    """The full command line that runs `command` in the sandbox, in a folder at `scratch`'s path that is a
    tmpfs of its own holding `scratch`'s files read-only (what it writes never reaches the host's disk);
    `expose`'s paths are seen read-only at their own paths, `hide`'s folders as empty ones even where they lie
    in an exposed path; bwrap reports on `status_fd` (JSON lines) that it started."""
    size = str(limits.disk_mb << 20)
    root = Root()
    for path in [Path(p) for p in SYSTEM] + [Path("/etc") / e for e in SYSTEM_ETC]:
        root.add(path)
    root.args += ["--dev", "/dev", "--perms", "1777", "--size", size, "--tmpfs", "/dev/shm", "--remount-ro", "/dev",
                  "--proc", "/proc", "--perms", "1777", "--size", size, "--tmpfs", "/tmp"]
    # every path absolute: bwrap resolves a relative one against its new root, where it cannot be mounted (reefd
    # started with a relative --state would have every answer judged wrong)
    for path in expose:  # after /tmp: an exposed path may lie under it
        root.add(path.absolute())
    for folder in (f.absolute() for f in hide):
        if folder.is_dir() and root.covers(folder):
            root.args += ["--tmpfs", str(folder), "--remount-ro", str(folder)]
    scratch = scratch.absolute()
    root.args += ["--perms", "1777", "--size", size, "--tmpfs", str(scratch)]
    for path in sorted(scratch.iterdir()):
        path.chmod(0o644)  # readable by nobody inside; the host folder (0700) keeps other users out
        root.args += ["--ro-bind", str(path), str(path)]
    as_root = os.geteuid() == 0
    wrap = [bwrap(), *(["--json-status-fd", str(status_fd)] if status_fd is not None else []), *root.args,
            "--chdir", str(scratch), *_identity(as_root), "--die-with-parent", "--new-session", "--clearenv",
            "--setenv", "PATH", PATH, "--setenv", "HOME", str(scratch), "--setenv", "TMPDIR", "/tmp"]
    for key, value in (env or {}).items():
        wrap += ["--setenv", key, value]
    limit = ["prlimit", f"--as={limits.memory_mb << 20}", f"--fsize={limits.file_mb << 20}", "--core=0",
             *([] if as_root else [f"--nproc={limits.processes}"]), "--"]  # under root: the cgroup
    return [*wrap, "--", *(_drop() if as_root else []), *limit, *command]


class Root:
    """The sandbox's root as bwrap arguments: host paths bound read-only at their own paths (a symlink made as
    one), each folder on the way to them made 0755 (bwrap would make it 0700, which nobody cannot cross)."""

    def __init__(self) -> None:
        self.args: list[str] = []
        self.bound: list[Path] = []
        self.made = {Path("/"), Path("/tmp"), Path("/dev"), Path("/proc")}

    def covers(self, path: Path) -> bool:
        """Whether `path` lies in a bound path (so the sandbox would see it)."""
        return any(path.is_relative_to(b) for b in self.bound)

    def add(self, path: Path) -> None:
        if self.covers(path) or not (path.exists() or path.is_symlink()):
            return
        for folder in reversed(path.parents):
            if folder not in self.made:
                self.args += ["--perms", "0755", "--dir", str(folder)]
                self.made.add(folder)
        if path.is_symlink():  # merged /usr's /bin, /etc/localtime: its target is in the root or nowhere
            self.args += ["--symlink", os.readlink(path), str(path)]
        else:
            self.args += ["--ro-bind", str(path), str(path)]
        self.bound.append(path)


def _identity(as_root: bool) -> list[str]:
    """The namespaces and the user: under root, no user namespace (bwrap drops to NOBODY by _drop, keeping only
    the capabilities to do so); otherwise a user namespace where reefd's uid and gid are seen as NOBODY's."""
    spaces = ["--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try"]
    if as_root:
        return [*spaces, "--cap-drop", "ALL", *(a for c in _KEPT for a in ("--cap-add", c))]
    return [*spaces, "--unshare-user", "--uid", str(NOBODY), "--gid", str(NOBODY), "--cap-drop", "ALL"]


_KEPT = ("CAP_SETUID", "CAP_SETGID", "CAP_SETPCAP")  # under root, until setpriv has become nobody


def _drop() -> list[str]:
    """Under root, what the command is started by: setpriv, becoming NOBODY with no groups and an empty bounding
    set (the kernel clears the capabilities kept for it as the uid leaves 0)."""
    return ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--inh-caps=-all",
            "--bounding-set=-all", "--"]


async def run(command: Sequence[str], *, limits: Limits, stdin: bytes = b"", files: dict[str, bytes] | None = None,
              hide: Sequence[Path] = (), env: dict[str, str] | None = None,
              expose: Sequence[Path] = ()) -> Outcome:
    """Run `command` in a new scratch folder holding `files`, `stdin` on its standard input; removed after."""
    scratch = Path(tempfile.mkdtemp(prefix="reef-verify-"))
    try:
        for name, data in (files or {}).items():
            (scratch / name).write_bytes(data)
        status, status_w = os.pipe()
        try:
            argv = argv_for(command, scratch, limits, hide, env, expose, status_w)
            with Pids(limits.processes) as pids:
                outcome = await _run(pids.enter(argv), stdin, limits, status_w)
            if b'"child-pid"' not in await asyncio.to_thread(_drain, status):
                outcome = dataclasses.replace(outcome, returncode=None, started=False)
            return outcome
        finally:
            os.close(status)
    finally:
        await asyncio.to_thread(shutil.rmtree, scratch, True)


def _drain(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, 65536):
        chunks.append(chunk)
    return b"".join(chunks)


class Pids:
    """Under root, a pids cgroup for one run (its pids.max the process limit), left when the run ends; for any
    other user, nothing (prlimit holds)."""

    def __init__(self, limit: int) -> None:
        self.limit, self.path = limit, None if os.geteuid() != 0 else _new_cgroup()

    def __enter__(self) -> Pids:
        if self.path is not None:
            (self.path / "pids.max").write_text(str(self.limit + 2))  # bwrap and its init beside the tree
        return self

    def enter(self, argv: list[str]) -> list[str]:
        if self.path is None:
            return argv
        return ["/bin/sh", "-c", 'echo $$ > "$0" && exec "$@"', str(self.path / "cgroup.procs"), *argv]

    def __exit__(self, *exc: object) -> None:
        if self.path is not None:
            for _ in range(50):  # the tree is dead; its last zombies are reaped within moments
                try:
                    self.path.rmdir()
                    return
                except OSError:
                    time.sleep(0.01)


def _new_cgroup() -> Path:
    """A new cgroup with a pids.max, under reefd's own (v2, where pids is enabled for its children) or in v1's
    pids hierarchy; SandboxUnavailable when neither can be made."""
    tried = []
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, own = line.split(":", 2)
        base = (Path("/sys/fs/cgroup") if not controllers else
                Path("/sys/fs/cgroup/pids") if "pids" in controllers.split(",") else None)
        if base is None:
            continue
        path = base / own.lstrip("/") / f"reef-verify-{os.getpid()}-{next(_SERIAL)}"
        try:
            path.mkdir()
        except OSError as exc:
            tried.append(f"{path.parent}: {exc.strerror}")
            continue
        if (path / "pids.max").exists():
            return path
        path.rmdir()
        tried.append(f"{path.parent}: no pids controller")
    raise SandboxUnavailable("under root the verifier sandbox needs a pids cgroup to hold its process limit, and "
                             f"none could be made ({'; '.join(tried) or 'no cgroup'}): run reefd as another user")


_SERIAL = itertools.count()


async def _run(argv: list[str], stdin: bytes, limits: Limits, status_w: int) -> Outcome:
    began = time.monotonic()
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            start_new_session=True, pass_fds=(status_w,), env=WRAPPER_ENV)
    finally:
        os.close(status_w)  # the tree holds the only other end: EOF once it is gone
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    reads = asyncio.gather(_read(proc.stdout, limits.output_bytes), _read(proc.stderr, limits.output_bytes),
                           _feed(proc.stdin, stdin))
    timed_out = False
    try:
        await asyncio.wait_for(asyncio.shield(proc.wait()), limits.timeout_s)
    except TimeoutError:
        timed_out = True
    finally:  # the tree dies with bwrap (its PID namespace); the group kill covers a wrapper still starting
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        await proc.wait()
    out, err, _ = await reads
    return Outcome(returncode=None if timed_out else proc.returncode, stdout=out, stderr=err,
                   seconds=time.monotonic() - began, timed_out=timed_out)


async def _read(stream: asyncio.StreamReader, limit: int) -> str:
    """The last `limit` bytes, where a verdict line is; what came before is read and dropped (so a chatty command
    never blocks on a full pipe), and a first line says how much."""
    kept, dropped = bytearray(), 0
    while chunk := await stream.read(65536):
        kept += chunk
        if len(kept) > limit:
            dropped += len(kept) - limit
            del kept[:len(kept) - limit]
    text = kept.decode("utf-8", errors="replace")
    return f"[{dropped} bytes before this were dropped]\n{text}" if dropped else text


async def _feed(pipe: asyncio.StreamWriter, data: bytes) -> None:
    """The command's stdin; one that exits (or closes it) without reading it all is fine. uvloop says so with a
    RuntimeError on a transport it has closed, asyncio with BrokenPipeError."""
    with contextlib.suppress(BrokenPipeError, ConnectionResetError, RuntimeError):
        if not pipe.is_closing():
            pipe.write(data)
            await pipe.drain()
        pipe.close()


def check() -> None:
    """Raise SandboxUnavailable unless a sandboxed `true` runs here (checked once, when a scenario loads)."""
    import subprocess

    scratch = Path(tempfile.mkdtemp(prefix="reef-verify-"))
    try:
        with Pids(Limits.processes) as pids:
            done = subprocess.run(pids.enter(argv_for(["true"], scratch, Limits())), capture_output=True,
                                  timeout=30, check=False, env=WRAPPER_ENV)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise SandboxUnavailable(f"the verifier sandbox cannot start: {exc}") from None
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if done.returncode != 0:
        why = " ".join(done.stderr.decode(errors="replace").split())[:300]
        raise SandboxUnavailable(f"the verifier sandbox cannot start here ({why}): it needs user namespaces "
                                 "(sysctl kernel.unprivileged_userns_clone=1; under systemd, the drop-in "
                                 "systemd/reefd.service.d/practice.conf: docs/operations.md)")
