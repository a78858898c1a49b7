"""`python -m reefd.train --spec FILE`: one trainer job; `--serve`: job after job, one spec path per stdin line (torch
imports once). Owns the job's contract with reefd: JSON event lines on stdout; exit 0 done, 1 error, 2 bad spec, 3
non-finite loss, 137 injected crash, 143 SIGTERM (the steps finished are saved first, marked `stopped`); the
candidate written beside output_dir, fsynced, renamed into place. Test faults: spec.py's FAULTS (the spec's `fault`).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import shutil
import signal
import sys
import tempfile
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from reefd.ops.files import fsync_path
from reefd.train import NonFinite, Terminated, on_sigterm, sigterm_pending, uninterrupted
from reefd.train.spec import SpecError, TrainSpec, load_spec


def emit(event: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(event, allow_nan=False) + "\n")
    sys.stdout.flush()


def one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 500 else text[:497] + "..."


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m reefd.train", description=__doc__)
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--spec", help="run one job: the job spec (JSON)")
    mode.add_argument("--serve", action="store_true",
                      help="stay up and run one job per spec path read on stdin; each job's events end with "
                           '{"event": "exit", "status": N}, N being what --spec would exit with')
    args = parser.parse_args(argv)
    return job(args.spec) if args.spec is not None else serve()


def serve() -> int:
    """Jobs back to back in one process, so torch, transformers and peft are imported once, before the first
    job arrives."""
    try:
        warm_up()
        for line in sys.stdin:
            path = line.strip()
            if not path:
                continue
            status = job(path)
            emit({"event": "exit", "status": status})
            gc.collect()
            if status == 143 or sigterm_pending():  # SIGTERM: the process is asked to go
                return 143
    except Terminated:  # SIGTERM between jobs
        return 143
    return 0


def warm_up() -> None:
    """Import what every job needs (seconds of CPU), so that a process started ahead of its first job has them.
    A failing import is left for the job, which reports it as its error."""
    with contextlib.suppress(Exception):
        import peft  # noqa: F401
        import transformers  # noqa: F401
        from transformers import AutoModelForCausalLM  # noqa: F401  (transformers imports lazily)

        import reefd.train.training  # noqa: F401


def job(path: str) -> int:
    """One job: its events on stdout, and the exit status of `--spec`."""
    try:
        spec = load_spec(path)
    except SpecError as exc:
        return _fail(f"bad spec: {one_line(exc)}", 2)
    signal.signal(signal.SIGTERM, on_sigterm)
    try:
        return run(spec)
    except SpecError as exc:
        return _fail(f"bad spec: {one_line(exc)}", 2)
    except NonFinite as exc:
        return _fail(one_line(exc), 3)
    except Terminated:
        return _fail("terminated by SIGTERM", 143)
    except Exception as exc:
        traceback.print_exc()  # stderr: the trainer's log keeps the whole story
        return _fail(one_line(exc), 1)


def run(spec: TrainSpec) -> int:
    from reefd.train.training import train  # torch: only in this process, only after the spec is good

    trained = train(spec, emit)
    metrics = trained.metrics
    with uninterrupted():  # a SIGTERM now waits for the save and its event
        with staged(spec.output_dir) as folder:
            trained.save(folder)
            report = {"job": spec.job, "objective": spec.objective, "metrics": metrics}
            (folder / "metrics.json").write_text(json.dumps(report, indent=2, allow_nan=False) + "\n")
        if spec.proof is not None:
            prove(spec)
        emit({"event": "done", "adapter": str(spec.output_dir), "metrics": metrics})
    if metrics.get("stopped"):
        return _fail(f"terminated by SIGTERM after {metrics['steps']} of {spec.steps} steps; the steps done are "
                     "saved", 143)
    return 0


def prove(spec: TrainSpec) -> None:
    """The saved candidate's fingerprint, as the daemon's reference would compute it (the same code, here where
    torch is loaded already). A failure is only logged: the daemon's reference then computes it."""
    from reefd.train.fingerprint import fingerprint

    assert spec.proof is not None
    full = spec.target == "full"
    try:
        doc = fingerprint(spec.output_dir if full else spec.base_model, None if full else spec.output_dir,
                          spec.proof["texts"], spec.proof["max_tokens"], Path(spec.proof["tokenizer"]))
    except Exception as exc:
        sys.stderr.write(f"the candidate's fingerprint failed: {one_line(exc)}\n")
        return
    emit({"event": "proof", "fingerprint": doc})


@contextmanager
def staged(out: Path) -> Iterator[Path]:
    """A fresh folder beside `out`, renamed onto it (absent or empty) once complete and fsynced."""
    out.parent.mkdir(parents=True, exist_ok=True)
    for stale in out.parent.glob(f".{out.name}.*.partial"):
        shutil.rmtree(stale, ignore_errors=True)  # left by a job killed while saving
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp's 0700 would follow the folder into the release chain
    try:
        yield tmp
        for path in sorted(tmp.rglob("*"), reverse=True):  # files before the folders that hold them
            os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~umask)  # safetensors writes 0600
            fsync_path(path)
        fsync_path(tmp)
        os.rename(tmp, out)  # atomic; replaces an empty `out`, fails on a non-empty one
        fsync_path(out.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _fail(reason: str, status: int) -> int:
    emit({"event": "error", "reason": reason})
    return status


if __name__ == "__main__":
    sys.exit(main())
