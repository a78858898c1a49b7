"""Inputs a fuzzer found that used to end in a 500: each is now a 400 (or 413) in the caller's provider shape,
refused before anything is generated or recorded."""

from __future__ import annotations

import gzip
import io
import json
import tarfile
from typing import Any

import pytest

from tests.conftest import Daemon

CHAT = "/v1/chat/completions"
MESSAGES = "/v1/messages"


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def openai_error(status: int, body: dict[str, Any]) -> dict[str, Any]:
    assert set(body) == {"error"}, body
    assert body["error"]["type"] == ("invalid_request_error" if status < 500 else "server_error")
    assert body["error"]["code"] is not None or status < 500
    return dict(body["error"])


def anthropic_error(body: dict[str, Any]) -> dict[str, Any]:
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body
    return dict(body["error"])


def records(d: Daemon) -> int:
    status, body = d.get("/reef/scenarios/tiny/records?limit=1000")
    assert status == 200
    return len(json.loads(body)["data"])


@pytest.mark.parametrize("path", [CHAT, MESSAGES])
def test_json_nested_past_the_parsers_limit_is_a_400(daemon: Daemon, path: str) -> None:
    raw = ('{"model": "t", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "x": '
           + nested(5000) + "}").encode()
    status, body, _ = daemon.post(path, raw)
    assert status == 400
    error = anthropic_error(body) if path == MESSAGES else openai_error(status, body)
    assert "nests arrays and objects more than 128 deep" in error["message"]


def test_deep_nesting_in_a_checked_or_unchecked_field_is_refused_before_generating(daemon: Daemon) -> None:
    before = records(daemon)
    for field in ("messages", "metadata", "tools"):
        body: dict[str, Any] = {"model": "t", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
        body[field] = json.loads(nested(300))
        status, answer, _ = daemon.post(CHAT, json.dumps(body).encode())
        assert status == 400, (field, answer)
        assert "more than 128 deep" in openai_error(status, answer)["message"]
    assert records(daemon) == before  # nothing was generated, so nothing recorded


def test_a_lone_surrogate_is_a_400_naming_the_field(daemon: Daemon) -> None:
    raw = b'{"model": "t", "max_tokens": 4, "messages": [{"role": "user", "content": "a\\ud800b"}]}'
    status, body, _ = daemon.post(CHAT, raw)
    error = openai_error(status, body)
    assert status == 400 and error["param"] == "messages.0.content" and "surrogate" in error["message"]
    status, body, _ = daemon.post(MESSAGES, raw)
    assert status == 400 and "surrogate" in anthropic_error(body)["message"]
    report = b'{"references": ["01ABCDEFGHJKMNPQRSTVWXYZ00"], "text": "\\udfff"}'
    status, body, _ = daemon.post("/reef/report", report)
    assert status == 400 and "surrogate" in openai_error(status, body)["message"]


def test_a_body_that_is_not_the_gzip_it_claims_is_a_400(daemon: Daemon) -> None:
    status, body, _ = daemon.post(CHAT, b"not gzip at all", headers={"Content-Encoding": "gzip"})
    assert status == 400 and "Content-Encoding: 'gzip'" in openai_error(status, body)["message"]
    good = gzip.compress(json.dumps({"model": "t", "max_tokens": 2,
                                     "messages": [{"role": "user", "content": "hi"}]}).encode())
    status, body, _ = daemon.post(CHAT, good, headers={"Content-Encoding": "gzip"})
    assert status == 200, body  # real gzip is read as such


def test_errors_echo_at_most_200_characters_of_what_was_sent(daemon: Daemon) -> None:
    long = "x" * 7000  # near the longest request line aiohttp reads (8190 bytes)
    status, raw = daemon.get(f"/reef/jobs/{long}")
    body = json.loads(raw)
    assert status == 404 and len(body["error"]["message"]) < 300 and "7002 chars" in body["error"]["message"]
    status, raw = daemon.get(f"/reef/records/{long}")
    assert status == 404 and len(json.loads(raw)["error"]["message"]) < 300
    status, body, _ = daemon.post(f"/scenarios/{long[:4000]}{CHAT}", {"model": "t", "messages": []})
    assert status in (400, 404) and len(openai_error(status, body)["message"]) < 400


def tar_of(members: list[tuple[str, bytes]], compress: bool = False) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w:gz" if compress else "w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


def publish(d: Daemon, data: bytes, ctype: str = "application/x-tar") -> tuple[int, dict[str, Any]]:
    status, body, _ = d.post("/reef/scenarios/tiny/releases?kind=adapter", data, headers={"content-type": ctype})
    return status, body


def test_uploads_are_bounded_before_anything_is_unpacked(daemon: Daemon) -> None:
    state = str(daemon.state)
    deep = "/".join(["d"] * 2000) + "/adapter_config.json"
    status, body = publish(daemon, tar_of([(deep, b"{}")]))
    error = openai_error(status, body)
    assert status == 400 and "at most 32 folders deep" in error["message"] and state not in error["message"]
    # 1 GiB of zeros compresses to a few MiB: refused from the sizes in the archive, never unpacked
    bomb = io.BytesIO()
    with tarfile.open(fileobj=bomb, mode="w:gz", compresslevel=1) as tar:
        info = tarfile.TarInfo("adapter_model.safetensors")
        info.size = 1 << 30

        class Zeros(io.RawIOBase):
            left = 1 << 30

            def readable(self) -> bool:
                return True

            def readinto(self, b: Any) -> int:
                n = min(len(b), self.left)
                b[:n] = bytes(n)
                self.left -= n
                return n

        tar.addfile(info, io.BufferedReader(Zeros()))
    assert len(bomb.getvalue()) < 8 << 20
    status, body = publish(daemon, bomb.getvalue(), "application/gzip")
    error = openai_error(status, body)
    assert status == 413 and "the most an artifact for this base model can hold" in error["message"]
    status, body = publish(daemon, tar_of([("adapter_config.json", b"{}")])[:700])  # cut short
    error = openai_error(status, body)
    assert status == 400 and "not a readable tar archive" in error["message"] and state not in error["message"]
    status, body = publish(daemon, b"{}", "application/json")
    assert status == 415 and openai_error(status, body)["code"] == "invalid_request"


def test_a_report_past_its_size_caps_or_its_score_range_is_refused_and_nothing_is_stored(daemon: Daemon) -> None:
    """Metadata and feedback are kept with every record a report references: each has a cap (413 past it); a
    score lies in [-1e9, 1e9] (400 past it), so that a trial's means stay numbers a person can read."""
    status, body, headers = daemon.post(CHAT, {"model": "t", "max_tokens": 2,
                                               "messages": [{"role": "user", "content": "hi"}]})
    assert status == 200, body
    receipt = {k.lower(): v for k, v in headers.items()}["x-reef-agent-record-id"]
    big = {"blob": "x" * (64 * 1024)}
    for extra, status_code, words in (({"metadata": big}, 413, "metadata: more than 64 KiB"),
                                      ({"feedback": "y" * (65 * 1024)}, 413, "feedback: more than 64 KiB"),
                                      ({"score": 1e308}, 400, "score: 1e+308 is greater than the maximum"),
                                      ({"score": -2e9}, 400, "score: -2000000000.0 is less than the minimum")):
        status, body, _ = daemon.post("/reef/report", {"references": [receipt], **extra})
        assert status == status_code, (extra.keys(), body)
        assert words in openai_error(status, body)["message"]
    stored = json.loads(daemon.get(f"/reef/records/{receipt}")[1])
    assert stored.get("reports") in (None, [])
    status, body, _ = daemon.post("/reef/report", {"references": [receipt], "score": 1e9,
                                                   "metadata": {"blob": "x" * 1000}})
    assert status == 200, body
