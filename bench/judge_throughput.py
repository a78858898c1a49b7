"""Judge throughput on the tiny model, and the bytes a top-K capture adds to a record.

A real reefd serves the tiny model with `openclaw-rl` (manual trigger, so nothing trains) and the scenario's own
engine as the judge: m = 3 verdict votes and 3 hint votes per turn, `max_tokens` per vote. Clients send
two-turn conversations with a session header, so each conversation links one turn; the judge's window runs from
the start of its first judgment to the last one stored (it overlaps the serving of later conversations, which
competes with it for the engine, so the figure is conservative). Baseline, in the same run: the same number
of plain chat completions (6 per judgment, same `max_tokens`, same concurrency) straight through the API; the
ratio is the judge's time over the baseline's.

It also reads a judged record back and measures what its top-K capture adds when packed (recordcodec), per
1,000 generated tokens.

Run: python bench/judge_throughput.py [--turns 48] [--judge-tokens 16]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import time

import openai
from _harness import Daemon, scratch_dir

from reefd.observe.recordcodec import pack
from tests.conftest import make_scenarios

SCENARIO = """defaults:
  - model: tiny
  - recipe: openclaw-rl
  - trigger: manual
  - gate: always
  - release: follow
  - _self_
recipe:
  params:
    top_k: 4
    judge: {{model: null, votes: 3, max_tokens: {tokens}, concurrency: {concurrency}}}
serve:
  default_max_tokens: 16
"""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--turns", type=int, default=48, help="linked turns to judge")
    p.add_argument("--judge-tokens", type=int, default=16, help="max tokens per judge vote")
    p.add_argument("--concurrency", type=int, default=4, help="turns judged at once")
    args = p.parse_args()
    tmp = scratch_dir()
    d = Daemon(scenarios=make_scenarios(tmp / "scenarios", names=(), extra={"learn": SCENARIO.format(
        tokens=args.judge_tokens, concurrency=args.concurrency)}), state=tmp / "state", log_path=tmp / "reefd.log")
    d.start()
    client = openai.OpenAI(base_url=d.url + "/v1", api_key=d.token, max_retries=2,
                           default_headers={"x-reef-scenario": "learn"})
    try:
        def conversation(i: int) -> str:
            messages = [{"role": "user", "content": f"question {i}"}]
            raw = client.chat.completions.with_raw_response.create(
                model="learn", messages=messages, max_tokens=16, extra_headers={"x-reef-session": f"s{i}"})  # type: ignore[arg-type]
            messages += [{"role": "assistant", "content": raw.parse().choices[0].message.content or ""},
                         {"role": "user", "content": "Please answer more briefly."}]
            client.chat.completions.create(model="learn", messages=messages, max_tokens=16,  # type: ignore[arg-type]
                                           extra_headers={"x-reef-session": f"s{i}"})
            return raw.headers["x-reef-agent-record-id"]

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            receipts = list(pool.map(conversation, range(args.turns)))
        while json.loads(d.get("/reef/status")[1])["scenarios"][0]["judge"]["judged"] < args.turns:
            time.sleep(0.05)
        # the judge works while the conversations are still served: its window runs from the start of the first
        # judgment (stored time minus its duration) to the last one stored
        judgments = [r for receipt in receipts for r in json.loads(d.get(f"/reef/records/{receipt}")[1])["reports"]
                     if r["source"] == "judge"]
        assert len(judgments) == args.turns, len(judgments)
        judge_s = max(r["created_at"] for r in judgments) - min(r["created_at"] - r["metadata"]["seconds"]
                                                               for r in judgments)

        def plain(i: int) -> None:
            client.chat.completions.create(model="learn", max_tokens=args.judge_tokens, temperature=0.6,
                                           messages=[{"role": "user", "content": f"vote {i}"}],
                                           extra_headers={"x-reef-turn": "side"})

        started = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(args.concurrency * 6) as pool:
            list(pool.map(plain, range(args.turns * 6)))
        plain_s = time.monotonic() - started

        record = json.loads(d.get(f"/reef/records/{receipts[0]}")[1])
        tokens = len(record["completion_token_ids"])
        bare = {k: v for k, v in record.items() if not k.startswith("completion_top") and k != "reports"}
        full = {**bare, "completion_top_ids": record["completion_top_ids"],
                "completion_top_logprobs": record["completion_top_logprobs"]}
        per_1k = (len(pack(full)) - len(pack(bare))) / tokens * 1000
    finally:
        d.stop()
    rate = args.turns / judge_s
    print(f"judged {args.turns} turns ({args.turns * 6} votes of <= {args.judge_tokens} tokens) in {judge_s:.2f} s: "
          f"{rate:.1f} judgments/s on the tiny model")
    print(f"baseline: {args.turns * 6} plain completions in {plain_s:.2f} s; judge / baseline = "
          f"{judge_s / plain_s:.2f}x")
    print(f"top-K capture (K = {record['top_k']}): {per_1k / 1024:.1f} KiB per 1,000 generated tokens "
          f"({per_1k / 1000 / record['top_k']:.1f} bytes per entry)")
    print(json.dumps({"bench": "judge_throughput", "model": "tiny", "turns": args.turns, "votes": 6,
                      "judge_tokens": args.judge_tokens, "judge_s": round(judge_s, 3),
                      "judgments_per_s": round(rate, 2), "baseline_s": round(plain_s, 3),
                      "ratio": round(judge_s / plain_s, 3), "top_k": record["top_k"],
                      "capture_bytes_per_1k_tokens": round(per_1k)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
