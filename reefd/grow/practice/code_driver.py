"""A code task's driver: copied into the code sandbox as driver.py beside the answer's candidate.py, and run there
by an isolated Python (standard library only). It reads the calls from stdin (each test's `args` and `kwargs`,
never an expected value), imports the candidate, calls its entry on each, and writes one JSON line per call on the
results channel: the stdout it started with. Knows nothing of reefd (nothing of it is in that sandbox) and judges
nothing: reefd compares the results with the tests' `expected`, outside the candidate's process.

The channel's lines: {"started": N} before the candidate is imported, then {"import_error": why} alone, or N lines
of {"value": v}, {"raised": why} or {"too_long": chars}. The candidate runs in this process, so it may write to
the channel, or patch this driver, but all it can change is the values reported for its own calls.
"""

import importlib.util
import json
import os
import sys


def why(exc: BaseException) -> str:
    """The exception in one bounded line (its str() is the candidate's code, which may itself fail)."""
    try:
        text = f"{type(exc).__name__}: {exc}"
    except BaseException:  # a __str__ that raises: the exception is still reported, by its type
        text = type(exc).__name__
    return text[:300]


def main() -> None:
    job = json.loads(sys.stdin.buffer.read())
    calls, limit, dumps = job["calls"], int(job["max_chars"]), json.dumps
    channel = os.fdopen(os.dup(1), "w", encoding="ascii")  # the results alone: ASCII JSON, one line each
    os.dup2(2, 1)  # what the candidate prints goes to stderr, never onto the channel
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)  # its input() reads nothing

    def send(line: str) -> None:
        channel.write(line + "\n")
        channel.flush()

    send(dumps({"started": len(calls)}))
    try:
        spec = importlib.util.spec_from_file_location("candidate", "candidate.py")
        assert spec is not None and spec.loader is not None
        module = sys.modules["candidate"] = importlib.util.module_from_spec(spec)  # as an import would (dataclasses)
        spec.loader.exec_module(module)
        entry = module.__dict__.get(job["entry"])
        if not callable(entry):
            raise LookupError(f"candidate.py defines no function {job['entry']}")
    except BaseException as exc:  # SystemExit and the like too: the candidate did not load
        send(dumps({"import_error": why(exc)}))
        return
    for call in calls:
        try:
            line = dumps({"value": entry(*call["args"], **call["kwargs"])})
        except BaseException as exc:  # whatever the call raises, or a value that is not JSON
            line = dumps({"raised": why(exc)})
        send(line if len(line) <= limit else dumps({"too_long": len(line)}))


if __name__ == "__main__":
    main()
    try:
        sys.stdout.flush()  # what the candidate printed, to stderr
    finally:
        os._exit(0)  # no atexit handler or thread of the candidate's runs after its results
