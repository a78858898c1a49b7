"""Retention of 100k records: how fast a sweep deletes them in batches, and what the event loop and writes feel.

Usage: python bench/retention.py [--n 100000] [--keep 1000] [--dir DIR]
Fills one scenario with --n records shaped like real ones (bench/records.py's), a report on every 50th, then
sweeps it down to --keep with max_records. Side by side in the same run: the insert rate (the baseline for the
delete rate), and the event loop's lateness and a steady writer's put latency with the store idle, then during
the sweep. Prints a text summary and one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.records import filesystem, make_templates  # noqa: E402
from reefd.commit.chain import ReleaseChain  # noqa: E402
from reefd.config import RetentionConfig, ScenarioConfig  # noqa: E402
from reefd.grow.job_store import JobStore  # noqa: E402
from reefd.observe.records import RecordStore, new_receipt  # noqa: E402
from reefd.observe.retention import Retention  # noqa: E402

TICK_S = 0.002


class Probe:
    """While running: how late the event loop wakes a 2 ms sleeper, and how long a put_record every 10 ms takes."""

    def __init__(self, store: RecordStore, template: dict[str, Any]) -> None:
        self.store, self.template = store, template
        self.lateness: list[float] = []
        self.puts: list[float] = []
        self._stop = asyncio.Event()

    async def _ticker(self) -> None:
        while not self._stop.is_set():
            start = time.perf_counter()
            await asyncio.sleep(TICK_S)
            self.lateness.append(time.perf_counter() - start - TICK_S)

    async def _writer(self) -> None:
        while not self._stop.is_set():
            start = time.perf_counter()
            await self.store.put_record(dict(self.template, id=new_receipt(), scenario="other"))
            self.puts.append(time.perf_counter() - start)
            await asyncio.sleep(0.01)

    async def during(self, work: Any) -> Any:
        tasks = [asyncio.create_task(self._ticker()), asyncio.create_task(self._writer())]
        try:
            return await work
        finally:
            self._stop.set()
            await asyncio.gather(*tasks)

    def summary(self) -> dict[str, float]:
        late = sorted(self.lateness)
        return {"loop_max_ms": late[-1] * 1000, "loop_p99_ms": late[int(len(late) * 0.99)] * 1000,
                "put_p50_ms": statistics.median(self.puts) * 1000, "put_max_ms": max(self.puts) * 1000,
                "ticks": len(late)}


async def run(path: Path, n: int, keep: int, batch: int) -> dict[str, Any]:
    templates = [dict(t, scenario="bench") for t in make_templates()]
    store = RecordStore(path / "records", map_size=1 << 30)
    await store.open()
    try:
        receipts: list[str] = []

        async def client(k: int, concurrency: int) -> None:
            for i in range(k, n, concurrency):
                record = dict(templates[i % len(templates)], id=new_receipt())
                await store.put_record(record)
                receipts.append(record["id"])

        start = time.perf_counter()
        await asyncio.gather(*(client(k, 256) for k in range(256)))
        insert_s = time.perf_counter() - start
        receipts.sort()
        for i in range(0, n, 50):
            await store.put_report("bench", {"references": [receipts[i]], "score": 1.0})

        idle = Probe(store, templates[0])
        await idle.during(asyncio.sleep(2.0))
        chain = ReleaseChain(path / "releases.git")
        registry = SimpleNamespace(scenarios={"bench": SimpleNamespace(
            cfg=ScenarioConfig(name="bench", retention=RetentionConfig(max_records=keep)))})
        retention = Retention(registry, store, chain, JobStore(path / "jobs"))  # type: ignore[arg-type]
        retention.BATCH = batch
        busy = Probe(store, templates[0])
        start = time.perf_counter()
        deleted = await busy.during(retention.sweep("bench"))
        sweep_s = time.perf_counter() - start
        counts = store.counts()["bench"]
        if deleted != n - keep or counts["records"] != keep:
            raise SystemExit(f"retention deleted {deleted} of {n - keep}; {counts} left")
        return {"n": n, "kept": keep, "batch": batch, "deleted": deleted, "reports_left": counts["reports"],
                "insert_rps": n / insert_s, "delete_rps": deleted / sweep_s, "sweep_s": sweep_s,
                "delete_vs_insert": (deleted / sweep_s) / (n / insert_s),
                "idle": idle.summary(), "sweep": busy.summary()}
    finally:
        await store.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=100_000, help="records to fill the scenario with")
    parser.add_argument("--keep", type=int, default=1000, help="retention.max_records")
    parser.add_argument("--batch", type=int, default=Retention.BATCH, help="records deleted per transaction")
    parser.add_argument("--dir", default=str(ROOT / ".bench-tmp"), help="parent of the temp dir (real disk)")
    args = parser.parse_args()
    Path(args.dir).mkdir(parents=True, exist_ok=True)
    path = Path(tempfile.mkdtemp(dir=args.dir))
    try:
        out = asyncio.run(run(path, args.n, args.keep, args.batch))
    finally:
        shutil.rmtree(path, ignore_errors=True)
    out["filesystem"] = filesystem(str(path))
    idle, busy = out["idle"], out["sweep"]
    print(f"retention: deleted {out['deleted']:,} of {out['n']:,} records in {out['sweep_s']:.2f} s "
          f"({out['delete_rps']:,.0f}/s; inserting them ran at {out['insert_rps']:,.0f}/s: "
          f"x{out['delete_vs_insert']:.2f}), {out['batch']} per transaction, on {out['filesystem']}")
    print(f"event loop lateness (2 ms sleeper): idle max {idle['loop_max_ms']:.1f} ms p99 {idle['loop_p99_ms']:.1f} ms"
          f"; during the sweep max {busy['loop_max_ms']:.1f} ms p99 {busy['loop_p99_ms']:.1f} ms")
    print(f"a put_record every 10 ms: idle p50 {idle['put_p50_ms']:.1f} ms max {idle['put_max_ms']:.1f} ms; during "
          f"the sweep p50 {busy['put_p50_ms']:.1f} ms max {busy['put_max_ms']:.1f} ms")
    print(json.dumps({"bench": "retention", **out}))


if __name__ == "__main__":
    main()
