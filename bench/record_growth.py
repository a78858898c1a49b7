"""What a session's records cost: bytes stored against the final transcript, for sessions of 20, 60 and 200 turns,
shaped as reefd writes them on the upstream engine (no token ids) and on the worker (SmolLM2's token ids for the
prompt, which extends the last turn's), with records in pieces (reefd/observe/pieces.py) against each record as
one value, the store before pieces, in the same run. Also the time to read the last record of the longest
session, against a record of one turn holding the same transcript, and against a one-turn session's record.

Each turn adds a 3 KB user message of English-like text to the transcript and resends it whole, with a 4 KB
system prompt and four tools, as a coding agent does. The store is the real one (LMDB, group commit); the
sizes are the bytes of every value in its records, links and pieces tables.

The upstream sessions are also sent through a real reefd (a loopback provider answers each turn with a tool call,
and the next turn adds the tool's 3 KB result), with REEF_RECORDS=whole for the store before pieces; the bytes
are those of its store once it stopped. The worker's sessions are measured in the store alone: a 200-turn prompt
(140k tokens) is beyond the tiny model's context (65,536 tokens), and SmolLM2's (8,192).

Run: python bench/record_growth.py [--turns 20,60,200] [--no-reefd]   (in make bench; a few minutes)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import lmdb
import orjson
from _harness import ROOT, scratch_dir, smollm2_folder, start_reefd, start_upstream, upstream_scenario

sys.path.insert(0, str(ROOT))

from reefd.observe.records import RecordStore, new_receipt
from tests.test_pieces import session, text


def tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_folder()))


def with_ids(turns: list[dict[str, Any]], tok: Any) -> list[dict[str, Any]]:
    """The worker's records: the prompt's ids, each turn's the last one's plus its reply's and the new message's."""
    ids: list[int] = tok.encode(turns[0]["request"]["messages"][0]["content"])
    for rec in turns:
        ids = ids + tok.encode(rec["request"]["messages"][-1]["content"])
        rec["prompt_token_ids"] = ids
        rec["completion_token_ids"] = tok.encode(rec["raw_text"])
        rec["completion_logprobs"] = [-0.25] * len(rec["completion_token_ids"])
        ids = ids + rec["completion_token_ids"]
    return turns


async def measure(path: Path, turns: list[dict[str, Any]], whole: bool) -> tuple[int, float, float]:
    """(bytes stored, median read of the last record, median read of a one-turn record) in ms."""
    store = RecordStore(path, whole=whole)
    await store.open()
    try:
        for rec in turns:
            await store.put_record(rec)
        with store._reading() as txn:
            size = sum(len(v) for t in ("records", "links", "pieces", "piece_refs")
                       for _, v in txn.cursor(db=store._dbs[t]))
        single = {**turns[-1], "id": new_receipt(), "session": "another"}
        await store.put_record(single)  # the same transcript as the only turn of a session (not in `size`)

        def timed(receipt: str) -> float:
            runs = []
            for _ in range(20):
                t0 = time.perf_counter()
                store.get_record(receipt)
                runs.append((time.perf_counter() - t0) * 1000)
            return statistics.median(runs)

        return size, timed(turns[-1]["id"]), timed(single["id"])
    finally:
        await store.close()


def through_reefd(tmp: Path, n: int, whole: bool) -> tuple[int, int]:
    """A session of `n` turns sent through a real reefd on the upstream engine (a loopback provider that answers
    each turn with a tool call): each turn adds the tool's 3 KB result and resends the transcript, with the same
    system prompt and tools as the store-level sessions. Returns (bytes of the store's records, links and pieces
    once reefd stopped, bytes of the final transcript). `whole`: reefd with REEF_RECORDS=whole."""
    import openai

    rng = random.Random(0)
    first = session(1, tokens=False)[0]
    tools, messages = first["tools"], list(first["request"]["messages"])
    upstream, url = start_upstream()
    try:
        d = start_reefd(tmp, {"up": upstream_scenario(url)},
                        env={"UP_KEY": "up-key", **({"REEF_RECORDS": "whole"} if whole else {})})
        try:
            client = openai.OpenAI(base_url=d.url + "/v1", api_key=d.token, max_retries=0,
                                   default_headers={"x-reef-scenario": "up"})
            for _ in range(n):
                reply = client.chat.completions.create(model="up", messages=messages, tools=tools)
                call = reply.choices[0].message.model_dump(exclude_none=True)
                messages = [*messages, call, {"role": "tool", "tool_call_id": call["tool_calls"][0]["id"],
                                              "content": text(rng, 3000)}]
            client.close()
        finally:
            d.stop()
    finally:
        upstream.terminate()
        upstream.wait()
    env = lmdb.open(str(tmp / "state" / "records"), max_dbs=32, readonly=True, lock=False)
    try:
        with env.begin() as txn:
            size = sum(len(v) for t in ("records", "links", "pieces", "piece_refs")
                       for _, v in txn.cursor(db=env.open_db(t.encode(), txn=txn, create=False)))
    finally:
        env.close()
    return size, len(orjson.dumps(messages[:-1]))  # the last tool result was never sent


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--turns", default="20,60,200")
    parser.add_argument("--no-reefd", dest="reefd", action="store_false",
                        help="skip the sessions sent through a real reefd (upstream engine)")
    args = parser.parse_args()
    tok = tokenizer()
    rows: list[dict[str, Any]] = []
    daemon_rows: list[dict[str, Any]] = []
    tmp = scratch_dir()
    try:
        for n in [int(x) for x in args.turns.split(",")]:
            for engine in ("upstream", "worker"):
                turns = session(n, tokens=False)
                if engine == "worker":
                    turns = with_ids(turns, tok)
                final = len(orjson.dumps(turns[-1]["messages"]))
                got = {}
                for whole in (True, False):
                    size, last_ms, single_ms = asyncio.run(measure(tmp / f"{engine}-{n}-{whole}", turns, whole))
                    got[whole] = (size, last_ms, single_ms)
                before, after = got[True], got[False]
                rows.append({"turns": n, "engine": engine, "final_transcript_b": final,
                             "before_ratio": round(before[0] / final, 2), "after_ratio": round(after[0] / final, 2),
                             "read_last_ms": round(after[1], 3), "read_same_in_one_turn_ms": round(after[2], 3),
                             "read_last_before_ms": round(before[1], 3)})
            if args.reefd:
                (was, final), (now, _) = (through_reefd(tmp / f"reefd-{n}-{w}", n, w) for w in (True, False))
                daemon_rows.append({"turns": n, "engine": "upstream, through reefd", "final_transcript_b": final,
                                    "before_ratio": round(was / final, 2), "after_ratio": round(now / final, 2)})
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"{'turns':>5} {'engine':>8} {'transcript':>11} {'before':>8} {'after':>7} {'read last':>10} "
          f"{'same, 1 turn':>13} {'before':>8}")
    for r in rows:
        print(f"{r['turns']:5d} {r['engine']:>8} {r['final_transcript_b'] / 1000:9.0f}KB {r['before_ratio']:7.1f}x "
              f"{r['after_ratio']:6.2f}x {r['read_last_ms']:8.2f}ms {r['read_same_in_one_turn_ms']:11.2f}ms "
              f"{r['read_last_before_ms']:6.2f}ms")
    for r in daemon_rows:
        print(f"{r['turns']:5d} {'upstream':>8} {r['final_transcript_b'] / 1000:9.0f}KB {r['before_ratio']:7.1f}x "
              f"{r['after_ratio']:6.2f}x   (the session sent through reefd)")
    longest = max(rows, key=lambda r: r["turns"])
    print(json.dumps({"bench": "record_growth", "rows": rows, "through_reefd": daemon_rows, "goal_ratio": 1.5,
                      "max_after_ratio": max(r["after_ratio"] for r in rows + daemon_rows),
                      "read_last_vs_one_turn": round(longest["read_last_ms"] / longest["read_same_in_one_turn_ms"],
                                                     2),
                      "read_last_vs_before": round(longest["read_last_ms"] / longest["read_last_before_ms"], 2)}))


if __name__ == "__main__":
    main()
