"""Practice verifiers in their sandbox (reefd/grow/practice): each harm a verifier might do, tried for real in a
bubblewrap sandbox, gives a failed verification with its reason and leaves nothing behind; right, wrong and
partial answers are told apart; function verifiers run in the same sandbox."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import pytest

from reefd.grow.practice import sandbox
from reefd.grow.practice.verifiers import Verdict, Verifier, VerifierConfig, VerifierError

TASK = {"prompt": "What is 2 + 3?", "answer": "5"}
CHECK = 'test "$(cat answer.txt)" = "$(python3 -c "import json; print(json.load(open(\'task.json\'))[\'answer\'])")"'


def verify(command: Any = None, answer: str = "5", task: dict[str, Any] | None = None, *, scenarios: Path,
           hide: tuple[Path, ...] = (), **limits: Any) -> Verdict:
    cfg = VerifierConfig(command=command, function=limits.pop("function", None), **limits)
    return asyncio.run(Verifier(cfg, scenarios, hide).verify(answer, task or TASK))


def test_right_wrong_and_partial_answers(tmp_path: Path) -> None:
    right = verify(CHECK, "5", scenarios=tmp_path)
    assert right.passed and right.score == 1.0 and right.error is None
    wrong = verify(CHECK, "6", scenarios=tmp_path)
    assert not wrong.passed and wrong.score == 0.0 and wrong.error is None  # a judgement, not a failure
    assert verify(["sh", "-c", 'read a; [ "$a" = 5 ]'], "5", scenarios=tmp_path).passed  # the answer on stdin too
    partial = verify('echo checking; echo \'{"score": 0.25}\'', scenarios=tmp_path)
    assert partial.score == 0.25 and partial.error is None
    assert partial.output["stdout"].startswith("checking")
    assert partial.feedback == "checking"  # what it said besides its verdict: the report's feedback
    said = verify('echo "expected 5, got $(cat answer.txt)"; exit 1', "6", scenarios=tmp_path)
    assert not said.passed and said.feedback == "expected 5, got 6" and right.feedback == ""
    assert verify("echo oops; exit 7", scenarios=tmp_path).feedback == ""  # a failed verifier is no feedback


def test_a_verdict_line_after_a_flood_of_output_still_gives_the_score(tmp_path: Path) -> None:
    """The probe's P4: 70,000 bytes, then {"score": 0.5}. The last 64 KiB are kept, so the verdict line is read
    (it was lost, and the exit status 0 counted as a full pass); the output says what was dropped."""
    flood = verify("head -c 70000 /dev/zero | tr '\\0' x; echo; echo '{\"score\": 0.5}'", scenarios=tmp_path)
    assert flood.error is None and flood.score == 0.5, flood.output
    assert flood.output["stdout"].endswith('{"score": 0.5}\n')
    binary = verify("head -c 200000 /dev/urandom; echo; exit 1", scenarios=tmp_path)
    assert binary.error is None and binary.score == 0.0  # a wrong answer, however much it printed


def test_control_characters_and_terminal_escapes_are_stored_as_data(tmp_path: Path) -> None:
    """The probe's P6: what a verifier prints reaches feedback, metadata, status and the log; escapes and other
    control characters are written as \\xNN there (tabs and newlines kept), never stored raw."""
    loud = "printf 'a\\033[31mred\\033[0m\\r\\a\\tb\\n'; printf '\\033]0;title\\007' >&2; exit 1"
    wrong = verify(loud, scenarios=tmp_path)
    assert wrong.error is None and wrong.feedback == "a\\x1b[31mred\\x1b[0m\\x0d\\x07\tb", wrong.feedback
    assert "\x1b" not in json.dumps(wrong.output, ensure_ascii=False) and "\\x1b]0;title\\x07" in \
        wrong.output["stderr"]
    failed = verify("printf 'x\\033[2J'; exit 3", scenarios=tmp_path)
    assert failed.error == "exit status 3" and "\x1b" not in failed.output["stdout"]


def test_a_relative_state_folder_is_hidden_and_the_answer_judged(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The probe's P5: reefd started with a relative --state hides a relative folder; bwrap could not mount it,
    and every answer was judged wrong. Now the verdict is the verifier's, and the folder is still hidden."""
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "token").write_text("secret\n")
    monkeypatch.chdir(tmp_path)
    seen = verify(f"cat {tmp_path}/state/token; [ ! -e {tmp_path}/state/token ]", scenarios=tmp_path,
                  hide=(Path("state"),))
    assert seen.error is None and seen.passed and "secret" not in seen.output["stdout"], seen.output


def test_a_verifier_that_never_reads_its_stdin(tmp_path: Path) -> None:
    """It exits before the answer is written to it (a megabyte, past any pipe's buffer): still a verdict, on
    asyncio's loop and on uvloop, reefd's (which says so with another exception)."""
    import uvloop

    assert verify("exit 0", "x" * (1 << 20), scenarios=tmp_path).passed

    async def late() -> None:  # the answer is written only after the command is gone, as on a busy loop
        proc = await asyncio.create_subprocess_exec("true", stdin=asyncio.subprocess.PIPE)
        await proc.wait()
        await asyncio.sleep(0.1)
        assert proc.stdin is not None
        await sandbox._feed(proc.stdin, b"x" * (1 << 20))

    asyncio.run(late())
    uvloop.run(late())


def test_a_script_in_the_scenarios_folder(tmp_path: Path) -> None:
    (tmp_path / "check_sum.py").write_text(
        "import json, sys\ntask = json.load(open('task.json'))\n"
        "sys.exit(0 if sys.stdin.read().strip() == task['answer'] else 1)\n")
    (tmp_path / "notes.txt").write_text("not listed\n")
    command = 'python3 "$REEF_SCENARIOS/check_sum.py"'
    assert verify(command, "5", scenarios=tmp_path, read=["check_sum.py"]).passed
    assert verify(command, "five", scenarios=tmp_path, read=["check_sum.py"]).score == 0.0
    unlisted = verify(command, "5", scenarios=tmp_path)  # the scenarios folder is seen only where `read` lists
    assert unlisted.error == "exit status 2" and "check_sum.py" in unlisted.output["stderr"], unlisted.output
    other = verify(f'cat "{tmp_path}/notes.txt"', scenarios=tmp_path, read=["check_sum.py"])
    assert "No such file" in other.output["stderr"] and "not listed" not in other.output["stdout"], other.output


@pytest.mark.parametrize(("command", "error"), [
    ("exit 2", "exit status 2"),
    ("kill -9 $$", "killed by signal 9"),
    ("echo '{\"score\": \"high\"}'", "a verdict line"),
    ("echo '{\"score\": 7}'", "a verdict line"),
    ("echo '{not json'", "a verdict line"),
    # garbage (binary, past the output limit): judged by its exit status. Not /dev/urandom: its last line starts
    # with "{" one time in 256, which makes it a (malformed) verdict line
    ("head -c 300000 /dev/zero | tr '\\000' '\\377'", None),
])
def test_crashes_and_garbage_are_failed_verifications(tmp_path: Path, command: str, error: str | None) -> None:
    verdict = verify(command, scenarios=tmp_path)
    if error is None:
        assert verdict.error is None and len(verdict.output["stdout"]) <= 2000
    else:
        assert verdict.score == 0.0 and not verdict.passed and error in (verdict.error or "")


def test_a_hang_is_killed_at_the_time_limit_with_everything_it_started(tmp_path: Path) -> None:
    marker = f"sleep {600 + os.getpid() % 1000}.25"
    verdict = verify(f"{marker} & {marker}", scenarios=tmp_path, timeout_s=1.0)
    assert verdict.error == "timed out" and verdict.output["returncode"] is None
    assert marker not in subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout


def test_a_fork_bomb_harms_nothing(tmp_path: Path) -> None:
    verdict = verify("bomb() { bomb | bomb & }; bomb; sleep 60", scenarios=tmp_path, timeout_s=3.0, processes=32)
    assert verdict.error == "timed out" and "Cannot fork" in verdict.output["stderr"]  # held at 32, then killed
    assert subprocess.run(["true"]).returncode == 0  # this host still forks
    survivors = subprocess.run(["pgrep", "-f", "bomb [|] bomb"], capture_output=True, text=True).stdout.split()
    assert survivors == []


def test_memory_past_the_limit_fails(tmp_path: Path) -> None:
    verdict = verify(["python3", "-c", "x = bytearray(512 << 20)"], scenarios=tmp_path, memory_mb=128)
    assert verdict.error == "exit status 1" or "MemoryError" in verdict.output["stderr"]
    assert not verdict.passed


def test_what_it_writes_is_bounded_everywhere_it_may_write(tmp_path: Path) -> None:
    """Its scratch folder, /tmp and /dev/shm each hold at most disk_mb (tmpfs in memory, none on the host's
    disk); past it a write fails with ENOSPC; the inputs it was given, and /dev, stay read-only."""
    script = ("for d in . /tmp /dev/shm; do head -c 40000000 /dev/zero > $d/fill 2>/dev/null; "
              "echo $d $(stat -c %s $d/fill); done; echo 6 > answer.txt 2>/dev/null || echo read-only; "
              "echo x > /dev/probe 2>/dev/null || echo no /dev")
    verdict = verify(script, scenarios=tmp_path, disk_mb=16)
    out = verdict.output["stdout"].splitlines()
    assert out[:3] == [f"{d} {16 << 20}" for d in (".", "/tmp", "/dev/shm")], verdict.output
    assert out[3:] == ["read-only", "no /dev"], verdict.output
    assert verify(CHECK, "5", scenarios=tmp_path, disk_mb=16).passed  # small writes and reads go on


def test_writes_outside_its_folder_reach_nothing() -> None:
    outside = Path(tempfile.mkdtemp(dir="/var/tmp"))  # not under /tmp, which the sandbox replaces with its own
    try:
        state = outside / "state"
        state.mkdir()
        (state / "tokens").write_text("secret")
        (outside / "visible").write_text("seen\n")
        verdict = verify(f"cat {outside}/visible; echo x > {outside}/f; echo x > {state}/tokens; cat {state}/tokens; "
                         "echo x > /tmp/reef-escape; echo mine > mine; cat mine", scenarios=outside, hide=(state,))
        out = verdict.output["stdout"].split()
        assert out == ["mine"], verdict.output  # nothing of the host's is seen, reefd's state least of all
        assert sorted(p.name for p in outside.iterdir()) == ["state", "visible"]
        assert (state / "tokens").read_text() == "secret" and not Path("/tmp/reef-escape").exists()
    finally:
        shutil.rmtree(outside)


def test_no_environment_of_reefds_is_readable_inside(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """bubblewrap's init is PID 1 inside, and /proc/1/environ shows the environment bwrap started with: never
    reefd's (its root token, upstream keys), whatever the command itself is given. Under root the verifier, as
    nobody, cannot read PID 1's at all; under another user it reads PATH alone there."""
    monkeypatch.setenv("REEF_TOKEN", "reef-root-secret")
    monkeypatch.setenv("UPSTREAM_API_KEY", "upstream-secret")
    dump = ("ls -d /proc/1 && tr '\\0' '\\n' < /proc/1/environ | grep -c ^PATH= && "
            "for f in /proc/[0-9]*/environ; do tr '\\0' '\\n' < \"$f\"; done | grep -e secret -e KEY -e TOKEN; "
            "env | grep -e secret -e KEY -e TOKEN; exit 1")
    verdict = verify(dump, scenarios=tmp_path)
    seen = verdict.output["stdout"]
    denied = "/proc/1/environ: Permission denied" in verdict.output["stderr"]
    assert verdict.error is None and seen.startswith("/proc/1\n0\n" if denied else "/proc/1\n1\n"), verdict.output
    assert denied == (os.geteuid() == 0), verdict.output
    assert "secret" not in seen and "REEF_TOKEN" not in seen and "UPSTREAM_API_KEY" not in seen, seen


def test_no_network_not_even_loopback(tmp_path: Path) -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        verdict = verify(["python3", "-c", f"import socket; socket.create_connection(('127.0.0.1', {port}), 2)"],
                         scenarios=tmp_path)
        server.setblocking(False)
        with pytest.raises(BlockingIOError):
            server.accept()  # nobody connected
    assert verdict.output["returncode"] == 1 and "ConnectionRefusedError" in verdict.output["stderr"]  # its own lo


CHECKS = """
def check_add(answer, task):
    return answer.strip() == task["answer"]


def half(answer, task):
    return 0.5


def raises(answer, task):
    raise RuntimeError("the checker itself broke")


def nonsense(answer, task):
    return "yes"
"""


def test_function_verifiers_run_in_the_sandbox(tmp_path: Path) -> None:
    (tmp_path / "checks_here").mkdir()
    (tmp_path / "checks_here" / "__init__.py").write_text(CHECKS)  # a package beside the scenarios
    me = "checks_here"
    assert verify(function=f"{me}:check_add", answer="5", scenarios=tmp_path).passed
    assert verify(function=f"{me}:check_add", answer="4", scenarios=tmp_path).score == 0.0
    assert verify(function=f"{me}:half", scenarios=tmp_path).score == 0.5
    broke = verify(function=f"{me}:raises", scenarios=tmp_path)
    assert broke.error == "exit status 3" and "the checker itself broke" in broke.output["stderr"]
    assert verify(function=f"{me}:nonsense", scenarios=tmp_path).error == "exit status 3"
    assert verify(function="no_such_module:fn", scenarios=tmp_path).error == "exit status 3"
    (tmp_path / "my_checks.py").write_text("def even(answer, task):\n    return int(answer) % 2 == 0\n")
    assert verify(function="my_checks:even", answer="4", scenarios=tmp_path).passed  # beside the scenarios
    shipped = "reefd.grow.practice.checks:first_number"
    assert verify(function=shipped, answer="It is 7.0, I think 8", task={"answer": "7"}, scenarios=tmp_path).passed
    assert verify(function=shipped, answer="8", task={"answer": 7}, scenarios=tmp_path).score == 0.0
    assert verify(function=shipped, answer="none", task={"answer": "7"}, scenarios=tmp_path).score == 0.0
    last = "reefd.grow.practice.checks:last_number"
    assert verify(function=last, answer="3 + 4 = 7", task={"answer": 7}, scenarios=tmp_path).passed
    assert verify(function=last, answer="3 + 4 = 8", task={"answer": 7}, scenarios=tmp_path).score == 0.0


def test_verifiers_run_side_by_side_without_waiting_on_each_other(tmp_path: Path) -> None:
    verifier = Verifier(VerifierConfig(command="sleep 30", timeout_s=1.0), tmp_path)
    quick = Verifier(VerifierConfig(command=CHECK), tmp_path)

    async def both() -> list[Verdict]:
        return list(await asyncio.gather(verifier.verify("5", TASK), quick.verify("5", TASK)))

    hung, fine = asyncio.run(both())
    assert hung.error == "timed out" and fine.passed


@pytest.mark.parametrize(("cfg", "message"), [
    ({}, "exactly one of command, function and code"),
    ({"command": "true", "function": "a:b"}, "exactly one"),
    ({"command": "true", "code": "python"}, "exactly one"),
    ({"code": "python", "read": ["."]}, "a code verifier's sandbox holds the answer's code alone"),
    ({"code": "ruby"}, "practice.verifier.code: 'ruby' is not one of python"),
    ({"command": ""}, "non-empty string or list"),
    ({"command": ["sh", 3]}, "non-empty string or list"),
    ({"function": "not dotted"}, "is not pkg.mod:fn"),
])
def test_bad_configs_are_refused_in_one_line(tmp_path: Path, cfg: dict[str, Any], message: str) -> None:
    with pytest.raises(VerifierError, match=message) as exc:
        Verifier(VerifierConfig(**cfg), tmp_path)
    assert "\n" not in str(exc.value)


def test_the_sandbox_says_when_it_cannot_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sandbox.check()  # it runs on this host (make installs bubblewrap)
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(sandbox.SandboxUnavailable, match="apt-get install bubblewrap"):
        sandbox.check()


def test_a_sandbox_that_does_not_start_is_the_verifiers_failure(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """bwrap refusing its set-up (here a stand-in that exits 1 as bwrap does, before any child): never a judgement
    of the answer, though the status is the one a wrong answer has."""
    broken = tmp_path / "bwrap"
    broken.write_text("#!/bin/sh\necho 'bwrap: Creating new namespace failed: Operation not permitted' >&2\nexit 1\n")
    broken.chmod(0o755)
    monkeypatch.setattr(sandbox, "bwrap", lambda: str(broken))
    verdict = verify(CHECK, "5", scenarios=tmp_path)
    assert verdict.score == 0.0 and verdict.output["returncode"] is None
    assert verdict.error is not None and verdict.error.startswith("the sandbox did not start: bwrap: Creating")
