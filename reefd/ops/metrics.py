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
import itertools
import os
import threading
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
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

    def timed(self, histogram: Any, scenario: str) -> Any:
        """A block whose duration `histogram` observes (prometheus_client's own timer)."""
        return histogram.labels(scenario).time()

    def exposition(self, state: State) -> tuple[bytes, str]:
        """The text format a scraper reads, and its content type. `state` is a snapshot taken on the event loop;
        this runs in a thread (it reads LMDB's counts and the LMDB file's size)."""
        with self._scraping:
            self._snapshot = state
            try:
                return prom.generate_latest(self.registry), prom.CONTENT_TYPE_LATEST
            finally:
                self._snapshot = None


SECONDS = {"ttft_s": ("reef_time_to_first_token_seconds", "Time to the first streamed token."),
           "latency_s": ("reef_e2e_request_latency_seconds", "Time from request to recorded answer.")}
TOKENS = {"prompt_tokens": ("reef_prompt_tokens", "Prompt tokens of served turns."),
          "completion_tokens": ("reef_generation_tokens", "Tokens generated for served turns.")}


class Turns:
    """The figures every agent request adds, kept as plain numbers on the event loop: a turn costs a few dict
    updates (no lock, no labels() lookup). A scrape renders a copy taken on the loop (`copy.deepcopy`)."""

    def __init__(self) -> None:
        self.requests: dict[tuple[str, str, str], int] = {}  # (scenario, api, status) -> requests
        self.seconds: dict[tuple[str, str, str], list[float]] = {}  # (field, scenario, api) -> buckets, then sum
        self.tokens: dict[tuple[str, str], int] = {}  # (usage field, scenario) -> tokens

    def turn(self, scenario: str, api: str, record: dict[str, Any]) -> None:
        for field in SECONDS:
            if (value := record.get(field)) is not None:
                key = (field, scenario, api)
                h = self.seconds.get(key) or self.seconds.setdefault(key, [0.0] * (len(LATENCY_BUCKETS) + 2))
                h[bisect.bisect_left(LATENCY_BUCKETS, value)] += 1  # the bucket after the last bound: +Inf
                h[-1] += value
        usage = record.get("usage") or {}
        for field in TOKENS:
            self.tokens[(field, scenario)] = self.tokens.get((field, scenario), 0) + (usage.get(field) or 0)

    def families(self) -> Iterator[Any]:
        yield _family(CounterMetricFamily, "reef_requests", "Agent API requests answered, by final HTTP status.",
                      ["scenario", "api", "status"], self.requests)
        bounds = [prom.utils.floatToGoString(b) for b in [*LATENCY_BUCKETS, float("inf")]]
        for field, (name, doc) in SECONDS.items():
            histogram = HistogramMetricFamily(name, doc, labels=["scenario", "api"])
            for (of, scenario, api), h in sorted(self.seconds.items()):
                if of == field:
                    histogram.add_metric([scenario, api], list(zip(bounds, itertools.accumulate(h[:-1]),
                                                                   strict=True)), h[-1])
            yield histogram
        for field, (name, doc) in TOKENS.items():
            yield _family(CounterMetricFamily, name, doc, ["scenario"],
                          {(scenario,): n for (of, scenario), n in self.tokens.items() if of == field})


class State:
    """What a scrape reads, copied from reefd's registry, engines and jobs on the event loop (reefd/loop.py)."""

    def __init__(self, scenarios: dict[str, Any], lines: dict[str, dict[str, Any]], engines: dict[str, Any],
                 counts: Callable[[], dict[str, dict[str, int]]], lmdb_path: str, jobs: list[Any],
                 turns: Turns | None = None, practice: dict[str, dict[str, Any]] | None = None):
        self.scenarios = scenarios  # name -> Scenario
        self.lines = lines  # name -> its engine line's describe(), for scenarios with one
        self.engines = engines  # name -> its engine's describe()
        self.counts = counts
        self.lmdb_path = lmdb_path
        self.jobs = jobs
        self.turns = turns or Turns()  # a copy of Metrics.turns
        self.practice = practice or {}  # name -> what its practice did (Practice.status), for scenarios with one


class _Live(Collector):
    """Gauges and counters read from reefd's state when Prometheus scrapes."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Any]:
        state = self.metrics._snapshot
        if state is None:  # the registry's own check at registration: nothing to read yet
            return
        yield from state.turns.families()
        lines, counts = state.lines.items(), state.counts().items()
        yield _family(GaugeMetricFamily, "reef_num_requests_running", "Requests holding a turn at the engine.",
                      ["scenario"], {(name,): line["running"] for name, line in lines})
        yield _family(GaugeMetricFamily, "reef_num_requests_waiting", "Requests waiting for a turn at the engine.",
                      ["scenario"], {(name,): line["waiting"] for name, line in lines})
        yield _family(CounterMetricFamily, "reef_queue_refused", "Requests refused by the engine's line: queue_full "
                      "(429) or queue_timeout (503).", ["scenario", "reason"],
                      {(name, why): line["refused"].get(why, 0) for name, line in lines
                       for why in ("queue_full", "queue_timeout")})
        yield _family(CounterMetricFamily, "reef_engine_restarts", "Times reefd restarted an engine process.",
                      ["scenario"], {(name,): e.get("restarts") or 0 for name, e in state.engines.items()})
        yield _family(CounterMetricFamily, "reef_records", "Records of served turns stored.", ["scenario"],
                      {(name,): c.get("records", 0) - c.get("practice_records", 0) for name, c in counts})
        yield _family(CounterMetricFamily, "reef_reports", "Reports on served turns stored.", ["scenario"],
                      {(name,): c.get("reports", 0) - c.get("practice_reports", 0) for name, c in counts})
        yield from _practice(state.practice, counts)
        size = GaugeMetricFamily("reef_lmdb_size_bytes", "Size of the record store's LMDB file.")
        data = Path(state.lmdb_path) / "data.mdb"
        size.add_metric([], os.path.getsize(data) if data.exists() else 0)
        yield size
        steps: Counter[tuple[str, ...]] = Counter()
        for job in state.jobs:
            if isinstance(step := (job.progress or {}).get("step"), int):
                steps[(job.scenario,)] += step
        yield _family(GaugeMetricFamily, "reef_jobs", "Grow jobs on record, by state.", ["scenario", "state"],
                      Counter((job.scenario, job.state) for job in state.jobs))
        yield _family(CounterMetricFamily, "reef_train_steps", "Optimizer steps of the jobs on record.",
                      ["scenario"], steps)
        verdicts = Counter((job.scenario, v) for job in state.jobs
                           if (v := (job.verdict or {}).get("verdict")) in ("pass", "fail"))
        yield _family(CounterMetricFamily, "reef_gate_verdicts", "Gate verdicts of the jobs on record.",
                      ["scenario", "verdict"], verdicts)
        yield _family(GaugeMetricFamily, "reef_release_info", "The release each scenario serves (value 1).",
                      ["scenario", "release"], {(name, s.release): 1 for name, s in state.scenarios.items()
                                                if s.release is not None})


def _practice(practice: dict[str, dict[str, Any]], counts: Iterable[tuple[str, dict[str, int]]]) -> Iterator[Any]:
    """Practice, apart from served traffic: its stored records and verdicts, and what its rounds did since start."""
    stored = list(counts)
    yield _family(CounterMetricFamily, "reef_practice_records", "Practice records stored.", ["scenario"],
                  {(name,): c.get("practice_records", 0) for name, c in stored if c.get("practice_records")})
    yield _family(CounterMetricFamily, "reef_practice_answers", "Practice answers generated since start.",
                  ["scenario"], {(name,): p.get("answers", 0) for name, p in practice.items()})
    yield _family(CounterMetricFamily, "reef_practice_verdicts", "Practice verifications since start: passed, "
                  "failed (a wrong answer), error (the verifier's own failure, also counted as failed).",
                  ["scenario", "verdict"], {(name, v): p.get(key, 0) for name, p in practice.items()
                                            for v, key in (("passed", "passed"), ("failed", "failed"),
                                                           ("error", "verifier_errors"))})
    yield _family(GaugeMetricFamily, "reef_practice_generating", "Practice answers holding an engine turn.",
                  ["scenario"], {(name,): p.get("generating", 0) for name, p in practice.items()})


def _family(kind: Any, name: str, doc: str, labels: list[str], values: Mapping[Any, float]) -> Any:
    """A metric family of `kind` with one sample per label values, in their order."""
    family = kind(name, doc, labels=labels)
    for key, value in sorted(values.items()):
        family.add_metric(list(key), value)
    return family
