"""Durable records per second: RecordStore's group commit vs one fsync per record (LMDB, SQLite).

Usage: python bench/records.py [--n 20000] [--concurrency 256] [--baseline-n 3000] [--dir DIR]
All three write the same ~2.5 KB chat records with the same encoding; every write is durable
(fsync) before it counts. The store runs 3 times with records in pieces and 3 times with each record one value
(as before pieces), alternating, and each reports its median run. Run on the real disk: the default dir is
.bench-tmp/ in the repo.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import sqlite3
import struct
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import lmdb

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from reefd.observe.recordcodec import pack as _pack  # noqa: E402  (the store's own encoding)
from reefd.observe.records import RecordStore, new_receipt  # noqa: E402

ROUNDS = 3  # runs of the store, in pieces and whole, alternating; each reports its median run
ANSWER = "Paris. It has been the seat of French kings since the Capetians, and it sits at the heart of the country."


def make_templates(count: int = 16) -> list[dict[str, Any]]:
    """Records shaped like reefd/api/turns.py writes them: a short chat, token ids, float32 logprobs."""
    rng = random.Random(7)
    templates = []
    for i in range(count):
        messages = [{"role": "system", "content": "You are a helpful assistant. Answer briefly."},
                    {"role": "user", "content": f"Question {i}: what is the capital of France, and why?"}]
        n_prompt, n_completion = 40 + rng.randrange(10), 28 + rng.randrange(8)
        usage = {"prompt_tokens": n_prompt, "completion_tokens": n_completion}
        logprobs = [struct.unpack("f", struct.pack("f", -rng.expovariate(3.0)))[0] for _ in range(n_completion)]
        templates.append({
            "scenario": f"bench-{i % 4}", "release": "rel_01JBENCH", "engine": "worker", "model": "smollm2",
            "api": "openai.chat", "created_at": time.time(), "session": f"s-{i}", "tags": {}, "stream": False,
            "request": {"model": "smollm2", "messages": messages, "temperature": 0.7, "max_tokens": 64},
            "messages": [*messages, {"role": "assistant", "content": ANSWER}], "tools": None,
            "response": {"id": f"chatcmpl-{i}", "object": "chat.completion", "model": "smollm2",
                         "choices": [{"index": 0, "finish_reason": "stop",
                                      "message": {"role": "assistant", "content": ANSWER}}], "usage": usage},
            "finish_reason": "stop", "stop_sequence": None, "raw_text": ANSWER,
            "prompt_token_ids": [rng.randrange(49152) for _ in range(n_prompt)],
            "completion_token_ids": [rng.randrange(49152) for _ in range(n_completion)],
            "completion_logprobs": logprobs, "usage": usage,
            "latency_s": round(rng.uniform(0.2, 0.9), 6), "ttft_s": None, "finished_at": time.time(),
        })
    return templates


def bench_group_commit(path: str, templates: list[dict[str, Any]], n: int, concurrency: int,
                       whole: bool = False) -> dict[str, Any]:
    """`whole`: each record as one value, as the store wrote them before pieces (reefd/observe/pieces.py)."""
    async def main() -> dict[str, Any]:
        store = RecordStore(path, map_size=1 << 28, whole=whole)
        await store.open()
        receipts: list[str] = []

        async def client(k: int) -> None:
            for i in range(k, n, concurrency):
                record = dict(templates[i % len(templates)], id=new_receipt())
                await store.put_record(record)
                receipts.append(record["id"])

        start = time.perf_counter()
        await asyncio.gather(*(client(k) for k in range(concurrency)))
        elapsed = time.perf_counter() - start
        missing = sum(store.get_record(r) is None for r in receipts[:: max(1, n // 1000)])
        stats = dict(store.stats)
        await store.close()
        if missing or len(receipts) != n:
            raise SystemExit(f"group commit lost records: {missing} missing of a sample, {len(receipts)}/{n}")
        return {"rps": n / elapsed, "seconds": elapsed, **stats}

    return asyncio.run(main())


def bench_lmdb_per_record(path: str, templates: list[dict[str, Any]], n: int) -> dict[str, Any]:
    env = lmdb.open(path, map_size=1 << 28, max_dbs=4, sync=True, metasync=True)
    records, by_scenario = env.open_db(b"records"), env.open_db(b"by_scenario")
    start = time.perf_counter()
    for i in range(n):
        record = dict(templates[i % len(templates)], id=new_receipt())
        key = record["id"].encode()
        with env.begin(write=True) as txn:  # one transaction, one fsync, per record
            txn.put(key, _pack(record), db=records)
            txn.put(record["scenario"].encode() + b"\0" + key, b"", db=by_scenario)
    elapsed = time.perf_counter() - start
    env.close()
    return {"rps": n / elapsed, "seconds": elapsed}


def bench_sqlite_full(path: str, templates: list[dict[str, Any]], n: int) -> dict[str, Any]:
    db = sqlite3.connect(os.path.join(path, "records.sqlite"), isolation_level=None)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=FULL")
    db.execute("CREATE TABLE records (id TEXT PRIMARY KEY, scenario TEXT NOT NULL, body BLOB NOT NULL)")
    db.execute("CREATE INDEX by_scenario ON records (scenario, id)")
    start = time.perf_counter()
    for i in range(n):
        record = dict(templates[i % len(templates)], id=new_receipt())
        db.execute("BEGIN")
        db.execute("INSERT INTO records VALUES (?, ?, ?)", (record["id"], record["scenario"], _pack(record)))
        db.execute("COMMIT")  # synchronous=FULL: the WAL is fsynced at every commit
    elapsed = time.perf_counter() - start
    db.close()
    return {"rps": n / elapsed, "seconds": elapsed}


def filesystem(path: str) -> str:
    """The filesystem type holding `path` (from /proc/mounts): a tmpfs would make fsync free."""
    best, kind = "", "unknown"
    with contextlib.suppress(OSError), open("/proc/mounts") as mounts:
        for line in mounts:
            mount, fstype = line.split()[1:3]
            if (path + "/").startswith(mount.rstrip("/") + "/") and len(mount) > len(best):
                best, kind = mount, fstype
    return kind


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=20000, help="records through RecordStore")
    parser.add_argument("--concurrency", type=int, default=256, help="concurrent put_record callers")
    parser.add_argument("--baseline-n", type=int, default=3000, help="records through each per-record baseline")
    parser.add_argument("--dir", default=str(ROOT / ".bench-tmp"), help="parent of the temp dir (real disk)")
    args = parser.parse_args()

    templates = make_templates()
    size = sum(len(json.dumps(t, separators=(",", ":"))) for t in templates) / len(templates)
    stored = sum(len(_pack(t)) for t in templates) / len(templates)
    created = not os.path.exists(args.dir)
    os.makedirs(args.dir, exist_ok=True)
    work = tempfile.mkdtemp(prefix="records-", dir=args.dir)
    fs = filesystem(os.path.realpath(work))
    if fs in ("tmpfs", "ramfs"):
        print(f"warning: {args.dir} is on {fs}: fsync costs nothing there, so the ratios mean little")
    try:
        runs: dict[bool, list[dict[str, Any]]] = {False: [], True: []}  # whole -> its runs
        for i in range(ROUNDS):  # alternating, each first in turn: a busy machine slows both alike
            for whole in (False, True) if i % 2 == 0 else (True, False):
                runs[whole].append(bench_group_commit(os.path.join(work, f"{whole}-{i}"), templates, args.n,
                                                      args.concurrency, whole=whole))
        group, whole = (sorted(runs[w], key=lambda r: r["rps"])[ROUNDS // 2] for w in (False, True))  # medians
        fsync = bench_lmdb_per_record(os.path.join(work, "fsync"), templates, min(args.n, args.baseline_n))
        sqlite = bench_sqlite_full(work, templates, min(args.n, args.baseline_n))
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if created:
            with contextlib.suppress(OSError):  # another bench may be using it by now
                os.rmdir(args.dir)

    ratio_fsync, ratio_sqlite = group["rps"] / fsync["rps"], group["rps"] / sqlite["rps"]
    print(f"records: {size:.0f} B of JSON each, {stored:.0f} B stored (zlib); dir {args.dir} ({fs})")
    print(f"{'writer':44} {'records':>8} {'seconds':>8} {'records/s':>10}")
    label = f"RecordStore group commit (c={args.concurrency})"
    print(f"{label:44} {args.n:8d} {group['seconds']:8.2f} {group['rps']:10.0f}")
    print(f"{'  the same, each record one value (before)':44} {args.n:8d} {whole['seconds']:8.2f} {whole['rps']:10.0f}")
    print(f"{'LMDB, one txn + fsync per record':44} {min(args.n, args.baseline_n):8d} "
          f"{fsync['seconds']:8.2f} {fsync['rps']:10.0f}")
    print(f"{'SQLite WAL synchronous=FULL, commit per record':44} {min(args.n, args.baseline_n):8d} "
          f"{sqlite['seconds']:8.2f} {sqlite['rps']:10.0f}")
    print(f"group commit: {group['commits']} commits for {group['ops']} records "
          f"(mean batch {group['ops'] / group['commits']:.1f}, largest {group['largest_batch']})")
    print(f"records in pieces against each record one value (the store before pieces): "
          f"{group['rps'] / whole['rps']:.2f}x (goal: not lower)")
    print(f"ratio vs per-record fsync: {ratio_fsync:.1f}x   vs SQLite FULL: {ratio_sqlite:.1f}x   "
          f"(goals: >= 20000 records/s, >= 5x both)")
    print(json.dumps({
        "bench": "records", "group_commit_rps": round(group["rps"]), "per_record_fsync_rps": round(fsync["rps"]),
        "sqlite_full_rps": round(sqlite["rps"]), "ratio_vs_fsync": round(ratio_fsync, 2),
        "ratio_vs_sqlite": round(ratio_sqlite, 2), "goal_rps": 20000, "goal_ratio": 5,
        "whole_values_rps": round(whole["rps"]), "pieces_vs_whole": round(group["rps"] / whole["rps"], 2),
    }))


if __name__ == "__main__":
    main()
