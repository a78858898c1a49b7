"""Replicas: output tokens/s through reefd with 2 engine replicas behind sglang-router against 1 replica, in one run.

Starts reefd twice on the same model (`model.replicas: 1`, then `2`), warms each up, then sends the same load: N
streams-free chat completions at a fixed concurrency, each with its own session (so the router spreads them),
`ignore_eos` so every answer has the same length. Prints tokens/s for both, the ratio, and a JSON line.

On a 2-core machine two CPU replicas share the same cores as one, so the ratio mostly measures the router's and the
second process's overhead; on a machine with a core (or a GPU) per replica it measures scale-out.

Run: python bench/replicas.py [--model tiny|smollm2] [--requests 48] [--concurrency 8] [--tokens 32]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from _harness import Daemon, scratch_dir

from tests.conftest import make_scenarios

SCENARIO = """defaults:
  - model: {model}
  - _self_
model:
  replicas: {replicas}
  max_batch: 8
"""


def start(model: str, replicas: int) -> Daemon:
    tmp = scratch_dir()
    scen = make_scenarios(tmp / "scenarios", names=(), extra={"rep": SCENARIO.format(model=model,
                                                                                    replicas=replicas)})
    state = tmp / "state"
    if model == "smollm2":
        from reefd.worker.prepare import prepare

        home = Path(os.environ.get("REEF_STATE") or Path.home() / ".local" / "state" / "reefd")
        (state / "models").mkdir(parents=True)
        (state / "models" / "smollm2").symlink_to(Path(prepare("smollm2", home / "models" / "smollm2")))
    d = Daemon(scenarios=scen, state=state, log_path=tmp / "reefd.log")
    d.start(wait_ready=False)
    d.wait_ready(600)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:  # every replica in the router, not just the first
        engine = json.loads(d.get("/reef/status")[1])["scenarios"][0]["engine"]
        listed = engine.get("replicas")
        if listed is None or all(r["in_router"] for r in listed):
            return d
        time.sleep(0.5)
    raise RuntimeError(f"the replicas never all joined the router:\n{d.logs()[-2000:]}")


async def load(d: Daemon, n: int, concurrency: int, tokens: int) -> tuple[float, int]:
    """(wall seconds, completion tokens) of n requests, each in its own session."""
    import aiohttp

    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(n):
        queue.put_nowait(i)
    total = 0
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as session:
        async def worker() -> None:
            nonlocal total
            while not queue.empty():
                i = queue.get_nowait()
                body: dict[str, Any] = {"model": "rep", "max_tokens": tokens, "temperature": 1.0,
                                        "ignore_eos": True,
                                        "messages": [{"role": "user", "content": f"Tell me a story, number {i}."}]}
                headers = {**d.headers(), "x-reef-scenario": "rep", "x-reef-session": f"bench-{i}-{time.time()}"}
                async with session.post(d.url + "/v1/chat/completions", json=body, headers=headers) as r:
                    answer = await r.json()
                    if r.status != 200:
                        raise RuntimeError(f"{r.status}: {answer}")
                    total += int(answer["usage"]["completion_tokens"])

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return time.perf_counter() - started, total


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=["tiny", "smollm2"], default="tiny")
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--tokens", type=int, default=32)
    args = p.parse_args()
    results: dict[int, float] = {}
    for replicas in (1, 2):
        d = start(args.model, replicas)
        try:
            asyncio.run(load(d, args.concurrency, args.concurrency, args.tokens))  # warm-up
            seconds, tokens = asyncio.run(load(d, args.requests, args.concurrency, args.tokens))
        finally:
            d.stop()
        results[replicas] = tokens / seconds
        print(f"{replicas} replica(s): {tokens} tokens in {seconds:.1f} s = {results[replicas]:.1f} tokens/s",
              flush=True)
    ratio = results[2] / results[1]
    print(f"2 replicas vs 1: {ratio:.2f}x tokens/s ({os.cpu_count()} cores, model {args.model})")
    print(json.dumps({"bench": "replicas", "model": args.model, "cores": os.cpu_count(),
                      "tokens_per_s_1": round(results[1], 1), "tokens_per_s_2": round(results[2], 1),
                      "ratio": round(ratio, 3), "requests": args.requests, "concurrency": args.concurrency,
                      "tokens": args.tokens}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
