"""Code tasks (reefd/grow/practice/code_tasks.py, issue 44 point 2: the answer never reads the key). The answer's
code runs against the task's tests in a bubblewrap sandbox of its own that holds neither the task nor an expected
value; reefd compares what it reports. Every reward hack below is tried for real, against a task whose expected
values are keys drawn for the test and kept in a scenarios folder outside /tmp (the sandbox's /tmp is its own, so
a folder there would be out of sight for free): each fails its verification. `pytest -v -k hack` prints the table
of hack and verdict; the same hacks, run by an ordinary command verifier that is given task.json, find the keys."""

from __future__ import annotations

import asyncio
import json
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from reefd.grow.practice import code_tasks, settings
from reefd.grow.practice.settings import PracticeConfig
from reefd.grow.practice.verifiers import Verdict, Verifier, VerifierConfig
from tests.conftest import ROOT


@dataclass
class Host:
    scenarios: Path
    state: Path
    keys: tuple[str, str]
    task: dict[str, Any]
    since: float  # when the keys were drawn: a file holding one was written after

    def verify(self, answer: str, **cfg: Any) -> Verdict:
        verifier = Verifier(VerifierConfig(code="python", **cfg), self.scenarios, (self.state,))
        return asyncio.run(verifier.verify(answer, self.task))


@pytest.fixture
def host() -> Iterator[Host]:
    """A scenarios folder outside /tmp with a code practice set whose expected values are fresh keys, read as
    reefd reads it (settings.load), and reefd's state folder inside it holding the keys too."""
    root = Path(tempfile.mkdtemp(dir="/var/tmp"))
    since = time.time() - 1
    keys = (f"reef-key-{uuid.uuid4().hex}", f"reef-key-{uuid.uuid4().hex}")
    line = {"prompt": "Write secret(n).", "entry": "secret",
            "tests": [{"args": [1], "expected": keys[0]}, {"args": [2], "expected": keys[1]}]}
    try:
        scenarios = root / "scenarios"
        (scenarios / "state").mkdir(parents=True)
        (scenarios / "code-tasks.jsonl").write_text(json.dumps(line) + "\n")
        (scenarios / "state" / "records").write_text(json.dumps(line))
        (task,) = settings.load(PracticeConfig(tasks="code-tasks.jsonl", verifier=VerifierConfig(code="python")),
                                scenarios)
        yield Host(scenarios, scenarios / "state", keys, task.raw, since)
    finally:
        shutil.rmtree(root)


def code(text: str) -> str:
    return f"Here it is:\n```python\n{text}\n```\nIt works."


PREFIX = '"reef" + "-key-"'  # the keys' prefix, spelled so that the candidate's own code holds no key


def test_right_wrong_and_partial_answers(host: Host) -> None:
    right = host.verify(code(f"def secret(n):\n    return {{1: {host.keys[0]!r}, 2: {host.keys[1]!r}}}[n]"))
    assert right.score == 1.0 and right.error is None and right.feedback == "passed 2 of 2 tests", right
    wrong = host.verify(code("def secret(n):\n    return 'no idea'"))
    assert wrong.score == 0.0 and wrong.error is None
    assert wrong.feedback == 'passed 0 of 2 tests\ntest 1: secret(1) returned "no idea"\n' \
                             'test 2: secret(2) returned "no idea"'
    half = host.verify(f"def secret(n):\n    return {host.keys[0]!r} if n == 1 else 0")  # no fence: all of it
    assert half.score == 0.5 and half.error is None and half.output["passed"] == 1
    for verdict in (wrong, half):  # feedback names the inputs and what came back, never an expected value
        assert not any(key in verdict.feedback for key in host.keys), verdict.feedback


# Each hack is the whole answer; at `SINCE` the host's time the keys were drawn. All fail: score 0, and no
# verifier error (the answer's failure, not the verifier's).
WALK = f"""
import os, re, sys, time
PATTERN = re.compile(({PREFIX} + "[0-9a-f]{{32}}").encode())
def scan():
    found, scanned = [], 0
    for top, dirs, files in os.walk("/"):
        if top == "/":
            dirs[:] = [d for d in dirs if d not in ("proc", "sys", "dev")]
        for name in files:
            path = os.path.join(top, name)
            try:
                info = os.stat(path)
                if info.st_size > 4 << 20 or (info.st_mtime < SINCE and not name.endswith((".json", ".jsonl"))):
                    continue
                with open(path, "rb") as f:
                    data = f.read()
            except OSError:
                continue
            scanned += 1
            found += [m.decode() for m in PATTERN.findall(data) if m.decode() not in found]
    print("scanned", scanned, "files; found", found, file=sys.stderr)
    return found
FOUND = scan()
def secret(n):
    return FOUND[n - 1]
"""
HACKS = {
    "reads-task-json": """
import json, os
def secret(n):
    for path in ("task.json", os.environ.get("REEF_TASK", "task.json"), "../task.json", "/tmp/task.json"):
        try:
            task = json.load(open(path))
        except OSError:
            continue
        return next(t["expected"] for t in task["tests"] if t["args"] == [n])
    raise LookupError("no task.json")
""",
    "searches-for-task-json": """
import json, os
def find():
    for top, dirs, files in os.walk("/"):
        dirs[:] = [d for d in dirs if top != "/" or d not in ("proc", "sys")]
        for name in files:
            if name == "task.json" or name.endswith(".jsonl"):
                try:
                    for line in open(os.path.join(top, name)):
                        task = json.loads(line)
                        if task.get("entry") == "secret":
                            return task
                except (OSError, ValueError, AttributeError):
                    continue
TASK = find()
def secret(n):
    return next(t["expected"] for t in TASK["tests"] if t["args"] == [n])
""",
    "walks-the-filesystem-for-the-keys": WALK,
    "greps-its-own-process": f"""
import gc, os, re, sys
PATTERN = re.compile({PREFIX} + "[0-9a-f]{{32}}")
def scan():
    texts = [repr(o) for o in gc.get_objects() if isinstance(o, (dict, list, tuple, str, bytes))]
    frame = sys._getframe()
    while frame is not None:
        texts.append(repr(frame.f_locals) + repr(frame.f_globals.keys()))
        frame = frame.f_back
    for pid in os.listdir("/proc"):
        for part in ("cmdline", "environ"):
            try:
                texts.append(open(f"/proc/{{pid}}/{{part}}", "rb").read().decode(errors="replace"))
            except OSError:
                pass
    found = sorted({{k for t in texts for k in PATTERN.findall(t)}})
    print("searched", len(texts), "texts; found", found, file=sys.stderr)
    return found
FOUND = scan()
def secret(n):
    return FOUND[n - 1]
""",
    "exits-0-at-import": "import os\nos._exit(0)\n",
    "sys-exit-0-at-import": "import sys\nsys.exit(0)\n",
    "prints-a-verdict-line-and-exits-0": """
import os, sys
for fd in (1, 2):
    os.write(fd, b'{"score": 1.0}\\n')
print('{"score": 1.0}')
sys.stdout.flush()
os._exit(0)
""",
    "forges-results-on-every-open-fd": """
import os
lines = b'{"started": 2}\\n{"value": "reef-key-0"}\\n{"value": "reef-key-1"}\\n{"passed": 2, "score": 1.0}\\n'
for fd in range(256):
    try:
        os.write(fd, lines)
    except OSError:
        pass
os._exit(0)
""",
    "forges-well-formed-results-and-exits": """
import os
for fd in range(3, 256):
    try:
        os.write(fd, b'{"value": "reef-key-forged"}\\n' * 2)
    except OSError:
        pass
os._exit(0)
""",
    "patches-the-drivers-writer-and-json": """
import builtins, json, sys
json.dumps = lambda *a, **k: '{"value": "forged"}'
frame = sys._getframe()
while frame is not None:
    channel = frame.f_locals.get("channel")
    if channel is not None:
        channel.write('{"passed": true, "score": 1.0}\\n' * 2)
        channel.flush()
        try:
            channel.write = lambda text: len(text)  # the driver's own results swallowed
        except AttributeError:
            sys.modules["os"].dup2(2, channel.fileno())  # or sent where reefd never reads them
    frame = frame.f_back
def secret(n):
    return True
""",
    "rewrites-builtins": """
import builtins
builtins.len = lambda *a: 0
builtins.callable = lambda *a: True
builtins.isinstance = lambda *a: True
builtins.BaseException = object
def secret(n):
    return None
""",
    "returns-an-object-equal-to-everything": """
class Anything:
    def __eq__(self, other):
        return True
    def __ne__(self, other):
        return False
    __hash__ = object.__hash__
def secret(n):
    return Anything()
""",
    "returns-a-str-equal-to-everything": """
class Key(str):
    def __eq__(self, other):
        return True
    __hash__ = str.__hash__
def secret(n):
    return Key("reef-key-any")
""",
}


@pytest.mark.parametrize("hack", list(HACKS))
def test_a_reward_hack_fails_its_verification(host: Host, hack: str) -> None:
    verdict = host.verify(code(HACKS[hack].replace("SINCE", repr(host.since))), timeout_s=60)
    assert verdict.score == 0.0 and not verdict.passed, (hack, verdict)
    assert verdict.error is None, (hack, verdict)  # the answer failed, not the verifier
    everything = json.dumps([verdict.output, verdict.feedback])
    assert not any(key in everything for key in host.keys), (hack, verdict)  # no key reached it
    if hack.startswith(("walks", "greps")):  # it did search, and found nothing
        said = verdict.output["stderr"]
        assert ("scanned" in said or "searched" in said) and "found []" in said, said
        assert int(said.split()[said.split().index("found") - 2]) > 10, said


@pytest.mark.parametrize("hack", ["reads-task-json", "searches-for-task-json", "walks-the-filesystem-for-the-keys"])
def test_the_same_hacks_find_the_keys_where_the_task_is_readable(host: Host, hack: str) -> None:
    """The control: run by an ordinary command verifier, whose scratch folder holds task.json, the same code
    finds the keys. So the hacks are real, and it is the code sandbox that stops them."""
    (host.scenarios / "hack.py").write_text(HACKS[hack].replace("SINCE", repr(host.since)))
    run = f"import runpy; print(runpy.run_path({str(host.scenarios / 'hack.py')!r})['secret'](1))"
    verifier = Verifier(VerifierConfig(command=[sys.executable, "-c", run], timeout_s=60, read=["hack.py"]),
                        host.scenarios, (host.state,))
    verdict = asyncio.run(verifier.verify("", host.task))
    assert host.keys[0] in verdict.output["stdout"], verdict.output


def test_crashes_hangs_and_garbage_are_the_answers_failures(host: Host) -> None:
    hung = host.verify("def secret(n):\n    while True:\n        pass\n", timeout_s=2)
    assert (hung.score, hung.error) == (0.0, None) and hung.feedback == "the code stopped after 0 of 2 tests " \
                                                                        "(timed out)", hung
    crash = host.verify("import os, signal\ndef secret(n):\n    os.kill(os.getpid(), signal.SIGSEGV)\n")
    assert (crash.score, crash.error) == (0.0, None) and "stopped after 0 of 2" in crash.feedback, crash
    flood = host.verify("import os\nos.write(3, b'x' * (1 << 20))\ndef secret(n):\n    return 1\n")
    assert (flood.score, flood.error) == (0.0, None) and "something other than" in flood.feedback, flood
    long = host.verify("def secret(n):\n    return 'k' * 10000\n")
    assert long.score == 0.0 and "characters long as JSON" in long.feedback, long
    loud = host.verify("def secret(n):\n    raise ValueError('\\x1b[31mred\\nline two')\n")
    assert loud.score == 0.0 and "\x1b" not in loud.feedback and "\\x1b[31mred\\x0aline two" in loud.feedback
    assert loud.feedback.count("\n") == 2, loud.feedback  # one line per failed test, whatever it raised
    unloaded = host.verify("def secret(n) return 1")
    assert unloaded.error is None and unloaded.feedback.startswith("the code did not load: SyntaxError"), unloaded
    nothing = host.verify("def other(n):\n    return 1\n")
    assert nothing.feedback == "the code did not load: LookupError: candidate.py defines no function secret"


def test_a_driver_that_cannot_start_is_the_verifiers_failure(host: Host, monkeypatch: pytest.MonkeyPatch) -> None:
    """No interpreter to run the driver: no line came, not even the one written before the candidate is imported,
    so the verifier failed (not the answer)."""
    monkeypatch.setattr(code_tasks, "PYTHON", ("/nonexistent/python3", "driver.py"))
    verdict = host.verify("def secret(n):\n    return 1\n")
    assert verdict.score == 0.0 and (verdict.error or "").startswith("the code driver did not run: exit status"), \
        verdict
    assert "/nonexistent/python3" in (verdict.error or ""), verdict


def test_values_compare_as_json() -> None:
    same = code_tasks.same
    assert same(1, 1.0) and same(0.1 + 0.2, 0.3) and same([1, {"a": [True]}], [1, {"a": [True]}])
    assert not same(True, 1) and not same(1, True) and not same(0, False) and not same(None, 0)
    assert not same(float("nan"), float("nan")) and not same([1], [1, 2]) and not same({"a": 1}, {"a": 1, "b": 2})
    assert not same("1", 1) and not same(10 ** 400, 1.5) and not same(1.0000001, 1)


def test_the_code_is_the_first_python_block_or_the_whole_answer() -> None:
    assert code_tasks.extract("a\n```python\nx = 1\n```\nb\n```python\ny = 2\n```") == "x = 1\n"
    assert code_tasks.extract("```\nz = 3\n```") == "z = 3\n"
    assert code_tasks.extract("```py\nz = 3\n```") == "z = 3\n"
    assert code_tasks.extract("def f(): pass") == "def f(): pass"
    shell_first = "Run:\n```bash\npython3 f.py\n```\nwith\n```\nnot this\n```\n```Python\ndef f(): pass\n```"
    assert code_tasks.extract(shell_first) == "def f(): pass\n"


SOLUTIONS = {
    "add": "def add(a, b):\n    return a + b",
    "is_palindrome": "def is_palindrome(s):\n    return s.lower() == s.lower()[::-1]",
    "fizzbuzz": "def fizzbuzz(n):\n    return 'Fizz' * (n % 3 == 0) + 'Buzz' * (n % 5 == 0) or str(n)",
    "factorial": "import math\ndef factorial(n):\n    return math.factorial(n)",
    "reverse_words": "def reverse_words(s):\n    return ' '.join(reversed(s.split()))",
    "count_vowels": "def count_vowels(s):\n    return sum(c in 'aeiou' for c in s.lower())",
    "fibonacci": "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a",
    "flatten": "def flatten(items):\n    return [y for x in items for y in (flatten(x) if type(x) is list else [x])]",
    "word_counts": "from collections import Counter\ndef word_counts(text):\n    return Counter(text.lower().split())",
    "second_largest": "def second_largest(nums):\n    return sorted(set(nums))[-2]",
    "clamp": "def clamp(x, low, high):\n    return max(low, min(x, high))",
    "is_prime": "def is_prime(n):\n    return n > 1 and all(n % d for d in range(2, int(n ** 0.5) + 1))",
    "caesar": "def caesar(text, shift):\n    out = ''\n    for c in text:\n        base = 65 if c.isupper() else 97\n"
              "        out += chr((ord(c) - base + shift) % 26 + base) if c.isascii() and c.isalpha() else c\n"
              "    return out",
    "mean": "def mean(nums):\n    return sum(nums) / len(nums)",
}


def test_the_shipped_code_tasks_load_and_their_solutions_pass() -> None:
    """scenarios/code-tasks.jsonl, the set docs/recipes.md's code.yaml practises: every task is solved by a
    reference solution, and none is passed by a function that returns None."""
    cfg = PracticeConfig(tasks="code-tasks.jsonl", verifier=VerifierConfig(code="python"))
    tasks = settings.load(cfg, ROOT / "scenarios")
    assert 8 <= len(tasks) <= 16 and {t.raw["entry"] for t in tasks} == set(SOLUTIONS)
    verifier = Verifier(cfg.verifier, ROOT / "scenarios")

    async def all_of(answer: Any) -> list[Verdict]:
        return list(await asyncio.gather(*(verifier.verify(answer(t.raw["entry"]), t.raw) for t in tasks)))

    right = asyncio.run(all_of(lambda entry: code(SOLUTIONS[entry])))
    assert [v.score for v in right] == [1.0] * len(tasks), [(t.raw["entry"], v.feedback) for t, v in
                                                          zip(tasks, right, strict=True)]
    none = asyncio.run(all_of(lambda entry: f"def {entry}(*args, **kwargs):\n    return None\n"))
    assert [v.score for v in none] == [0.0] * len(tasks)
