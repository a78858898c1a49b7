"""reefctl alone, against canned admin-API answers: flags, formats, paging, errors.

The server is a real HTTP server on a free loopback port that serves the admin API's documented
shapes and records what it was sent, so each case can pin exact inputs; tests/e2e/test_reefctl.py
drives reefctl against the real daemon.
"""

from __future__ import annotations

import io
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import tarfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import IO, Any
from urllib.parse import parse_qsl, unquote, urlsplit

import pytest

from reefd.cli import main as reefctl
from reefd.cli import release_verbs
from reefd.cli.main import main
from tests.served import in_thread

REPO = Path(__file__).resolve().parents[1]
CONNECTION_ENV = ("REEF_URL", "REEF_TOKEN", "REEF_STATE", "STATE_DIRECTORY")
PROXY_ENV = ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY")

STATUS = {
    "version": "0.1.0", "uptime_s": 3725.0, "ready": True,
    "scenarios": [
        {"name": "hello", "model": "smollm2", "release": "r1-aaaaaaa", "records": 3, "reports": 1,
         "engine": {"kind": "worker", "state": "ready", "url": "http://127.0.0.1:41234", "restarts": 0,
                    "pid": 123, "queue": {"running": 8, "waiting": 3, "limit": 8, "max_queue": 32,
                                          "max_queue_wait_s": 60.0, "refused": {"queue_full": 4}}},
         "releases": {"declared": None, "head": "r1-aaaaaaa", "serving": "r1-aaaaaaa",
                      "adapter": "hello-r1-aaaaaaa", "drift": []}},
        {"name": "coder", "model": "tiny-llama", "release": "r0-0000000", "records": 0, "reports": 0,
         "engine": {"kind": "upstream", "state": "starting", "url": None, "restarts": 2, "pid": None},
         "releases": {"declared": "r2-bbbbbbb", "head": "r3-ccccccc", "serving": "r0-0000000", "adapter": None,
                      "drift": ["pinned to r2-bbbbbbb, serving r0-0000000", "engine not ready"]}},
    ],
}
LEGACY_STATUS = {**STATUS, "scenarios": [  # a reefd from before the chain and the engines' lines
    {**{k: v for k, v in sc.items() if k != "releases"},
     "engine": {k: v for k, v in sc["engine"].items() if k != "queue"}} for sc in STATUS["scenarios"]]}


def release(rid: str, kind: str, parent: str | None, meta: dict[str, Any], status: str = "released",
            scenario: str = "demo") -> dict[str, Any]:
    seq = int(rid[1:rid.index("-")])
    return {"id": rid, "scenario": scenario, "parent": parent, "kind": kind, "seq": seq,
            "created_at": f"2026-11-29T10:{seq:02d}:00Z", "commit": f"{seq:x}" * 40, "meta": meta, "status": status}


CHAIN = [  # scenario demo, newest first, rejected candidates included (what ?all=1 answers)
    release("r3-ccccccc", "rollback", "r2-bbbbbbb", {"target": "r1-aaaaaaa"}),
    release("r2-ddddddd", "adapter", "r1-aaaaaaa", {"source": "sao", "gate": {"verdict": "fail", "score": 0.2}},
            status="rejected"),
    release("r2-bbbbbbb", "adapter", "r1-aaaaaaa",
            {"source": "sao", "summary": "fewer refusals\nsecond line", "gate": {"verdict": "pass", "score": 0.9}}),
    release("r1-aaaaaaa", "adapter", "r0-0000000", {"source": "publish", "summary": "first adapter"}),
    release("r0-0000000", "base", None, {"source": "import"}),
]
OTHER = release("r1-fffffff", "adapter", "r0-0000000", {}, scenario="other")
NEW_ID = "r4-eeeeeee"  # what a write appends
DIFF = {
    "a": "r1-aaaaaaa", "b": "r2-bbbbbbb", "kind": ["adapter", "adapter"],
    "meta": {"source": ["publish", "sao"], "summary": ["first adapter", "fewer refusals\nsecond line"],
             "gate": [None, {"verdict": "pass", "score": 0.9}]},
    "added": ["adapter/README.md"], "removed": ["notes/old.txt"],
    "changed": ["adapter/adapter_model.safetensors", "adapter/adapter_config.json"],
    "text": {"adapter/adapter_config.json": "--- a/adapter/adapter_config.json\n+++ b/adapter/adapter_config.json\n"
                                            "@@ -1 +1 @@\n-{\"r\": 8}\n+{\"r\": 16}\n"},
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
    """Serves GET /reef/status, GET /reef/records/{id}, GET /reef/scenarios/{name}/records, POST /reef/report,
    and the release chain of scenario demo: GET .../releases, GET /reef/diff, POST rollback, promote, releases."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.records = sample_records()
        self.seen: list[Seen] = []
        self.page_size = 2  # the server's default page, so three records take two pages
        self.error_shape = "openai"
        self.lock = threading.Lock()
        self.status: dict[str, Any] = STATUS
        self.chain = {"head": "r3-ccccccc", "serving": "r3-ccccccc", "declared": None}  # demo's pointers
        self.diff: dict[str, Any] = DIFF
        self.pinned = False  # writes to demo answer 409 scenario_pinned

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def listing(self) -> list[Seen]:
        return [s for s in self.seen if s.path.endswith("/records") and s.path.startswith("/reef/scenarios/")]

    def error(self, status: int, kind: str, message: str, code: str | None = None,
              param: str | None = None) -> tuple[int, Any]:
        if self.error_shape == "text":  # a body that is not JSON, as from a proxy in front of reefd
            return status, message.encode()
        if self.error_shape == "anthropic":
            return status, {"type": "error", "error": {"type": kind, "message": message}}
        return status, {"error": {"message": message, "type": kind, "param": param, "code": code}}

    def release(self, rid: str | None, scenario: str = "demo") -> tuple[int, Any] | None:
        """None when `rid` is a release of `scenario`, else the contract's error."""
        if rid in {r["id"] for r in CHAIN}:
            return None
        if rid == OTHER["id"]:
            return self.error(400, "invalid_request_error", f"release {rid} belongs to scenario other, not {scenario}",
                              "wrong_scenario")
        return self.error(404, "not_found_error", f"no release {rid!r}", "release_not_found")

    def write(self, req: Seen, action: str) -> tuple[int, Any]:
        """POST .../rollback, .../promote and .../releases on scenario demo, as the contract answers them."""
        body = req.body if isinstance(req.body, dict) else {}
        expected = body.get("expected_head", req.query.get("expected_head"))
        if self.pinned:
            return self.error(409, "invalid_request_error", "scenario demo is pinned to r2-bbbbbbb; unpin it first",
                              "scenario_pinned")
        if expected is not None and expected != self.chain["head"]:
            return self.error(409, "invalid_request_error",
                              f"expected head {expected}, but the head is {self.chain['head']}", "head_conflict",
                              "expected_head")
        if action == "releases":
            with tarfile.open(fileobj=io.BytesIO(req.body)) as tar:
                names = tar.getnames()
            if "adapter_config.json" not in names:
                return self.error(400, "invalid_request_error", "adapter_config.json is missing", "invalid_adapter")
            meta = {"source": "publish", **({"summary": req.query["summary"]} if "summary" in req.query else {})}
            return 201, {"release": release(NEW_ID, "adapter", self.chain["head"], meta), "serving": NEW_ID,
                         "warnings": ["adapter rank 64 is above the engine's max_lora_rank 32; loading may be slow"]}
        target = (body.get("to") or "r2-bbbbbbb") if action == "rollback" else body.get("release")
        failed = self.release(target)
        if failed:
            return failed
        dry = bool(body.get("dry_run"))
        appended = None if dry else release(NEW_ID, action, self.chain["head"], {"target": target})
        return 200, {"dry_run": dry, "release": appended, "from": self.chain["head"], "to": target,
                     "serving": self.chain["serving"] if dry else NEW_ID}

    def answer(self, req: Seen) -> tuple[int, Any]:
        parts = [unquote(p) for p in req.path.strip("/").split("/")]
        with self.lock:
            records = list(self.records)
        if req.method == "GET" and parts == ["reef", "status"]:
            return 200, self.status
        if req.method == "GET" and parts == ["reef", "scenarios", "demo", "releases"]:
            data = [r for r in CHAIN if req.query.get("all") == "1" or r["status"] == "released"]
            return 200, {"object": "list", "scenario": "demo", **self.chain, "data": data}
        if req.method == "GET" and parts == ["reef", "diff"]:
            if not (req.query.get("a") and req.query.get("b")):
                return self.error(400, "invalid_request_error", "a and b are required", "invalid_request")
            return self.release(req.query["a"]) or self.release(req.query["b"]) or (200, self.diff)
        if req.method == "POST" and parts[:3] == ["reef", "scenarios", "demo"] and len(parts) == 4:
            return self.write(req, parts[3])
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
        raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        json_body = self.headers.get("Content-Type", "").startswith("application/json")
        body = (json.loads(raw) if json_body else raw) if raw else None
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
    with in_thread(server):
        yield server


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
    header, hello, coder, *drift = out.splitlines()
    assert header.split() == ["SCENARIO", "MODEL", "ENGINE", "STATE", "QUEUE", "RELEASE", "RECORDS", "REPORTS",
                              "DECLARED", "HEAD", "SERVING", "DRIFT"]
    assert hello.split() == ["hello", "smollm2", "worker", "ready", "8/8+3", "r1-aaaaaaa", "3", "1",
                             "head", "r1-aaaaaaa", "r1-aaaaaaa", "-"]
    assert coder.split() == ["coder", "tiny-llama", "upstream", "starting", "-", "r0-0000000", "0", "0",
                             "r2-bbbbbbb", "r3-ccccccc", "r0-0000000", "serving!=pin"]
    assert header.index("MODEL") == hello.index("smollm2") and header.index("DRIFT") == coder.index("serving!=")
    assert drift == ["scenario hello: queue: 4 refused with 429 (more than 32 waiting), 0 with 503 (no turn within "
                     "60.0 s)",
                     "scenario coder: drift: pinned to r2-bbbbbbb, serving r0-0000000",
                     "scenario coder: drift: engine not ready"]
    assert "reefd 0.1.0" in err and "up 1h2m" in err and "ready" in err


def test_status_wide(reef: FakeReef, capsys: pytest.CaptureFixture[str]) -> None:
    _, out, _ = cli(capsys, "--url", reef.url, "status", "-o", "wide")
    rows = [line.split() for line in out.splitlines()]
    assert rows[0][-5:] == ["DRIFT", "ADAPTER", "URL", "RESTARTS", "PID"]
    assert rows[1][-5:] == ["-", "hello-r1-aaaaaaa", "http://127.0.0.1:41234", "0", "123"]
    assert rows[2][-5:] == ["serving!=pin", "-", "-", "2", "-"]


@pytest.mark.parametrize("output", [[], ["-o", "wide"]], ids=["table", "wide"])
def test_status_of_a_daemon_without_the_chain(reef: FakeReef, capsys: pytest.CaptureFixture[str],
                                              output: list[str]) -> None:
    reef.status = LEGACY_STATUS
    code, out, _ = cli(capsys, "--url", reef.url, "status", *output)
    assert code == 0
    header, hello, coder = (line.split() for line in out.splitlines())  # no drift lines either
    assert header == ["SCENARIO", "MODEL", "ENGINE", "STATE", "QUEUE", "RELEASE", "RECORDS", "REPORTS"] + (
        ["URL", "RESTARTS", "PID"] if output else [])
    assert hello[:8] == ["hello", "smollm2", "worker", "ready", "-", "r1-aaaaaaa", "3", "1"]
    assert coder[:8] == ["coder", "tiny-llama", "upstream", "starting", "-", "r0-0000000", "0", "0"]


@pytest.mark.parametrize(
    ("chain", "cell"),
    [
        ({"declared": None, "head": "r2", "serving": "r2", "drift": []}, "-"),
        ({"declared": None, "head": "r2", "serving": "r1", "drift": ["behind"]}, "serving!=head"),
        ({"declared": None, "head": "r2", "serving": None, "drift": ["nothing serves"]}, "serving!=head"),
        ({"declared": "r1", "head": "r2", "serving": "r2", "drift": ["not the pin"]}, "serving!=pin"),
        ({"declared": None, "head": "r2", "serving": "r2", "drift": ["adapter not loaded"]}, "yes"),
    ],
)
def test_status_drift_cell(chain: dict[str, Any], cell: str) -> None:
    assert reefctl._drift(chain) == cell


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
           "from reefd.cli.main import main; sys.exit(main(sys.argv[1:]))"
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


# --- release chain -------------------------------------------------------------------------------


def test_history_is_git_log_style(reef: FakeReef, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = cli(capsys, "--url", reef.url, "history", "demo")
    assert (code, err) == (0, "")
    assert out == (
        "release r3-ccccccc (HEAD -> serving)\nKind:    rollback\nParent:  r2-bbbbbbb\n"
        "Date:    2026-11-29T10:03:00Z\nSource:  -\nTarget:  r1-aaaaaaa\n\n"
        "release r2-bbbbbbb\nKind:    adapter\nParent:  r1-aaaaaaa\nDate:    2026-11-29T10:02:00Z\nSource:  sao\n\n"
        "    fewer refusals\n    second line\n    gate: pass\n\n"
        "release r1-aaaaaaa\nKind:    adapter\nParent:  r0-0000000\nDate:    2026-11-29T10:01:00Z\n"
        "Source:  publish\n\n    first adapter\n\n"
        "release r0-0000000\nKind:    base\nParent:  -\nDate:    2026-11-29T10:00:00Z\nSource:  import\n\n"
    )
    (seen,) = reef.seen
    assert (seen.method, seen.path, seen.query) == ("GET", "/reef/scenarios/demo/releases", {})


def test_history_all_marks_rejected_candidates_and_the_pin(reef: FakeReef,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    reef.chain = {"head": "r3-ccccccc", "serving": "r1-aaaaaaa", "declared": "r1-aaaaaaa"}
    code, out, _ = cli(capsys, "--url", reef.url, "history", "demo", "--all")
    assert code == 0
    assert [line for line in out.splitlines() if line.startswith("release ")] == [
        "release r3-ccccccc (HEAD)", "release r2-ddddddd (rejected)", "release r2-bbbbbbb",
        "release r1-aaaaaaa (serving, pinned)", "release r0-0000000"]
    assert "    gate: fail\n" in out
    assert reef.seen[-1].query == {"all": "1"}


def test_history_name_and_json(reef: FakeReef, capsys: pytest.CaptureFixture[str]) -> None:
    _, out, _ = cli(capsys, "--url", reef.url, "history", "demo", "-o", "name")
    assert out.split() == ["release/r3-ccccccc", "release/r2-bbbbbbb", "release/r1-aaaaaaa", "release/r0-0000000"]
    _, out, _ = cli(capsys, "--url", reef.url, "history", "demo", "--all", "-o", "json")
    assert json.loads(out) == {"object": "list", "scenario": "demo", **reef.chain, "data": CHAIN}


def test_diff_prints_meta_then_names_then_text(reef: FakeReef, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = cli(capsys, "--url", reef.url, "diff", "release/r1-aaaaaaa", "r2-bbbbbbb")
    assert (code, err) == (0, "")
    assert out == (
        'meta.gate: - -> {"verdict": "pass", "score": 0.9}\n'
        "meta.source: publish -> sao\n"
        'meta.summary: first adapter -> "fewer refusals\\nsecond line"\n'
        "A\tadapter/README.md\nM\tadapter/adapter_config.json\nM\tadapter/adapter_model.safetensors\n"
        "D\tnotes/old.txt\n\n"
        "--- a/adapter/adapter_config.json\n+++ b/adapter/adapter_config.json\n@@ -1 +1 @@\n"
        '-{"r": 8}\n+{"r": 16}\n'
    )
    (seen,) = reef.seen
    assert (seen.method, seen.path, seen.query) == ("GET", "/reef/diff", {"a": "r1-aaaaaaa", "b": "r2-bbbbbbb"})
    _, out, _ = cli(capsys, "--url", reef.url, "diff", "r1-aaaaaaa", "r2-bbbbbbb", "-o", "json")
    assert json.loads(out) == DIFF


def test_diff_of_kind_only_and_of_nothing(reef: FakeReef, capsys: pytest.CaptureFixture[str]) -> None:
    reef.diff = {"a": "r0-0000000", "b": "r3-ccccccc", "kind": ["base", "rollback"], "meta": {},
                 "added": [], "removed": [], "changed": [], "text": {}}
    assert cli(capsys, "--url", reef.url, "diff", "r0-0000000", "r3-ccccccc") == (0, "kind: base -> rollback\n", "")
    reef.diff = {**reef.diff, "kind": ["base", "base"]}
    code, out, err = cli(capsys, "--url", reef.url, "diff", "r0-0000000", "r0-0000000")
    assert (code, out, err) == (0, "", "No differences between r0-0000000 and r0-0000000.\n")


def test_rollback_to_the_previous_release(reef: FakeReef, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = cli(capsys, "--url", reef.url, "rollback", "demo")
    assert (code, err) == (0, "")
    assert out == "scenario demo rolled back to r2-bbbbbbb as r4-eeeeeee (was r3-ccccccc); serving r4-eeeeeee\n"
    (seen,) = reef.seen
    assert (seen.method, seen.path, seen.body) == ("POST", "/reef/scenarios/demo/rollback",
                                                   {"to": None, "dry_run": False})
    assert seen.headers["content-type"] == "application/json"


def test_rollback_dry_run_to_a_release(reef: FakeReef, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = cli(capsys, "--url", reef.url, "rollback", "demo", "--to", "release/r1-aaaaaaa", "--dry-run",
                       "--expected-head", "r3-ccccccc")
    assert (code, out) == (0, "would roll back demo from r3-ccccccc to r1-aaaaaaa (dry run; nothing changed)\n")
    assert reef.seen[-1].body == {"to": "r1-aaaaaaa", "dry_run": True, "expected_head": "r3-ccccccc"}
    _, out, _ = cli(capsys, "--url", reef.url, "rollback", "demo", "--to-release", "r1-aaaaaaa", "-o", "json")
    assert json.loads(out) == {"dry_run": False, "from": "r3-ccccccc", "to": "r1-aaaaaaa", "serving": NEW_ID,
                               "release": release(NEW_ID, "rollback", "r3-ccccccc", {"target": "r1-aaaaaaa"})}
    assert reef.seen[-1].body == {"to": "r1-aaaaaaa", "dry_run": False}


def test_promote(reef: FakeReef, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = cli(capsys, "--url", reef.url, "promote", "demo", "release/r2-ddddddd")
    assert (code, out) == (0, "scenario demo promoted r2-ddddddd as r4-eeeeeee (was r3-ccccccc); serving r4-eeeeeee\n")
    assert (reef.seen[-1].method, reef.seen[-1].path) == ("POST", "/reef/scenarios/demo/promote")
    assert reef.seen[-1].body == {"release": "r2-ddddddd", "dry_run": False}
    _, out, _ = cli(capsys, "--url", reef.url, "promote", "demo", "r2-ddddddd", "--dry-run", "-o", "json")
    assert json.loads(out) == {"dry_run": True, "release": None, "from": "r3-ccccccc", "to": "r2-ddddddd",
                               "serving": "r3-ccccccc"}
    _, out, _ = cli(capsys, "--url", reef.url, "promote", "demo", "r2-ddddddd", "--dry-run")
    assert out == "would promote demo from r3-ccccccc to r2-ddddddd (dry run; nothing changed)\n"


def make_adapter(root: Path) -> Path:
    folder = root / "adapter"
    (folder / "sub").mkdir(parents=True)
    (folder / "empty").mkdir()
    (folder / "adapter_config.json").write_text('{"r": 16}')
    (folder / "adapter_model.safetensors").write_bytes(bytes(range(256)) * 3)
    (folder / "sub" / "notes.txt").write_text("hi\n")
    os.link(folder / "sub" / "notes.txt", folder / "sub" / "hard.txt")  # goes in as a plain file
    return folder


def test_publish_sends_a_tar_of_the_folder_contents(reef: FakeReef, capsys: pytest.CaptureFixture[str],
                                                    monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    folder = make_adapter(tmp_path)
    timeouts: list[float] = []
    urlopen = reefctl.urllib.request.urlopen

    def spy(req: Any, timeout: float) -> Any:
        timeouts.append(timeout)
        return urlopen(req, timeout=timeout)

    monkeypatch.setattr(reefctl.urllib.request, "urlopen", spy)
    code, out, err = cli(capsys, "--url", reef.url, "publish", "demo", "--adapter", str(folder),
                         "--summary", "from a test", "--expected-head", "release/r3-ccccccc")
    assert code == 0
    assert out == "release/r4-eeeeeee published to demo; serving r4-eeeeeee\n"
    assert err == "reefctl: warning: adapter rank 64 is above the engine's max_lora_rank 32; loading may be slow\n"
    assert timeouts == [release_verbs.PUBLISH_TIMEOUT_S]
    (seen,) = reef.seen
    assert (seen.method, seen.path) == ("POST", "/reef/scenarios/demo/releases")
    assert seen.query == {"kind": "adapter", "expected_head": "r3-ccccccc", "summary": "from a test"}
    assert seen.headers["content-type"] == "application/x-tar"
    with tarfile.open(fileobj=io.BytesIO(seen.body), mode="r:") as tar:  # r: uncompressed, or it fails
        members = {m.name: m for m in tar.getmembers()}
        assert list(members) == ["adapter_config.json", "adapter_model.safetensors", "empty", "sub",
                                 "sub/hard.txt", "sub/notes.txt"]
        assert [n for n, m in members.items() if m.isdir()] == ["empty", "sub"]
        assert all(m.isfile() or m.isdir() for m in members.values())
        for name in ("adapter_config.json", "adapter_model.safetensors", "sub/hard.txt", "sub/notes.txt"):
            data = tar.extractfile(members[name])
            assert data is not None and data.read() == (folder / name).read_bytes()


def test_publish_name_and_json(reef: FakeReef, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    folder = make_adapter(tmp_path)
    _, out, _ = cli(capsys, "--url", reef.url, "publish", "demo", "--adapter", str(folder), "-o", "name")
    assert out == "release/r4-eeeeeee\n"
    assert reef.seen[-1].query == {"kind": "adapter"}
    _, out, err = cli(capsys, "--url", reef.url, "publish", "demo", "--adapter", str(folder), "-o", "json")
    assert json.loads(out)["release"]["id"] == NEW_ID and "reefctl: warning: " in err


@pytest.mark.parametrize("kind", ["file-link", "folder-link", "fifo"])
def test_publish_refuses_what_is_not_a_file_or_folder(reef: FakeReef, capsys: pytest.CaptureFixture[str],
                                                      tmp_path: Path, kind: str) -> None:
    folder = make_adapter(tmp_path)
    odd = folder / "sub" / "odd"
    if kind == "fifo":
        os.mkfifo(odd)
    else:
        odd.symlink_to(folder / ("adapter_config.json" if kind == "file-link" else "empty"))
    code, out, err = cli(capsys, "--url", reef.url, "publish", "demo", "--adapter", str(folder))
    assert (code, out) == (1, "")
    assert err == (f"reefctl: refusing {odd}: not a regular file or folder\n" if kind == "fifo" else
                   f"reefctl: refusing symbolic link {odd}: a published folder may hold only files and folders\n")
    assert reef.seen == []


def test_publish_needs_a_folder(reef: FakeReef, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    assert cli(capsys, "--url", reef.url, "publish", "demo", "--adapter", str(missing)) == (
        1, "", f"reefctl: --adapter {missing}: no such folder\n")
    (tmp_path / "file").write_text("x")
    assert cli(capsys, "--url", reef.url, "publish", "demo", "--adapter", str(tmp_path / "file")) == (
        1, "", f"reefctl: --adapter {tmp_path / 'file'}: not a folder\n")
    assert reef.seen == []


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["rollback", "demo", "--expected-head", "r2-bbbbbbb"],
         "HTTP 409: expected head r2-bbbbbbb, but the head is r3-ccccccc"),
        (["promote", "demo", "r2-bbbbbbb", "--expected-head", "r1-aaaaaaa"],
         "HTTP 409: expected head r1-aaaaaaa, but the head is r3-ccccccc"),
        (["rollback", "demo", "--to", "r9-0000000"], "HTTP 404: no release 'r9-0000000'"),
        (["promote", "demo", "r1-fffffff"], "HTTP 400: release r1-fffffff belongs to scenario other, not demo"),
        (["diff", "r1-aaaaaaa", "r9-0000000"], "HTTP 404: no release 'r9-0000000'"),
        (["publish", "demo", "--adapter", "ADAPTER", "--expected-head", "r2-bbbbbbb"],
         "HTTP 409: expected head r2-bbbbbbb, but the head is r3-ccccccc"),
        (["publish", "demo", "--adapter", "ADAPTER", "--summary", "no config"],
         "HTTP 400: adapter_config.json is missing"),
    ],
    ids=["rollback-head-conflict", "promote-head-conflict", "rollback-unknown", "promote-wrong-scenario",
         "diff-unknown", "publish-head-conflict", "publish-invalid-adapter"],
)
def test_chain_errors_are_one_line(reef: FakeReef, capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                   argv: list[str], message: str) -> None:
    folder = make_adapter(tmp_path)
    if "no config" in argv:
        (folder / "adapter_config.json").unlink()
    argv = [str(folder) if a == "ADAPTER" else a for a in argv]
    assert cli(capsys, "--url", reef.url, *argv) == (1, "", f"reefctl: {message}\n")
    assert len(reef.seen) == 1


@pytest.mark.parametrize("argv", [["rollback", "demo"], ["promote", "demo", "r2-bbbbbbb"],
                                  ["publish", "demo", "--adapter", "ADAPTER"]])
def test_writes_to_a_pinned_scenario_are_refused(reef: FakeReef, capsys: pytest.CaptureFixture[str],
                                                 tmp_path: Path, argv: list[str]) -> None:
    reef.pinned = True
    argv = [str(make_adapter(tmp_path)) if a == "ADAPTER" else a for a in argv]
    assert cli(capsys, "--url", reef.url, *argv) == (
        1, "", "reefctl: HTTP 409: scenario demo is pinned to r2-bbbbbbb; unpin it first\n")


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
