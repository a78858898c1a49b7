"""Schemathesis against the real reefd: every operation of its own `GET /openapi.json`, fed generated valid and
invalid requests, must never answer 5xx, and must answer only documented statuses and media types, with bodies,
stream events and headers that fit the documented schemas (every error in its route's provider shape). Then the
fuzzer's findings, as plain cases.

`REEF_FUZZ_CASES` sets how many cases the fuzzing phase generates, spread over the operations (default 300);
`REEF_FUZZ_PHASES` the phases (default examples,fuzzing; `make fuzz` adds coverage and stateful, which follows the
document's links: answer → record, report, stored response; train → job, cancel); `REEF_FUZZ_SEED` the seed
(default 0: the same cases every run). Mutating routes (publish, rollback, promote, train, cancel) are fuzzed too:
the daemon is this test's own, and one of its scenarios trains (sao, in seconds on the tiny model).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import Daemon, make_scenarios
from tests.served import ROOT

CASES = int(os.environ.get("REEF_FUZZ_CASES", "300"))
PHASES = os.environ.get("REEF_FUZZ_PHASES", "examples,fuzzing")
SEED = os.environ.get("REEF_FUZZ_SEED", "0")
CHECKS = ("not_a_server_error", "status_code_conformance", "content_type_conformance",
          "response_schema_conformance", "response_headers_conformance", "unsupported_method",
          "allow_header_conformance", "missing_required_header", "ignored_auth")
# Generation stays short whatever max_tokens a case asks for: the scenarios cap it (model.max_new_tokens).
_TINY = "defaults:\n  - model: tiny\n{more}  - release: follow\n  - _self_\nmodel:\n  max_new_tokens: 4\n"
SCENARIOS = {
    "tiny": _TINY.format(more="") + "serve:\n  default_max_tokens: 4\n",
    "tiny-harness": _TINY.format(more="") + "harness:\n  dir: coder-harness\n",
    "tiny-sao": _TINY.format(more="  - recipe: sao\n  - trigger: manual\n  - gate: always\n"),
}


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    base = tmp_path_factory.mktemp("fuzz")
    d = Daemon(scenarios=make_scenarios(base / "scenarios", names=(), extra=SCENARIOS), state=base / "state",
               log_path=base / "reefd.log")
    d.start()
    yield d
    d.stop()


def test_every_operation_answers_as_documented(fuzzed: Daemon, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    status, raw = fuzzed.get("/openapi.json")
    assert status == 200, raw
    operations = sum(len(item) for item in json.loads(raw)["paths"].values())
    tally = tmp_path / "tally.json"
    started = time.monotonic()
    run = subprocess.run(
        [str(Path(sys.executable).with_name("st")), "run", fuzzed.url + "/openapi.json",
         "--header", f"Authorization: Bearer {fuzzed.token}", "--checks", ",".join(CHECKS), "--phases", PHASES,
         "--max-examples", str(max(1, CASES // operations)), "--seed", SEED,
         # one worker: CPython 3.11.7's ast is not thread-safe, and Hypothesis parses sources while it generates
         "--workers", "1", "--suppress-health-check", "all", "--request-timeout", "60", "--no-color"],
        env={**os.environ, "SCHEMATHESIS_HOOKS": str(ROOT / "tests" / "e2e" / "fuzz_hooks.py"),
             "REEF_FUZZ_TALLY": str(tally)},
        cwd=tmp_path, capture_output=True, text=True, timeout=4 * 3600)
    elapsed = time.monotonic() - started
    assert tally.is_file(), run.stdout[-5000:] + run.stderr[-5000:]
    statuses = {int(code): n for code, n in json.loads(tally.read_text()).items()}
    by_class = {f"{c}xx": sum(n for code, n in statuses.items() if code // 100 == c) for c in (2, 4, 5)}
    with capsys.disabled():
        print(f"\nfuzz: {sum(statuses.values())} cases on {operations} operations in {elapsed:.0f} s "
              f"(phases {PHASES}, seed {SEED}): {by_class['2xx']} 2xx, {by_class['4xx']} 4xx, "
              f"{by_class['5xx']} 5xx; by status {dict(sorted(statuses.items()))}")
    assert run.returncode == 0, run.stdout[-20000:] + run.stderr[-5000:]
    assert fuzzed.proc is not None and fuzzed.proc.poll() is None, fuzzed.logs()
    assert by_class["5xx"] == 0 and by_class["2xx"] and by_class["4xx"], statuses
    # a failure after a stream's headers goes out in band (an error event in a 200): the log still tells
    log = fuzzed.log_path.read_text(errors="replace")
    assert "Traceback" not in log and "unhandled error" not in log, log[-6000:]


SAY = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/chat/completions", {"model": "t", "max_tokens": 2.0, "seed": 7.0, "messages": SAY}),
    ("/v1/chat/completions", {"model": "t", "max_completion_tokens": 2.0, "seed": 9e18, "messages": SAY}),
    ("/v1/messages", {"model": "t", "max_tokens": 2.0, "top_k": 3.0, "messages": SAY}),
    ("/v1/responses", {"model": "t", "max_output_tokens": 2.0, "input": "hi"}),
])
def test_a_whole_number_written_as_a_float_is_taken_as_the_integer(daemon: Daemon, path: str,
                                                                   body: dict[str, Any]) -> None:
    """JSON Schema counts 2.0 as an integer, so the APIs accept it: the engine must get 2, not refuse 2.0."""
    status, answer, headers = daemon.post(path, body)
    assert status == 200, answer
    record = json.loads(daemon.get(f"/reef/records/{headers['x-reef-agent-record-id']}")[1])
    assert record["sampling"]["max_tokens"] == 2 and type(record["sampling"]["max_tokens"]) is int
    assert record["usage"]["completion_tokens"] <= 2


@pytest.mark.parametrize(("method", "path", "allow"), [
    ("GET", "/v1/chat/completions", "POST"), ("PUT", "/v1/messages", "POST"), ("GET", "/v1/responses", "POST"),
    ("DELETE", "/reef/status", "GET,HEAD"), ("TRACE", "/scenarios/tiny/v1/responses/resp_x", "GET,HEAD")])
def test_a_method_the_path_does_not_serve_is_a_405_naming_those_it_does(daemon: Daemon, method: str, path: str,
                                                                       allow: str) -> None:
    request = urllib.request.Request(daemon.url + path, method=method, headers=daemon.headers())
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(request, timeout=30)
    assert caught.value.code == 405 and sorted(caught.value.headers.get("Allow", "").split(",")) == allow.split(",")
    body = json.loads(caught.value.read())
    assert body["error"]["type"] == "invalid_request_error"
    assert (body.get("type") == "error") == path.startswith("/v1/messages")  # Anthropic's shape there, else OpenAI's
