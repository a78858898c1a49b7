"""Code tasks (`practice.verifier.code: python`): each task line names the function to write (`entry`) and its
`tests` (calls with their `expected` results). The answer's code runs in a sandbox of its own beside a trusted
driver (code_driver.py) given the calls alone; what comes back is compared with `expected` here, in reefd's
process. So the answer never reads the key: neither the task line nor an expected value is in its sandbox (nor the
scenarios folder, the set's home), and its exit status, its output and whatever it patches inside its own process
can change only the values it reports. Knows nothing about records, rounds or the other verifier forms.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import keyword
import math
import re
import sys
from pathlib import Path
from typing import Any

from reefd.grow.practice import sandbox
from reefd.grow.practice.sandbox import Limits, Outcome
from reefd.grow.practice.verdicts import FEEDBACK, TAIL, Verdict, printable

LANGUAGES = ("python",)  # what `practice.verifier.code` may name; each has its driver and interpreter
MAX_TESTS = 100  # tests of one task
VALUE_CHARS = 2000  # of one result line: a longer value fails its test (too_long)
OUTPUT_BYTES = 1 << 18  # kept of the channel: MAX_TESTS full result lines fit; more is the candidate's garbage
DRIVER = Path(__file__).with_name("code_driver.py")
# the interpreter reefd runs on, isolated (-I: no environment, no user site, not even the cwd on sys.path) and
# with the standard library alone (-S: no site-packages); its prefixes are all the sandbox sees of the host's
PYTHON = (sys.executable, "-I", "-S", "-B", "driver.py")
PREFIXES = tuple(dict.fromkeys(Path(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix,
                                                  sys.base_exec_prefix)))
_BLOCK = re.compile(r"^[ \t]*```[ \t]*([\w+.-]*)[^\n]*\n(.*?)^[ \t]*```", re.DOTALL | re.MULTILINE)
_PYTHON = ("python", "python3", "py")
_TEST_KEYS = ("args", "kwargs", "expected")


@functools.cache
def _driver() -> bytes:
    return DRIVER.read_bytes()


def task_problem(task: dict[str, Any]) -> str | None:
    """Why a practice task is not a code task (one line), or None: `entry` a function name, `tests` 1 to MAX_TESTS
    objects with `expected` and optional `args` (a list) and `kwargs` (an object)."""
    entry, tests = task.get("entry"), task.get("tests")
    if not isinstance(entry, str) or not entry.isidentifier() or keyword.iskeyword(entry):
        return f"'entry' must be the name of the Python function to call, not {entry!r}"[:200]
    if not isinstance(tests, list) or not 1 <= len(tests) <= MAX_TESTS:
        return f"'tests' must be a list of 1 to {MAX_TESTS} tests"
    for i, test in enumerate(tests):
        if not isinstance(test, dict) or "expected" not in test:
            return f"tests[{i}] must be an object with 'expected' (and 'args', 'kwargs')"
        if unknown := sorted(set(test) - set(_TEST_KEYS)):
            return f"tests[{i}]: unknown key {unknown[0]!r} (a test has {', '.join(_TEST_KEYS)})"
        if not isinstance(test.get("args", []), list) or not isinstance(test.get("kwargs", {}), dict):
            return f"tests[{i}]: 'args' must be a list and 'kwargs' an object"
    return None


def extract(answer: str) -> str:
    """The code of an answer: its first ```python fenced block, else its first untagged one, else all of it."""
    blocks = [(m.group(1).lower(), m.group(2)) for m in _BLOCK.finditer(answer)]
    for tags in (_PYTHON, ("",)):
        for tag, body in blocks:
            if tag in tags:
                return body
    return answer


class CodeVerifier:
    """Runs an answer's code against a task's tests: its own sandbox, holding candidate.py and driver.py only."""

    def __init__(self, limits: Limits, hide: tuple[Path, ...]) -> None:
        self.limits = dataclasses.replace(limits, output_bytes=OUTPUT_BYTES)
        self.hide = hide

    async def verify(self, answer: str, task: dict[str, Any]) -> Verdict:
        problem = task_problem(task)
        if problem is not None:  # refused at load; a task given directly may still be malformed
            return Verdict(0.0, f"not a code task: {problem}", {})
        tests = task["tests"]
        job = {"entry": task["entry"], "max_chars": VALUE_CHARS,
               "calls": [{"args": t.get("args", []), "kwargs": t.get("kwargs", {})} for t in tests]}
        outcome = await sandbox.run(PYTHON, limits=self.limits, stdin=json.dumps(job).encode(), hide=self.hide,
                                    expose=PREFIXES, files={"candidate.py": extract(answer).encode(),
                                                            "driver.py": _driver()})
        return judge(outcome, task["entry"], tests)


def judge(outcome: Outcome, entry: str, tests: list[dict[str, Any]]) -> Verdict:
    """The verdict of a run: the share of tests whose reported value equals `expected`, when the channel holds one
    result per test; 0 (the answer's failure) for anything else the candidate made of it, its exit status
    whatever it is; the verifier's failure only where the driver never started."""
    output: dict[str, Any] = {"returncode": outcome.returncode, "seconds": round(outcome.seconds, 4),
                              "stdout": printable(outcome.stdout)[-TAIL:],
                              "stderr": printable(outcome.stderr)[-TAIL:], "tests": len(tests), "passed": 0}
    lines = outcome.stdout.split("\n")
    if lines[-1] == "":
        lines.pop()
    if not lines:  # the driver writes its first line before the candidate is imported: it never ran
        said = " ".join(outcome.stderr.split())[-300:]
        why = f"{outcome.failure or 'it wrote nothing'}{': ' + said if said else ''}"
        return Verdict(0.0, printable(f"the code driver did not run: {why}"), output)
    results = [_parse(line) for line in lines[1:]]
    if lines[0] != json.dumps({"started": len(tests)}) or not all(results):
        return _failed(output, "the results channel held something other than one result per test")
    if any("import_error" in r for r in results):
        if len(results) > 1:
            return _failed(output, "the results channel held something other than one result per test")
        return _failed(output, f"the code did not load: {_quote(results[0]['import_error'])}")
    if len(results) > len(tests):
        return _failed(output, "the results channel held more results than tests")
    if len(results) < len(tests):
        return _failed(output, f"the code stopped after {len(results)} of {len(tests)} tests "
                               f"({outcome.failure or 'it exited'})")
    failures = [f"test {i}: {_call(entry, test)} {_got(result)}"
                for i, (test, result) in enumerate(zip(tests, results, strict=True), start=1)
                if not same(result.get("value", _NONE), test["expected"])]
    output["passed"] = passed = len(tests) - len(failures)
    return Verdict(passed / len(tests), None, output, _summary(passed, len(tests), failures))


_NONE = object()  # a result with no value (it raised, or its value was too long): equal to nothing


def _parse(line: str) -> dict[str, Any]:
    """A result line as the driver writes it, or {} for anything else."""
    try:
        found = json.loads(line)
    except (ValueError, RecursionError):  # RecursionError: nesting deeper than the decoder goes
        return {}
    if not isinstance(found, dict) or len(found) != 1:
        return {}
    key, value = next(iter(found.items()))
    if key == "value" or (key in ("raised", "import_error") and isinstance(value, str)) or (
            key == "too_long" and isinstance(value, int)):
        return found
    return {}


def same(got: Any, want: Any) -> bool:
    """Whether a reported value is the expected one, as JSON values: a bool only equals a bool, numbers compare as
    numbers (floats within 1e-9, relative or absolute; NaN equals nothing), lists item by item, objects key by
    key."""
    if isinstance(got, bool) or isinstance(want, bool):
        return type(got) is type(want) and got == want
    if isinstance(got, int | float) and isinstance(want, int | float):
        if isinstance(got, int) and isinstance(want, int):
            return got == want
        try:
            return math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-9)
        except OverflowError:  # an int too large for a float is no float's equal
            return False
    if isinstance(got, list) and isinstance(want, list):
        return len(got) == len(want) and all(same(g, w) for g, w in zip(got, want, strict=True))
    if isinstance(got, dict) and isinstance(want, dict):
        return got.keys() == want.keys() and all(same(got[k], want[k]) for k in want)
    return type(got) is type(want) and bool(got == want)


def _failed(output: dict[str, Any], why: str) -> Verdict:
    return Verdict(0.0, None, output, why)


def _quote(text: Any, limit: int = 160) -> str:
    """The candidate's text as one escaped line: every control character (newlines too) as \\xNN."""
    text = str(text)
    short = text if len(text) <= limit else text[:limit] + "…"
    return printable(short).replace("\t", "\\x09").replace("\n", "\\x0a")


def _call(entry: str, test: dict[str, Any]) -> str:
    """The call a test makes, as Python-ish text (its inputs: a task's, never its expected value)."""
    args = [json.dumps(a) for a in test.get("args", [])]
    args += [f"{k}={json.dumps(v)}" for k, v in test.get("kwargs", {}).items()]
    return f"{entry}({_quote(', '.join(args), 120)})"


def _got(result: dict[str, Any]) -> str:
    if "value" in result:
        return f"returned {_quote(json.dumps(result['value']), 120)}"
    if "raised" in result:
        return f"raised {_quote(result['raised'])}"
    return f"returned a value {result['too_long']} characters long as JSON (at most {VALUE_CHARS})"


def _summary(passed: int, total: int, failures: list[str]) -> str:
    """The feedback: how many passed, then each failed test's call and what it gave, as many as fit FEEDBACK."""
    text = f"passed {passed} of {total} tests"
    for i, line in enumerate(failures):
        more = f"\n…and {len(failures) - i} more failed"
        if len(text) + 1 + len(line) + len(more) > FEEDBACK:
            return text + more
        text += "\n" + line
    return text
