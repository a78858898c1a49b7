"""reefctl alone, against canned admin-API answers: flags, formats, paging, errors.

The server is a real HTTP server on a free loopback port that serves the admin API's documented
shapes and records what it was sent, so each case can pin exact inputs; tests/e2e/test_reefctl.py
drives reefctl against the real daemon.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import IO, Any
from urllib.parse import parse_qsl, unquote, urlsplit

import pytest

from reefd.cli import main

REPO = Path(__file__).resolve().parents[1]
CONNECTION_ENV = ("REEF_URL", "REEF_TOKEN", "REEF_STATE", "STATE_DIRECTORY")
PROXY_ENV = ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY")

STATUS = {
    "version": "0.1.0", "uptime_s": 3725.0, "ready": True,
    "scenarios": [
        {"name": "hello", "model": "smollm2", "release": "base", "records": 3, "reports": 1,
         "engine": {"kind": "worker", "state": "ready", "url": "http://127.0.0.1:41234", "restarts": 0,
                    "pid": 123}},
        {"name": "coder", "model": "tiny-llama", "release": "r-0002", "records": 0, "reports": 0,
         "engine": {"kind": "upstream", "state": "starting", "url": None, "restarts": 2, "pid": None}},
    ],
}


def openai_record(receipt: str, text: str | None, created_at: float, **extra: Any) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": text}
    message.update(extra.pop("message", {}))
    record = {
        "id": receipt, "scenario": "hello", "release": "base", "engine": "worker",
        "api": "openai.chat_completions", "created_at": created_at, "session": None, "tags": {},
        "request": {"model": "hello", "messages": [{"role": "user", "content": "hi"}]},
        "response": {"object": "chat.completion", "choices": [{"index": 0, "message": message,
                                                                "finish_reason": "stop"}]},
        "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": text}],
        "prompt_token_ids": [1, 2, 3], "completion_token_ids": [4, 5], "completion_logprobs": [-0.1, -0.2],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2}, "latency_s": 0.25, "finish_reason": "stop",
        "reports": [],
    }
    record.update(extra)
    return record


def anthropic_record(receipt: str, blocks: list[dict[str, Any]], created_at: float,
                     reports: list[dict[str, Any]]) -> dict[str, Any]:
    record = openai_record(receipt, None, created_at, reports=reports, api="anthropic.messages", session="s-1")
    record["response"] = {"type": "message", "role": "assistant", "content": blocks, "stop_reason": "end_turn"}
    record["usage"] = {"prompt_tokens": 10, "completion_tokens": 7}
    return record


def report(score: float | None, created_at: float, feedback: str | None = None) -> dict[str, Any]:
    return {"object": "reef.report", "report_id": f"rep-{created_at:g}", "scenario": "hello", "references": [],
            "score": score, "feedback": feedback, "metadata": {}, "created_at": created_at}


def sample_records() -> list[dict[str, Any]]:
    return [
        openai_record("01HZY0000000000000000000A1", "Hello there!\nHow can I help?", 1_700_000_000.0),
        anthropic_record(
            "01HZY0000000000000000000A2",
            [{"type": "text", "text": "Bonjour, "}, {"type": "tool_use", "id": "t", "name": "x", "input": {}},
             {"type": "text", "text": "le monde"}],
            1_700_000_060.0,
            reports=[report(0.5, 1.0), report(1.0, 3.0), report(None, 4.0, "nice")],
        ),
        openai_record("01HZY0000000000000000000A3", "word " * 40, 1_700_000_120.0),
    ]


@dataclass
class Seen:
    method: str
    path: str
    query: dict[str, str]
    headers: dict[str, str]  # lower-cased names
    body: Any


class FakeReef(ThreadingHTTPServer):
    """Serves GET /reef/status, GET /reef/records/{id}, GET /reef/scenarios/{name}/records, POST /reef/report."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.records = sample_records()
        self.seen: list[Seen] = []
        self.page_size = 2  # the server's default page, so three records take two pages
        self.error_shape = "openai"
        self.lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def listing(self) -> list[Seen]:
        return [s for s in self.seen if s.path.endswith("/records") and s.path.startswith("/reef/scenarios/")]

    def error(self, status: int, kind: str, message: str) -> tuple[int, Any]:
        if self.error_shape == "text":  # a body that is not JSON, as from a proxy in front of reefd
            return status, message.encode()
        if self.error_shape == "anthropic":
            return status, {"type": "error", "error": {"type": kind, "message": message}}
        return status, {"error": {"message": message, "type": kind, "param": None, "code": None}}

    def answer(self, req: Seen) -> tuple[int, Any]:
        parts = [unquote(p) for p in req.path.strip("/").split("/")]
        with self.lock:
            records = list(self.records)
        if req.method == "GET" and parts == ["reef", "status"]:
            return 200, STATUS
        if req.method == "GET" and parts[:2] == ["reef", "records"] and len(parts) == 3:
            found = [r for r in records if r["id"] == parts[2]]
            return (200, found[0]) if found else self.error(404, "not_found_error", f"no record {parts[2]!r}")
        if req.method == "GET" and parts[:2] == ["reef", "scenarios"] and parts[3:] == ["records"]:
            if parts[2] != "hello":
                return self.error(404, "not_found_error", f"unknown scenario {parts[2]!r}")
            ids = [r["id"] for r in records]
            start = ids.index(req.query["after"]) + 1 if "after" in req.query else 0
            data = records[start:start + int(req.query.get("limit", self.page_size))]
            return 200, {"object": "list", "data": data, "has_more": start + len(data) < len(records),
                         "last_id": data[-1]["id"] if data else None}
        if req.method == "POST" and parts == ["reef", "report"]:
            body = req.body
            return 200, {"object": "reef.report", "report_id": body.get("report_id", "rep-new"),
                         "scenario": req.headers.get("x-reef-scenario"), "references": body["references"],
                         "score": body.get("score"), "feedback": body.get("feedback"),
                         "metadata": body.get("metadata", {}), "created_at": 1_700_000_500.0}
        return self.error(404, "not_found_error", f"no route {req.method} {req.path}")


class _Handler(BaseHTTPRequestHandler):
    server: FakeReef

    def log_message(self, format: str, *args: Any) -> None:  # keep pytest output clean
        pass

    def do_GET(self) -> None:
        self._serve()

    def do_POST(self) -> None:
        self._serve()

    def _serve(self) -> None:
        url = urlsplit(self.path)
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length)) if length else None
        seen = Seen(self.command, url.path, dict(parse_qsl(url.query)),
                    {k.lower(): v for k, v in self.headers.items()}, body)
        self.server.seen.append(seen)
        status, payload = self.server.answer(seen)
        data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def reef() -> Iterator[FakeReef]:
    server = FakeReef()
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    thread.join()
    server.server_close()


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No connection settings leak in from the developer's shell, and HOME holds no token file."""
    for name in CONNECTION_ENV + PROXY_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))


def dead_url() -> str:
    """A loopback URL that nothing listens on (the port was free a moment ago)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def child_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in CONNECTION_ENV + PROXY_ENV}
    return {**env, "PYTHONPATH": str(REPO), **extra}


def run_reefctl(*argv: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "reefd.cli", *argv], capture_output=True, text=True,
                          env=child_env(**env), cwd=REPO, timeout=60, check=False)


# --- connection settings -------------------------------------------------------------------------


def write_token(directory: Path, token: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "token").write_text(token + "\n")
    return directory


@pytest.mark.parametrize(
    ("argv", "env", "expected"),
    [
        (["--token", "from-flag", "status"], {"REEF_TOKEN": "from-env"}, "from-flag"),
        (["status", "--token", "from-flag"], {"REEF_TOKEN": "from-env"}, "from-flag"),
        (["status"], {"REEF_TOKEN": "env-new,env-old"}, "env-new"),
        (["status"], {"REEF_STATE": "reef-state"}, "reef-state-token"),
        (["status"], {"STATE_DIRECTORY": "systemd-state"}, "systemd-state-token"),
        (["status"], {}, "home-token"),
    ],
    ids=["flag-before-verb", "flag-after-verb", "env-first-of-rotation", "REEF_STATE", "STATE_DIRECTORY", "home"],
)
def test_token_precedence(reef: FakeReef, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
                          tmp_path: Path, argv: list[str], env: dict[str, str], expected: str) -> None:
    write_token(tmp_path / "home/.local/state/reefd", "home-token")
    write_token(tmp_path / "reef-state", "reef-state-token")
    write_token(tmp_path / "systemd-state", "systemd-state-token")
    for name, value in env.items():
        monkeypatch.setenv(name, str(tmp_path / value) if name.endswith(("STATE", "DIRECTORY")) else value)
    code, _, _ = cli(capsys, "--url", reef.url, *argv)
    assert code == 0
    assert reef.seen[-1].headers["authorization"] == f"Bearer {expected}"


def test_no_token_anywhere_sends_no_authorization(reef: FakeReef, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(capsys, "status", "--url", reef.url)[0] == 0
    assert "authorization" not in reef.seen[-1].headers


def test_url_flag_overrides_env(reef: FakeReef, capsys: pytest.CaptureFixture[str],
                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REEF_URL", dead_url())
    assert cli(capsys, "status", "--url", reef.url + "/")[0] == 0
    monkeypatch.setenv("REEF_URL", reef.url)
    assert cli(capsys, "status")[0] == 0
    assert len(reef.seen) == 2


# --- status --------------------------------------------------------------------------------------


def test_status_table(reef: FakeReef, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = cli(capsys, "--url", reef.url, "status")
    assert code == 0
    header, hello, coder = (line.split() for line in out.splitlines())
    assert header == ["SCENARIO", "MODEL", "ENGINE", "STATE", "RELEASE", "RECORDS", "REPORTS"]
    assert hello == ["hello", "smollm2", "worker", "ready", "base", "3", "1"]
    assert coder == ["coder", "tiny-llama", "upstream", "starting", "r-0002", "0", "0"]
    assert out.splitlines()[0].index("MODEL") == out.splitlines()[1].index("smollm2")  # columns line up
    assert "reefd 0.1.0" in err and "up 1h2m" in err and "ready" in err


def test_status_wide(reef: FakeReef, capsys: pytest.CaptureFixture[str]) -> None:
    _, out, _ = cli(capsys, "--url", reef.url, "status", "-o", "wide")
    rows = [line.split() for line in out.splitlines()]
    assert rows[0][-3:] == ["URL", "RESTARTS", "PID"]
    assert rows[1][-3:] == ["http://127.0.0.1:41234", "0", "123"]
    assert rows[2][-3:] == ["-", "2", "-"]


def test_status_json_in_a_real_process(reef: FakeReef) -> None:
    proc = run_reefctl("status", "-o", "json", REEF_URL=reef.url, REEF_TOKEN="t0k")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == STATUS
    assert proc.stderr == ""
    assert reef.seen[-1].headers["authorization"] == "Bearer t0k"


# --- records -------------------------------------------------------------------------------------


def test_records_json_lines_page_through_everything(reef: FakeReef, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = cli(capsys, "--url", reef.url, "records", "hello", "-o", "json")
    assert code == 0
    assert [json.loads(line) for line in out.splitlines()] == reef.records
    assert [s.query for s in reef.listing()] == [{}, {"after": "01HZY0000000000000000000A2"}]


def test_records_table(reef: FakeReef, capsys: pytest.CaptureFixture[str]) -> None:
    _, out, _ = cli(capsys, "--url", reef.url, "records", "hello")
    header, first, second, third = out.splitlines()
    assert header.split() == ["RECEIPT", "CREATED", "API", "TOKENS", "SCORE", "COMPLETION"]
    assert first.split()[:5] == ["01HZY0000000000000000000A1", "2023-11-14T22:13:20Z",
                                 "openai.chat_completions", "3+2", "-"]
    assert first.endswith("Hello there! How can I help?")
    assert second.split()[2:5] == ["anthropic.messages", "10+7", "1"]  # latest scored report wins
    assert second.endswith("Bonjour, le monde")
    assert third.endswith("...") and len(third) - third.index("word") == 60
    assert header.index("COMPLETION") == first.index("Hello")


def test_records_limit_is_one_page(reef: FakeReef, capsys: pytest.CaptureFixture[str]) -> None:
    _, out, _ = cli(capsys, "--url", reef.url, "records", "hello", "--limit", "1", "--after",
                    "record/01HZY0000000000000000000A1", "-o", "name")
    assert out == "record/01HZY0000000000000000000A2\n"
    assert [s.query for s in reef.listing()] == [{"after": "01HZY0000000000000000000A1", "limit": "1"}]


def test_records_empty_says_so_on_stderr(reef: FakeReef, capsys: pytest.CaptureFixture[str]) -> None:
    reef.records = []
    code, out, err = cli(capsys, "--url", reef.url, "records", "hello")
    assert (code, out) == (0, "")
    assert "No records" in err


def pump(stream: IO[str], lines: queue.Queue[str]) -> None:
    for line in stream:
        lines.put(line)


def test_follow_prints_records_as_they_arrive(reef: FakeReef) -> None:
    # Through -c rather than -m so SIGINT raises KeyboardInterrupt even if this test runs with SIGINT ignored.
    code = "import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); " \
           "from reefd.cli import main; sys.exit(main(sys.argv[1:]))"
    argv = ["--url", reef.url, "records", "hello", "-o", "json", "--follow", "--interval", "0.05"]
    with subprocess.Popen([sys.executable, "-c", code, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, env=child_env(), cwd=REPO) as proc:
        assert proc.stdout is not None and proc.stderr is not None
        lines: queue.Queue[str] = queue.Queue()
        reader = threading.Thread(target=pump, args=(proc.stdout, lines), daemon=True)
        reader.start()
        try:
            initial = [json.loads(lines.get(timeout=30))["id"] for _ in range(3)]
            assert initial == [r["id"] for r in reef.records]
            new = openai_record("01HZY0000000000000000000B1", "a late answer", 1_700_000_200.0)
            with reef.lock:
                reef.records.append(new)
            assert json.loads(lines.get(timeout=30)) == new
            proc.send_signal(signal.SIGINT)
            assert proc.wait(timeout=30) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
        reader.join(timeout=30)
        assert "Traceback" not in proc.stderr.read()
    assert lines.empty()  # nothing printed twice
    polls = {s.query.get("after") for s in reef.listing()[2:]}  # after the two pages of the initial listing
    assert polls <= {"01HZY0000000000000000000A3", "01HZY0000000000000000000B1"}


# --- get and report ------------------------------------------------------------------------------


def test_get_record_prints_indented_json(reef: FakeReef, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = cli(capsys, "--url", reef.url, "get", "record", "01HZY0000000000000000000A2")
    assert code == 0
    assert json.loads(out) == reef.records[1]
    assert out.startswith("{\n  ")


def test_report_looks_up_the_scenario(reef: FakeReef, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = cli(capsys, "--url", reef.url, "report", "01HZY0000000000000000000A1",
                       "01HZY0000000000000000000A2", "--score", "0.75", "--feedback", "good",
                       "--metadata", '{"by": "test"}', "--report-id", "rep-7")
    assert (code, out) == (0, "report/rep-7 created\n")
    lookup, post = reef.seen
    assert (lookup.method, lookup.path) == ("GET", "/reef/records/01HZY0000000000000000000A1")
    assert (post.method, post.path, post.headers["x-reef-scenario"]) == ("POST", "/reef/report", "hello")
    assert post.body == {"references": ["01HZY0000000000000000000A1", "01HZY0000000000000000000A2"],
                         "score": 0.75, "feedback": "good", "metadata": {"by": "test"}, "report_id": "rep-7"}


def test_report_with_scenario_flag_skips_lookup(reef: FakeReef, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = cli(capsys, "--url", reef.url, "report", "01HZY0000000000000000000A3", "--scenario", "hello",
                       "--feedback-json", '{"tests": "3/4 passed"}', "-o", "json")
    assert code == 0
    assert json.loads(out)["feedback"] == {"tests": "3/4 passed"}
    (post,) = reef.seen
    assert post.body == {"references": ["01HZY0000000000000000000A3"], "feedback": {"tests": "3/4 passed"}}


@pytest.mark.parametrize("score", ["nan", "inf", "-inf", "1e999", "high"])
def test_report_rejects_a_score_that_is_not_a_finite_number(reef: FakeReef, capsys: pytest.CaptureFixture[str],
                                                            score: str) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--url", reef.url, "report", "01HZY0000000000000000000A1", f"--score={score}"])
    assert exit_.value.code == 2
    assert "--score" in capsys.readouterr().err
    assert reef.seen == []


# --- failures ------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", ["openai", "anthropic", "text"])
def test_http_error_message_goes_to_stderr(reef: FakeReef, capsys: pytest.CaptureFixture[str], shape: str) -> None:
    reef.error_shape = shape
    code, out, err = cli(capsys, "--url", reef.url, "records", "nope")
    assert (code, out) == (1, "")
    assert err == "reefctl: HTTP 404: unknown scenario 'nope'\n"


def test_report_on_unknown_receipt_fails(reef: FakeReef, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = cli(capsys, "--url", reef.url, "report", "missing", "--score", "1")
    assert (code, out) == (1, "")
    assert "HTTP 404: no record 'missing'" in err
    assert [s.method for s in reef.seen] == ["GET"]


def test_daemon_down_is_a_clear_message_in_a_real_process() -> None:
    url = dead_url()
    proc = run_reefctl("status", REEF_URL=url)
    assert proc.returncode == 1
    assert proc.stdout == ""
    assert proc.stderr == f"reefctl: cannot reach reefd at {url}: Connection refused\n"


def test_usage_error_exits_2_in_a_real_process() -> None:
    proc = run_reefctl("records")
    assert proc.returncode == 2
    assert "SCENARIO" in proc.stderr and proc.stdout == ""
