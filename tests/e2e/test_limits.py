"""Generation caps and context length, answered in each provider's own terms."""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest

from tests.conftest import Daemon, free_port, make_scenarios, sdk
from tests.e2e.test_metrics import scrape, value

CAPPED = "defaults:\n  - model: tiny\n  - _self_\nmodel:\n  max_new_tokens: 3\n"
SHORT = "defaults:\n  - model: tiny\n  - _self_\nmodel:\n  context_length: 64\n"
# one turn at a time, one request may wait for it, for at most 3 s
NARROW = ("defaults:\n  - model: tiny\n  - _self_\nmodel:\n  max_batch: 1\n  max_queue: 1\n  max_queue_wait_s: 3\n"
          "  launch_args: [--threads, '1']\n")
LONG = {"ignore_eos": True}


@pytest.fixture(scope="module")
def limits(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    base = tmp_path_factory.mktemp("limits")
    d = Daemon(scenarios=make_scenarios(base / "s", names=(),
                                        extra={"capped": CAPPED, "short": SHORT, "narrow": NARROW}),
               state=base / "state", log_path=base / "reefd.log",
               env={"REEF_METRICS_LISTEN": f"127.0.0.1:{(metrics_port := free_port())}"})
    d.metrics_port = metrics_port  # type: ignore[attr-defined]
    d.start()
    yield d
    d.stop()


def test_the_scenario_cap_wins_over_what_the_client_asks(limits: Daemon) -> None:
    c = sdk(anthropic.Anthropic(base_url=limits.url + "/scenarios/capped", api_key=limits.token,
                                max_retries=0))
    with c.messages.stream(model="x", max_tokens=32000, extra_body={"ignore_eos": True},
                           messages=[{"role": "user", "content": "write a novel"}]) as stream:
        msg = stream.get_final_message()  # streamed, as Claude Code asks for 32000
    assert msg.usage.output_tokens == 3 and msg.stop_reason == "max_tokens"


def test_a_prompt_over_the_context_is_the_providers_own_error(limits: Daemon) -> None:
    long = [{"role": "user", "content": "word " * 200}]
    oai = sdk(openai.OpenAI(base_url=limits.url + "/scenarios/short/v1", api_key=limits.token,
                            max_retries=0))
    with pytest.raises(openai.BadRequestError) as exc:
        oai.chat.completions.create(model="short", messages=long)  # type: ignore[arg-type]
    body = exc.value.body
    assert isinstance(body, dict) and body["code"] == "context_length_exceeded"
    assert body["type"] == "invalid_request_error" and "64" in body["message"]
    claude = sdk(anthropic.Anthropic(base_url=limits.url + "/scenarios/short",
                                     api_key=limits.token, max_retries=0))
    with pytest.raises(anthropic.BadRequestError) as aexc:
        claude.messages.create(model="short", max_tokens=5, messages=long)  # type: ignore[arg-type]
    abody = aexc.value.body
    assert isinstance(abody, dict) and abody["error"]["type"] == "invalid_request_error"
    assert abody["error"]["message"].startswith("prompt is too long")


def test_an_answer_that_would_overflow_the_context_stops_at_its_end(limits: Daemon) -> None:
    oai = sdk(openai.OpenAI(base_url=limits.url + "/scenarios/short/v1", api_key=limits.token,
                            max_retries=0))
    answer = oai.chat.completions.create(model="short", max_tokens=500,
                                         messages=[{"role": "user", "content": "hi"}],
                                         extra_body={"ignore_eos": True})
    assert answer.usage is not None
    assert answer.usage.prompt_tokens + answer.usage.completion_tokens == 64
    assert answer.choices[0].finish_reason == "length"


def _queue(d: Daemon, name: str) -> dict[str, Any]:
    status, body = d.get("/reef/status")
    assert status == 200
    engine = next(s for s in json.loads(body)["scenarios"] if s["name"] == name)["engine"]
    return dict(engine["queue"], url=engine["url"])


def _until(check: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.05)


def _records(d: Daemon, name: str) -> int:
    status, body = d.get(f"/reef/scenarios/{name}/records?limit=1000")
    assert status == 200
    return len(json.loads(body)["data"])


def test_a_full_line_is_refused_at_once_in_each_providers_shape_and_the_sdks_retry(limits: Daemon) -> None:
    """max_batch 1, max_queue 1: one request generates, one waits (at most 3 s), the next gets 429 at once with
    Retry-After; the one that waited too long gets 503 with Retry-After; an SDK left to retry gets its answer."""
    oai = sdk(openai.OpenAI(base_url=limits.url + "/scenarios/narrow/v1", api_key=limits.token, max_retries=0))
    holder = oai.chat.completions.create(model="narrow", max_tokens=20000, stream=True, extra_body=LONG,
                                         messages=[{"role": "user", "content": "hold the engine"}])
    next(iter(holder))  # generating: it holds the only turn
    waited: dict[str, Any] = {}

    def wait_in_line() -> None:
        try:
            oai.chat.completions.create(model="narrow", max_tokens=4, messages=[{"role": "user", "content": "w"}])
        except openai.APIStatusError as exc:
            waited.update(status=exc.status_code, retry_after=exc.response.headers.get("retry-after"),
                          body=exc.body)

    waiter = threading.Thread(target=wait_in_line)
    waiter.start()
    try:
        _until(lambda: _queue(limits, "narrow")["waiting"] == 1)
        started = time.monotonic()
        with pytest.raises(openai.RateLimitError) as full:
            oai.chat.completions.create(model="narrow", max_tokens=4, messages=[{"role": "user", "content": "x"}])
        assert time.monotonic() - started < 2  # at once, not after a wait
        assert full.value.response.headers["retry-after"] == "1"
        assert isinstance(full.value.body, dict) and full.value.body["code"] == "rate_limit_exceeded"
        assert "max_queue" in full.value.body["message"]
        claude = sdk(anthropic.Anthropic(base_url=limits.url + "/scenarios/narrow", api_key=limits.token,
                                         max_retries=0))
        with pytest.raises(anthropic.RateLimitError) as afull:
            claude.messages.create(model="narrow", max_tokens=4, messages=[{"role": "user", "content": "x"}])
        assert isinstance(afull.value.body, dict) and afull.value.body["type"] == "error"
        assert afull.value.body["error"]["type"] == "rate_limit_error"
        waiter.join(timeout=30)
        assert waited["status"] == 503 and waited["retry_after"] == "2"  # no turn within max_queue_wait_s
        assert "max_queue_wait_s" in waited["body"]["message"]
        assert _queue(limits, "narrow")["refused"] == {"queue_full": 2, "queue_timeout": 1}
        # an SDK left to retry (its default) is refused, waits as told, and gets its answer once the turn is free
        patient = sdk(openai.OpenAI(base_url=limits.url + "/scenarios/narrow/v1", api_key=limits.token,
                                    max_retries=6))
        threading.Timer(1.5, holder.close).start()  # the holder's client goes away: its turn comes free
        blocker = threading.Thread(target=wait_in_line)  # keeps the line full until then
        blocker.start()
        _until(lambda: _queue(limits, "narrow")["waiting"] == 1)
        answer = patient.chat.completions.create(model="narrow", max_tokens=4,
                                                 messages=[{"role": "user", "content": "p"}])
        assert answer.choices[0].message.content is not None
        assert _queue(limits, "narrow")["refused"]["queue_full"] >= 3
        blocker.join(timeout=30)
    finally:
        holder.close()
        waiter.join(timeout=30)
    _until(lambda: _queue(limits, "narrow")["running"] == 0)


def test_a_client_that_leaves_a_plain_request_frees_its_turn_and_nothing_is_recorded(limits: Daemon) -> None:
    """A non-streamed request whose client disconnects stops generating at once (its batch slot comes back) and
    leaves no record: nothing was delivered."""
    _until(lambda: _queue(limits, "narrow")["running"] == 0)
    before = _records(limits, "narrow")
    worker = _queue(limits, "narrow")["url"]
    conn = http.client.HTTPConnection("127.0.0.1", limits.port, timeout=1.0)
    body = json.dumps({"model": "narrow", "max_tokens": 20000, "ignore_eos": True,
                       "messages": [{"role": "user", "content": "a long answer nobody waits for"}]})
    conn.request("POST", "/scenarios/narrow/v1/chat/completions", body=body,
                 headers={"Authorization": f"Bearer {limits.token}", "Content-Type": "application/json"})
    with pytest.raises(TimeoutError):
        conn.getresponse()
    assert _queue(limits, "narrow")["running"] == 1
    conn.close()  # the client goes away
    left = time.monotonic()

    def worker_idle() -> bool:
        with urllib.request.urlopen(worker + "/get_server_info", timeout=5) as r:
            info = json.loads(r.read())
        return bool(info["running_requests"] == 0 and info["waiting_requests"] == 0)

    _until(lambda: _queue(limits, "narrow")["running"] == 0 and worker_idle(), timeout_s=15)
    assert time.monotonic() - left < 10  # 20000 tokens would take minutes
    assert _records(limits, "narrow") == before


def test_a_client_that_leaves_while_waiting_in_the_line_gives_up_its_place(limits: Daemon) -> None:
    """The line holds no one who left: a waiting request whose client disconnects is out of it within a poll, is
    not counted as refused, and leaves no record."""
    _until(lambda: _queue(limits, "narrow")["running"] == 0)
    before, refused = _records(limits, "narrow"), dict(_queue(limits, "narrow")["refused"])
    body = json.dumps({"model": "narrow", "max_tokens": 20000, "ignore_eos": True,
                       "messages": [{"role": "user", "content": "hold the only turn"}]})
    conns = []
    for _ in range(2):  # the first generates, the second waits for its turn
        conn = http.client.HTTPConnection("127.0.0.1", limits.port, timeout=1.0)
        conn.request("POST", "/scenarios/narrow/v1/chat/completions", body=body,
                     headers={"Authorization": f"Bearer {limits.token}", "Content-Type": "application/json"})
        conns.append(conn)
    _until(lambda: (_queue(limits, "narrow")["running"], _queue(limits, "narrow")["waiting"]) == (1, 1),
           timeout_s=2.5)
    conns[1].close()  # the waiting client goes away, well within max_queue_wait_s (3 s)
    _until(lambda: _queue(limits, "narrow")["waiting"] == 0, timeout_s=2)
    assert _queue(limits, "narrow")["running"] == 1  # the first one is still generating
    conns[0].close()
    _until(lambda: _queue(limits, "narrow")["running"] == 0, timeout_s=15)
    assert _queue(limits, "narrow")["refused"] == refused and _records(limits, "narrow") == before


def test_a_huge_prompt_is_refused_without_swelling_reefd(limits: Daemon) -> None:
    """10 MiB of prompt on a 65536-token model: measured in slices off the event loop and refused as the
    provider would, with reefd's memory still under 150 MB after (tokenizing it whole took 460 MB, kept)."""
    assert limits.proc is not None
    huge = "coral reef " * (10 * 1024 * 1024 // 11)
    oai = sdk(openai.OpenAI(base_url=limits.url + "/scenarios/capped/v1", api_key=limits.token, max_retries=0))
    with pytest.raises(openai.BadRequestError) as exc:
        oai.chat.completions.create(model="capped", max_tokens=4, messages=[{"role": "user", "content": huge}])
    body = exc.value.body
    assert isinstance(body, dict) and body["code"] == "context_length_exceeded"
    assert body["message"].startswith("prompt is too long: at least ") and "65536" in body["message"]
    claude = sdk(anthropic.Anthropic(base_url=limits.url + "/scenarios/capped", api_key=limits.token,
                                     max_retries=0))
    with pytest.raises(anthropic.BadRequestError):
        claude.messages.count_tokens(model="capped", messages=[{"role": "user", "content": huge}])
    status = Path(f"/proc/{limits.proc.pid}/status").read_text().splitlines()
    rss = int(next(line for line in status if line.startswith("VmRSS:")).split()[1])
    assert rss < 150 * 1024, f"reefd holds {rss // 1024} MB after the huge prompt"


def test_the_line_shows_in_status_and_on_the_metrics_port_without_a_token(limits: Daemon) -> None:
    families = scrape(f"http://127.0.0.1:{limits.metrics_port}/metrics", None)  # type: ignore[attr-defined]
    assert value(families, "reef_num_requests_waiting", scenario="narrow") == _queue(limits, "narrow")["waiting"]
    refused = _queue(limits, "narrow")["refused"]
    for reason in ("queue_full", "queue_timeout"):
        assert value(families, "reef_queue_refused_total", scenario="narrow", reason=reason) == refused.get(reason, 0)
    out = subprocess.run([sys.executable, "-m", "reefd.cli", "--url", limits.url, "status"], capture_output=True,
                         text=True, env={**os.environ, "REEF_TOKEN": limits.token}, check=True).stdout
    header, *rows = out.splitlines()
    assert "QUEUE" in header.split()
    narrow = next(r for r in rows if r.startswith("narrow"))
    assert "0/1+0" in narrow.split()
