"""Prometheus metrics at `/metrics`, named as vLLM and SGLang name theirs, with a `reef_` prefix.

Counted as they happen: agent requests by scenario, API and status; time to first token, end-to-end latency and
tokens of every served turn; publish and swap durations. Read from reefd's state at each scrape: each engine's
line (running, waiting, refused), engine restarts, records and reports, the LMDB file's size, jobs by state, train
steps and gate verdicts of the jobs on record, and the release each scenario serves. Labels are scenarios, APIs,
statuses and states, never receipts or sessions: a label value that is not a served scenario is `other`.

Needs `prometheus_client` (`pip install 'reefd[metrics]'`); without it `/metrics` answers 501 saying so.
"""

from __future__ import annotations

import bisect
import os
import threading
import time
from collections.abc import Callable, Collection, Iterator
from pathlib import Path
from typing import Any

try:
    import prometheus_client as prom
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
    from prometheus_client.registry import Collector
except ImportError:  # the `metrics` extra is not installed
    prom = None  # type: ignore[assignment]
    Collector = object  # type: ignore[assignment,misc]

INSTALL_HINT = "pip install 'reefd[metrics]'"
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640)
DURATION_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
OTHER = "other"


class Metrics:
    """The counters and histograms reefd updates, and the scrape-time view of its state (`state`)."""

    def __init__(self, served: Callable[[], Collection[str]]) -> None:
        assert prom is not None
        self.registry = prom.CollectorRegistry()
        self._served = served  # the names of the scenarios served now
        self._snapshot: State | None = None  # what the scrape under way reads
        self._scraping = threading.Lock()
        r = self.registry
        self.turns = Turns()  # the per-turn figures, rendered by _Live from the scrape's copy
        self.publish = prom.Histogram("reef_publish_duration_seconds", "Writing a release to the chain.",
                                      ["scenario"], buckets=DURATION_BUCKETS, registry=r)
        self.swap = prom.Histogram("reef_swap_duration_seconds", "Hot-swapping the serving engine to a release.",
                                   ["scenario"], buckets=DURATION_BUCKETS, registry=r)
        r.register(_Live(self))

    def scenario(self, name: str | None) -> str:
        return name if name is not None and name in self._served() else OTHER

    def request(self, scenario: str | None, api: str, status: int) -> None:
        """An agent API request answered with `status` (`scenario`: the name it gave, if any)."""
        key = (self.scenario(scenario), api, str(status))
        requests = self.turns.requests
        requests[key] = requests.get(key, 0) + 1

    def turn(self, scenario: str, api: str, record: dict[str, Any]) -> None:
        """A served turn, from its record: latency, time to first token, tokens."""
        self.turns.turn(scenario, api, record)

    def timed(self, histogram: Any, scenario: str) -> _Timer:
        return _Timer(histogram.labels(scenario))

    def exposition(self, state: State) -> tuple[bytes, str]:
        """The text format a scraper reads, and its content type. `state` is a snapshot taken on the event loop;
        this runs in a thread (it reads LMDB's counts and the LMDB file's size)."""
        with self._scraping:
            self._snapshot = state
            try:
                return prom.generate_latest(self.registry), prom.CONTENT_TYPE_LATEST
            finally:
                self._snapshot = None


class _Histogram:
    """Bucket counts (not cumulative), their sum and count: a Prometheus histogram as plain numbers."""

    __slots__ = ("buckets", "sum")

    def __init__(self) -> None:
        self.buckets = [0] * (len(LATENCY_BUCKETS) + 1)  # the last one: above every bound (+Inf)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.buckets[bisect.bisect_left(LATENCY_BUCKETS, value)] += 1
        self.sum += value

    def copy(self) -> _Histogram:
        out = _Histogram()
        out.buckets, out.sum = list(self.buckets), self.sum
        return out

    def exposed(self) -> tuple[list[tuple[str, float]], float]:
        """HistogramMetricFamily's buckets (cumulative, by `le`) and sum."""
        total = 0
        out: list[tuple[str, float]] = []
        for bound, n in zip([*map(float, LATENCY_BUCKETS), float("inf")], self.buckets, strict=True):
            total += n
            out.append((prom.utils.floatToGoString(bound), float(total)))
        return out, self.sum


class Turns:
    """The figures every agent request adds, kept as plain numbers on the event loop: a turn costs a few dict
    updates (no lock, no labels() lookup). A scrape renders a copy taken on the loop (`copy`)."""

    def __init__(self) -> None:
        self.requests: dict[tuple[str, str, str], int] = {}  # (scenario, api, status) -> requests
        self.latency: dict[tuple[str, str], _Histogram] = {}  # (scenario, api)
        self.ttft: dict[tuple[str, str], _Histogram] = {}
        self.prompt_tokens: dict[str, int] = {}  # scenario -> tokens
        self.generation_tokens: dict[str, int] = {}

    def turn(self, scenario: str, api: str, record: dict[str, Any]) -> None:
        key = (scenario, api)
        if record.get("latency_s") is not None:
            (self.latency.get(key) or self.latency.setdefault(key, _Histogram())).observe(record["latency_s"])
        if record.get("ttft_s") is not None:
            (self.ttft.get(key) or self.ttft.setdefault(key, _Histogram())).observe(record["ttft_s"])
        usage = record.get("usage") or {}
        self.prompt_tokens[scenario] = self.prompt_tokens.get(scenario, 0) + (usage.get("prompt_tokens") or 0)
        self.generation_tokens[scenario] = self.generation_tokens.get(scenario, 0) + (
            usage.get("completion_tokens") or 0)

    def copy(self) -> Turns:
        out = Turns()
        out.requests, out.prompt_tokens, out.generation_tokens = (
            dict(self.requests), dict(self.prompt_tokens), dict(self.generation_tokens))
        out.latency = {k: h.copy() for k, h in self.latency.items()}
        out.ttft = {k: h.copy() for k, h in self.ttft.items()}
        return out

    def families(self) -> Iterator[Any]:
        requests = CounterMetricFamily("reef_requests", "Agent API requests answered, by final HTTP status.",
                                       labels=["scenario", "api", "status"])
        for labels, n in sorted(self.requests.items()):
            requests.add_metric(list(labels), n)
        yield requests
        for name, doc, histograms in (
                ("reef_time_to_first_token_seconds", "Time to the first streamed token.", self.ttft),
                ("reef_e2e_request_latency_seconds", "Time from request to recorded answer.", self.latency)):
            histogram = HistogramMetricFamily(name, doc, labels=["scenario", "api"])
            for pair, h in sorted(histograms.items()):
                histogram.add_metric(list(pair), *h.exposed())
            yield histogram
        for name, doc, counts in (("reef_prompt_tokens", "Prompt tokens of served turns.", self.prompt_tokens),
                                  ("reef_generation_tokens", "Tokens generated for served turns.",
                                   self.generation_tokens)):
            tokens = CounterMetricFamily(name, doc, labels=["scenario"])
            for scenario, n in sorted(counts.items()):
                tokens.add_metric([scenario], n)
            yield tokens


class _Timer:
    def __init__(self, child: Any) -> None:
        self.child = child

    def __enter__(self) -> None:
        self.start = time.monotonic()

    def __exit__(self, *exc: object) -> None:
        self.child.observe(time.monotonic() - self.start)


class State:
    """What a scrape reads, copied from reefd's registry, engines and jobs on the event loop (reefd/loop.py)."""

    def __init__(self, scenarios: dict[str, Any], lines: dict[str, dict[str, Any]], engines: dict[str, Any],
                 counts: Callable[[], dict[str, dict[str, int]]], lmdb_path: str, jobs: list[Any],
                 turns: Turns | None = None):
        self.scenarios = scenarios  # name -> Scenario
        self.lines = lines  # name -> its engine line's describe(), for scenarios with one
        self.engines = engines  # name -> its engine's describe()
        self.counts = counts
        self.lmdb_path = lmdb_path
        self.jobs = jobs
        self.turns = turns or Turns()  # a copy of Metrics.turns


class _Live(Collector):
    """Gauges and counters read from reefd's state when Prometheus scrapes."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Any]:
        state = self.metrics._snapshot
        if state is None:  # the registry's own check at registration: nothing to read yet
            return
        running = GaugeMetricFamily("reef_num_requests_running", "Requests holding a turn at the engine.",
                                    labels=["scenario"])
        waiting = GaugeMetricFamily("reef_num_requests_waiting", "Requests waiting for a turn at the engine.",
                                    labels=["scenario"])
        refused = CounterMetricFamily("reef_queue_refused", "Requests refused by the engine's line: queue_full "
                                      "(429) or queue_timeout (503).", labels=["scenario", "reason"])
        for name, line in sorted(state.lines.items()):
            running.add_metric([name], line["running"])
            waiting.add_metric([name], line["waiting"])
            for reason in ("queue_full", "queue_timeout"):
                refused.add_metric([name, reason], line["refused"].get(reason, 0))
        restarts = CounterMetricFamily("reef_engine_restarts", "Times reefd restarted an engine process.",
                                       labels=["scenario"])
        for name, engine in sorted(state.engines.items()):
            restarts.add_metric([name], engine.get("restarts") or 0)
        records = CounterMetricFamily("reef_records", "Records stored.", labels=["scenario"])
        reports = CounterMetricFamily("reef_reports", "Reports stored.", labels=["scenario"])
        for name, c in sorted(state.counts().items()):
            records.add_metric([name], c.get("records", 0))
            reports.add_metric([name], c.get("reports", 0))
        size = GaugeMetricFamily("reef_lmdb_size_bytes", "Size of the record store's LMDB file.")
        data = Path(state.lmdb_path) / "data.mdb"
        size.add_metric([], os.path.getsize(data) if data.exists() else 0)
        jobs = GaugeMetricFamily("reef_jobs", "Grow jobs on record, by state.", labels=["scenario", "state"])
        steps = CounterMetricFamily("reef_train_steps", "Optimizer steps of the jobs on record.", labels=["scenario"])
        verdicts = CounterMetricFamily("reef_gate_verdicts", "Gate verdicts of the jobs on record.",
                                       labels=["scenario", "verdict"])
        by_state: dict[tuple[str, str], int] = {}
        by_steps: dict[str, int] = {}
        by_verdict: dict[tuple[str, str], int] = {}
        for job in state.jobs:
            by_state[(job.scenario, job.state)] = by_state.get((job.scenario, job.state), 0) + 1
            step = (job.progress or {}).get("step")
            if isinstance(step, int):
                by_steps[job.scenario] = by_steps.get(job.scenario, 0) + step
            verdict = (job.verdict or {}).get("verdict")
            if verdict in ("pass", "fail"):
                by_verdict[(job.scenario, verdict)] = by_verdict.get((job.scenario, verdict), 0) + 1
        for (scenario, job_state), n in sorted(by_state.items()):
            jobs.add_metric([scenario, job_state], n)
        for scenario, n in sorted(by_steps.items()):
            steps.add_metric([scenario], n)
        for (scenario, verdict), n in sorted(by_verdict.items()):
            verdicts.add_metric([scenario, verdict], n)
        info = GaugeMetricFamily("reef_release_info", "The release each scenario serves (value 1).",
                                 labels=["scenario", "release"])
        for name, scenario in sorted(state.scenarios.items()):
            if scenario.release is not None:
                info.add_metric([name, scenario.release], 1)
        yield from state.turns.families()
        yield from (running, waiting, refused, restarts, records, reports, size, jobs, steps, verdicts, info)
