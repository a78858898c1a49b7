"""`/metrics`: Prometheus text with vLLM/SGLang-style names, behind the token, never labelled by receipt."""

from __future__ import annotations

import re
import socket
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import Daemon, base_release, make_scenarios, sdk

FAMILIES = {"reef_requests", "reef_time_to_first_token_seconds", "reef_e2e_request_latency_seconds",
            "reef_prompt_tokens", "reef_generation_tokens", "reef_num_requests_running", "reef_num_requests_waiting",
            "reef_queue_refused", "reef_engine_restarts", "reef_records", "reef_reports", "reef_lmdb_size_bytes",
            "reef_jobs", "reef_train_steps", "reef_gate_verdicts", "reef_publish_duration_seconds",
            "reef_swap_duration_seconds", "reef_release_info"}


def scrape(url: str, token: str | None) -> dict[str, list[tuple[str, dict[str, str], float]]]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=30) as r:
        assert r.headers["Content-Type"].startswith("text/plain; version=")
        text = r.read().decode()
    return {f.name: [(s.name, s.labels, s.value) for s in f.samples] for f in text_string_to_metric_families(text)}


def value(families: dict[str, list[tuple[str, dict[str, str], float]]], sample: str, **labels: str) -> float:
    family = re.sub(r"_(total|count|sum|bucket)$", "", sample)
    return sum(v for name, got, v in families.get(family, []) if name == sample
               and all(got.get(k) == want for k, want in labels.items()))


def test_metrics_count_what_was_served_by_scenario_api_and_status(daemon: Daemon) -> None:
    client = sdk(openai.OpenAI(base_url=daemon.url + "/v1", api_key=daemon.token, max_retries=0,
                               default_headers={"x-reef-scenario": "tiny"}))
    before = scrape(daemon.url + "/metrics", daemon.token)
    raw = client.chat.completions.with_raw_response.create(model="tiny", max_tokens=4,
                                                           messages=[{"role": "user", "content": "hi"}])
    receipt = raw.headers["x-reef-agent-record-id"]
    for _ in client.chat.completions.create(model="tiny", max_tokens=4, stream=True,
                                            messages=[{"role": "user", "content": "hi"}]):
        pass
    bad = sdk(openai.OpenAI(base_url=daemon.url + "/v1", api_key=daemon.token, max_retries=0,
                            default_headers={"x-reef-scenario": "no-such-scenario-" + receipt}))
    with pytest.raises(openai.NotFoundError):
        bad.chat.completions.create(model="x", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    after = scrape(daemon.url + "/metrics", daemon.token)
    assert set(after) >= FAMILIES, FAMILIES - set(after)
    ok = {"scenario": "tiny", "api": "openai.chat_completions", "status": "200"}
    assert value(after, "reef_requests_total", **ok) - value(before, "reef_requests_total", **ok) == 2
    assert value(after, "reef_requests_total", scenario="other", status="404") >= 1  # never the header's value
    for sample in ("reef_e2e_request_latency_seconds_count", "reef_prompt_tokens_total"):
        assert value(after, sample, scenario="tiny") > value(before, sample, scenario="tiny")
    assert value(after, "reef_time_to_first_token_seconds_count", scenario="tiny") >= 1
    assert value(after, "reef_generation_tokens_total", scenario="tiny") >= value(before,
                                                                                   "reef_generation_tokens_total",
                                                                                   scenario="tiny") + 2
    assert value(after, "reef_records_total", scenario="tiny") >= 2
    assert value(after, "reef_lmdb_size_bytes") > 0
    assert value(after, "reef_release_info", scenario="tiny", release=base_release(daemon)) == 1
    assert value(after, "reef_num_requests_running", scenario="tiny") == 0
    labels = {v for samples in after.values() for _, got, _ in samples for v in got.values()}
    assert receipt not in labels and not any(receipt in v for v in labels)
    assert not {k for samples in after.values() for _, got, _ in samples for k in got} & {"receipt", "session"}


def test_metrics_need_the_token_on_the_main_port(daemon: Daemon) -> None:
    try:
        urllib.request.urlopen(daemon.url + "/metrics", timeout=30)
        raise AssertionError("/metrics answered without a token")
    except urllib.error.HTTPError as exc:
        assert exc.code == 401


def test_a_metrics_address_that_is_taken_stops_reefd_with_a_line(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        d = Daemon(scenarios=make_scenarios(tmp_path / "s"), state=tmp_path / "state", log_path=tmp_path / "log",
                   env={"REEF_METRICS_LISTEN": f"127.0.0.1:{port}"})
        d.start(wait_ready=False)
        assert d.proc is not None and d.proc.wait(120) == 1
    assert "cannot serve metrics on REEF_METRICS_LISTEN" in d.logs()
    bad = Daemon(scenarios=make_scenarios(tmp_path / "s2"), state=tmp_path / "state2", log_path=tmp_path / "log2",
                 env={"REEF_METRICS_LISTEN": "nowhere"})
    bad.start(wait_ready=False)
    assert bad.proc is not None and bad.proc.wait(60) == 2
    assert "REEF_METRICS_LISTEN: 'nowhere' is not HOST:PORT" in bad.logs()
