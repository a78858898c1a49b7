"""`POST /reef/report` and the bad inputs every route must answer in the right shape."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest

from tests.conftest import Daemon, sdk


def post(d: Daemon, path: str, body: bytes | dict[str, Any], headers: dict[str, str] | None = None,
         token: str | None = None) -> tuple[int, dict[str, Any], dict[str, str]]:
    return d.post(path, body, headers, token)


@pytest.fixture(scope="module")
def receipt(daemon: Daemon) -> str:
    c = sdk(openai.OpenAI(base_url=daemon.url + "/v1", api_key=daemon.token, max_retries=0,
                      default_headers={"x-reef-scenario": "tiny"}))
    raw = c.chat.completions.with_raw_response.create(
        model="tiny", messages=[{"role": "user", "content": "rate me"}], max_tokens=3)
    return raw.headers["x-reef-agent-record-id"]


def test_report_attaches_to_the_record(daemon: Daemon, receipt: str) -> None:
    status, body, _ = post(daemon, "/reef/report", {
        "score": 1, "feedback": "good", "references": [receipt], "metadata": {"who": "test"}})
    assert status == 200, body
    assert body["references"] == [receipt] and body["score"] == 1
    rec = json.loads(daemon.get(f"/reef/records/{receipt}")[1])
    assert [r["report_id"] for r in rec["reports"]] == [body["report_id"]]
    assert rec["reports"][0]["feedback"] == "good"


def test_structured_feedback_and_idempotent_report_id(daemon: Daemon, receipt: str) -> None:
    report = {"score": 0.5, "feedback": {"tests_passed": 3, "tests_failed": 1},
              "references": [receipt], "report_id": "ci-run-42"}
    first = post(daemon, "/reef/report", report)
    again = post(daemon, "/reef/report", report)
    assert first[0] == again[0] == 200
    assert first[1] == again[1]
    changed = post(daemon, "/reef/report", {**report, "score": 0.9})
    assert changed[0] == 409 and changed[1]["error"]["param"] == "report_id"


@pytest.mark.parametrize("body,param", [
    ({"score": True, "references": ["x"]}, "score"),
    ({"score": "1", "references": ["x"]}, "score"),
    ({"score": 1, "references": []}, "references"),
    ({"score": 1}, None),
    ({"score": 1, "references": ["x"], "feedback": 3}, "feedback"),
    ({"score": 1, "references": ["x"], "metadata": []}, "metadata"),
    ({"score": 1, "references": ["x"], "scroe": 2}, None),
])
def test_malformed_reports_are_400_naming_the_field(daemon: Daemon, body: dict[str, Any],
                                                    param: str | None) -> None:
    status, answer, _ = post(daemon, "/reef/report", body)
    assert status == 400
    err = answer["error"]
    assert err["type"] == "invalid_request_error"
    if param:
        assert err["param"] == param and err["message"].startswith(param + ":")


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
def test_non_finite_score_is_rejected(daemon: Daemon, receipt: str, constant: str) -> None:
    raw = f'{{"score": {constant}, "references": ["{receipt}"]}}'.encode()
    status, answer, _ = post(daemon, "/reef/report", raw)
    assert status == 400 and answer["error"]["param"] == "score"


def test_unknown_receipt_is_404(daemon: Daemon) -> None:
    status, answer, _ = post(daemon, "/reef/report",
                             {"score": 1, "references": ["01ARZ3NDEKTSV4RRFFQ69G5FAV"]})
    assert status == 404 and "01ARZ3NDEKTSV4RRFFQ69G5FAV" in answer["error"]["message"]


def test_report_on_another_scenarios_receipt_is_404(daemon: Daemon, receipt: str) -> None:
    status, answer, _ = post(daemon, "/reef/report", {"score": 1, "references": [receipt]},
                             headers={"x-reef-scenario": "nope"})
    assert status == 404 and "known scenarios" in answer["error"]["message"]


def test_malformed_json_gets_400_in_each_providers_shape(daemon: Daemon) -> None:
    status, answer, _ = post(daemon, "/v1/chat/completions", b"{not json")
    assert status == 400 and "not valid JSON" in answer["error"]["message"]
    status, answer, _ = post(daemon, "/v1/messages", b"[1, 2")
    assert status == 400 and answer["type"] == "error"
    assert answer["error"]["type"] == "invalid_request_error"


def test_every_route_but_the_probes_needs_the_token(daemon: Daemon) -> None:
    assert daemon.get("/healthz", token="bad")[0] == 200
    # /readyz answers a probe without a token (Kubernetes sends none) and then says only whether it is ready
    status, body = daemon.get("/readyz", token="")
    assert status == 200 and json.loads(body) == {"ready": True}
    assert json.loads(daemon.get("/readyz", token="bad")[1]) == {"ready": True}
    assert json.loads(daemon.get("/readyz")[1]) == {"ready": True, "scenarios": {"tiny": "ready"}}
    for path in ("/reef/status", "/v1/models", "/reef/scenarios/tiny/records"):
        status, body = daemon.get(path, token="bad")
        assert status == 401, path
        assert json.loads(body)["error"]["message"] == "invalid API token"
    status, answer, _ = post(daemon, "/v1/messages", {}, token="bad")
    assert status == 401 and answer["error"]["type"] == "authentication_error"
    ok = post(daemon, "/reef/report", {"references": ["x"]},
              headers={"x-api-key": daemon.token, "Authorization": ""})
    assert ok[0] == 404  # authenticated by x-api-key, then the receipt is unknown


def test_records_listing_pages_in_receipt_order(daemon: Daemon, receipt: str) -> None:
    status, body = daemon.get("/reef/scenarios/tiny/records?limit=1")
    page = json.loads(body)
    assert status == 200 and len(page["data"]) == 1
    ids = []
    after = ""
    while True:
        page = json.loads(daemon.get(f"/reef/scenarios/tiny/records?limit=2&after={after}")[1])
        ids += [r["id"] for r in page["data"]]
        if not page["has_more"]:
            break
        after = page["last_id"]
    assert ids == sorted(ids) and receipt in ids
    assert daemon.get("/reef/scenarios/tiny/records?limit=zero")[0] == 400
    assert daemon.get("/reef/scenarios/ghost/records")[0] == 404


def test_numbers_json_cannot_carry_are_400_with_their_path(daemon: Daemon, receipt: str) -> None:
    raw = f'{{"score": 1e400, "references": ["{receipt}"]}}'.encode()
    status, answer, _ = post(daemon, "/reef/report", raw)
    assert status == 400 and answer["error"]["param"] == "score"
    raw = b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "temperature": 1e999}'
    status, answer, _ = post(daemon, "/v1/chat/completions", raw)
    assert status == 400 and answer["error"]["param"] == "temperature"
    huge = "9" * 5000  # past the 4,300 digits Python's int() takes: a 400 naming the field, not a 500
    for path, raw in (("/reef/report", f'{{"score": {huge}, "references": ["{receipt}"]}}'.encode()),
                      ("/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}],'
                                               b' "max_tokens": -' + huge.encode() + b"}")):
        status, answer, _ = post(daemon, path, raw)
        assert status == 400 and "within 64 bits" in answer["error"]["message"], answer
        assert len(answer["error"]["message"]) < 200 and answer["error"]["param"] in ("score", "max_tokens")


def test_undecodable_token_bytes_are_401_not_500(daemon: Daemon) -> None:
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", daemon.port, timeout=10)
    conn.putrequest("GET", "/reef/status")
    conn.putheader("Authorization", b"Bearer \xff\xfe\xfd")
    conn.endheaders()
    resp = conn.getresponse()
    assert resp.status == 401
    conn.close()


def test_an_after_cursor_that_is_no_receipt_is_400(daemon: Daemon) -> None:
    assert daemon.get("/reef/scenarios/tiny/records?after=" + "Z" * 500)[0] == 400
