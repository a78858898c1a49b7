"""What a verifier sees (issue 44, point 1): a root of its own with the system's libraries and interpreters, its
own program, its scratch folder and what the scenario lists; nothing of the host's besides, as user nobody. Each
read below is tried for real from inside the bubblewrap sandbox, by a verifier a scenario could configure."""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from reefd.grow.practice.sandbox import NOBODY
from reefd.grow.practice.verifiers import ROOT, Verdict, Verifier, VerifierConfig, VerifierError


def verify(command: str, scenarios: Path, hide: tuple[Path, ...] = (), **cfg: Any) -> Verdict:
    return asyncio.run(Verifier(VerifierConfig(command=command, **cfg), scenarios, hide).verify("5", {"answer": 5}))


@pytest.fixture
def host() -> Iterator[Path]:
    """A folder outside /tmp (which the sandbox replaces with its own) holding what reefd's host has: a tokens
    file kept outside the state folder, systemd credentials, and the scenarios folder with reefd's state in it."""
    root = Path(tempfile.mkdtemp(dir="/var/tmp"))
    try:
        (root / "tokens.json").write_text('{"reef-secret-token": "root"}')
        (root / "creds").mkdir()
        (root / "creds" / "ray-token").write_text("ray-secret")
        (root / "scenarios" / "state").mkdir(parents=True)
        (root / "scenarios" / "state" / "token").write_text("reef-secret-state")
        (root / "scenarios" / "assist.yaml").write_text("model: tiny  # reef-secret-scenario\n")
        (root / "scenarios" / "listed.txt").write_text("listed and seen\n")
        yield root
    finally:
        shutil.rmtree(root)


def test_it_runs_as_nobody_with_no_capabilities(tmp_path: Path) -> None:
    verdict = verify("id -u; id -g; id -G; grep -E '^Cap(Prm|Eff|Bnd|Amb)' /proc/self/status; exit 1", tmp_path)
    out = verdict.output["stdout"].split("\n")
    assert out[:3] == [str(NOBODY)] * 3, verdict.output  # even though reefd (this test) runs as root here
    assert all(line.split()[1] == "0" * 16 for line in out[3:7]), verdict.output


def test_each_read_of_the_hosts_files_fails(host: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """/root and /home, /etc's secrets, reefd's state, the scenarios folder beyond what `read` lists, a tokens
    file outside the state folder, systemd's credentials, the project's checkout, /sys: each cat or ls fails,
    and the one listed file is read."""
    monkeypatch.setenv("CREDENTIALS_DIRECTORY", str(host / "creds"))
    scenarios = host / "scenarios"
    tries = {
        "home": "ls -A /home", "shadow": "cat /etc/shadow", "passwd": "cat /etc/passwd",
        "state": f"cat {scenarios}/state/token", "scenario": f"cat {scenarios}/assist.yaml",
        "tokens": f"cat {host}/tokens.json", "credentials": f"cat {host}/creds/ray-token",
        "checkout": f"cat {ROOT}/README.md {ROOT}/pyproject.toml; ls {ROOT}/tests", "sys": "ls /sys/class",
    }
    script = "".join(f"echo '== {name}'; {cmd} 2>&1\n" for name, cmd in tries.items())
    script += f"echo '== listed'; cat {scenarios}/listed.txt\necho '== root'; find /root -maxdepth 4\nexit 1\n"
    verdict = verify(script, scenarios, hide=(scenarios / "state",), read=["listed.txt"])
    said = dict(part.split("\n", 1) for part in verdict.output["stdout"].split("== ")[1:])
    assert verdict.error is None and set(said) == {*tries, "listed", "root"}, verdict.output
    for name in tries:
        assert "No such file" in said[name] or "Permission denied" in said[name], (name, said[name])
    assert "secret" not in verdict.output["stdout"] + verdict.output["stderr"]
    assert said["listed"] == "listed and seen\n"
    interpreter = [Path(sys.base_prefix), *Path(sys.base_prefix).parents]  # /root holds at most Python's prefix
    assert all(Path(p) in interpreter or Path(p).is_relative_to(sys.base_prefix)
               for p in said["root"].split()), said["root"]


def test_reefds_state_stays_hidden_inside_a_listed_folder(host: Path) -> None:
    scenarios = host / "scenarios"
    verdict = verify(f"cat {scenarios}/listed.txt; ls -A {scenarios}/state; cat {scenarios}/state/token; exit 1",
                     scenarios, hide=(scenarios / "state",), read=["."])
    assert verdict.output["stdout"] == "listed and seen\n", verdict.output
    assert "No such file" in verdict.output["stderr"]
    with pytest.raises(VerifierError, match=r"read\[0\]: 'state/token' is in reefd's state folder"):
        Verifier(VerifierConfig(command="true", read=["state/token"]), scenarios, (scenarios / "state",))
    with pytest.raises(VerifierError, match=r"read\[1\]: 'nope' is not a file or folder"):
        Verifier(VerifierConfig(command="true", read=["listed.txt", "nope"]), scenarios)


def test_no_other_process_and_no_environment_beyond_its_own(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    monkeypatch.setenv("REEF_TOKEN", "reef-root-secret")
    verdict = verify("ls /proc | grep -c '^[0-9]'; for p in /proc/[0-9]*; do head -c 24 $p/cmdline | tr '\\0' ' ';"
                     " echo; done | tr '\\n' '|'; echo; env; exit 1", tmp_path)
    count, cmdlines, *env = verdict.output["stdout"].split("\n")
    assert 1 <= int(count) <= 6, verdict.output  # bwrap's init, the shell and its pipeline: no pytest, no reefd
    assert "pytest" not in cmdlines and str(os.getpid()) not in count, cmdlines
    names = {line.split("=", 1)[0] for line in env if "=" in line}
    assert names <= {"PATH", "HOME", "TMPDIR", "PWD", "SHLVL", "REEF_SCENARIOS", "REEF_ANSWER", "REEF_TASK",
                     "PYTHONPATH", "PYTHONDONTWRITEBYTECODE", "_"}, names


def test_its_own_program_and_interpreters_are_there(tmp_path: Path) -> None:
    """What it needs is seen: the system's programs (/bin through merged /usr), Python with reefd's package
    (what runs a function verifier), and nothing else of the checkout."""
    verdict = verify(f"awk 'BEGIN {{ print 2 + 3 }}'; {sys.executable} -c 'import reefd.grow.practice.checks; "
                     "print(\"ok\")'; ls " + str(ROOT), tmp_path)
    assert verdict.passed and verdict.output["stdout"].split() == ["5", "ok", "reefd"], verdict.output
