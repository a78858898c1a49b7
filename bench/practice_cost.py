"""What practice costs the serving path: served turns' latency with practice running beside them, against the same
traffic without it, in the same run on the same reefd and engine.

A real reefd serves scenario `serve` (SmolLM2 by default). Phases alternate: practice off, on, off, on (--phases).
Each phase rewrites the scenario file (with or without its `practice:` block: single-digit sums, the shipped
`last_number` verifier, `--practice-concurrency` answers at once on idle engine turns) and reloads reefd
(SIGHUP), waits until practice is answering (for an "on" phase), then runs the same traffic: `--clients`
closed-loop clients, each sending a chat completion (temperature 0, `--max-tokens` new tokens), reading the
answer, then pausing `--think-s` (the idle time practice may fill), `--requests` times each. `--preempt false`
measures practice sharing the engine with requests instead of stopping for them.
Prints p50 and p99 of served turns' latency (client-side, request to last byte) with practice off and on, their
ratios, the practice answers made meanwhile, and one JSON line.
Run: python bench/practice_cost.py [--model smollm2|tiny] [--clients 2] [--requests 20] [--phases 4] [--preempt false]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import time
from pathlib import Path
from typing import Any

from _harness import Daemon, pct, scratch_dir, start_reefd

NAME = "serve"


def scenario_text(model: str, practice: bool, concurrency: int, preempt: bool = True) -> str:
    text = f"defaults: [{{model: {model}}}, {{release: follow}}, _self_]\nmodel: {{max_batch: 8}}\n"
    if practice:
        text += ("practice: {tasks: sums.jsonl, verifier: {function: 'reefd.grow.practice.checks:last_number'}, "
                 f"tasks_per_round: 8, samples: 2, rounds_per_hour: 3600, concurrency: {concurrency}, "
                 f"max_tokens: 16, temperature: 0.5, preempt: {str(preempt).lower()}}}\n")
    return text


def write_tasks(folder: Path) -> None:
    with (folder / "sums.jsonl").open("w") as f:
        for a in range(10):
            for b in range(10):
                f.write(json.dumps({"prompt": f"What is {a} + {b}? Answer with the number only.",
                                    "answer": a + b}) + "\n")


def practice_of(d: Daemon) -> dict[str, Any]:
    code, body = d.get("/reef/status")
    if code != 200:
        raise RuntimeError(f"/reef/status: {code} {body!r}")
    return dict(next(s for s in json.loads(body)["scenarios"] if s["name"] == NAME).get("practice") or {})


async def traffic(d: Daemon, clients: int, requests: int, think_s: float, max_tokens: int) -> list[float]:
    """Closed-loop clients: ask, read the whole answer, pause; every served turn's latency (s)."""
    import aiohttp

    headers = {"Authorization": f"Bearer {d.token}", "x-reef-scenario": NAME}
    latencies: list[float] = []

    async def client(session: aiohttp.ClientSession, n: int) -> None:
        for i in range(requests):
            body = {"model": NAME, "max_tokens": max_tokens, "temperature": 0,
                    "messages": [{"role": "user", "content": f"Write a line about the sea, number {n}.{i}."}]}
            t0 = time.perf_counter()
            async with session.post(d.url + "/v1/chat/completions", json=body, headers=headers) as r:
                await r.read()
                if r.status != 200:
                    raise RuntimeError(f"served turn: {r.status} {await r.text()}")
            latencies.append(time.perf_counter() - t0)
            await asyncio.sleep(think_s)

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        await asyncio.gather(*(client(session, n) for n in range(clients)))
    return latencies


def phase(d: Daemon, args: argparse.Namespace, on: bool) -> tuple[list[float], int]:
    """One phase's served latencies, and the practice answers made during it."""
    (d.scenarios / f"{NAME}.yaml").write_text(scenario_text(args.model, on, args.practice_concurrency,
                                                            args.preempt == "true"))
    d.reload()
    before = 0
    if on:
        deadline = time.monotonic() + 300
        while not practice_of(d).get("answers"):
            if time.monotonic() > deadline:
                raise RuntimeError(f"practice never answered: {practice_of(d)}\n{d.logs()}")
            time.sleep(0.2)
        before = int(practice_of(d).get("answers", 0))
    latencies = asyncio.run(traffic(d, args.clients, args.requests, args.think_s, args.max_tokens))
    made = int(practice_of(d).get("answers", 0)) - before if on else 0
    return latencies, made


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2")
    p.add_argument("--clients", type=int, default=2)
    p.add_argument("--requests", type=int, default=20, help="per client and phase")
    p.add_argument("--think-s", type=float, default=0.5)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--practice-concurrency", type=int, default=4)
    p.add_argument("--phases", type=int, default=4, help="off, on, off, on, ...")
    p.add_argument("--preempt", choices=["true", "false"], default="true",
                   help="practice.preempt: stop practice answers when a request comes (true), or share the engine")
    args = p.parse_args()
    tmp = scratch_dir()
    d = start_reefd(tmp, {NAME: scenario_text(args.model, False, args.practice_concurrency)},
                    seed_model=args.model)
    write_tasks(d.scenarios)
    try:
        asyncio.run(traffic(d, 1, 2, 0, args.max_tokens))  # warm-up, not counted
        seen: dict[bool, list[float]] = {False: [], True: []}
        answers = 0
        for n in range(args.phases):
            on = n % 2 == 1
            latencies, made = phase(d, args, on)
            seen[on] += latencies
            answers += made
            print(f"phase {n + 1} (practice {'on' if on else 'off'}): {len(latencies)} turns, p50 "
                  f"{pct(latencies, 0.5) * 1000:.0f} ms, p99 {pct(latencies, 0.99) * 1000:.0f} ms"
                  + (f", {made} practice answers meanwhile" if on else ""), flush=True)
        status = practice_of(d)
    finally:
        d.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    off, on = seen[False], seen[True]
    figures = {"p50_off_ms": pct(off, 0.5) * 1000, "p99_off_ms": pct(off, 0.99) * 1000,
               "p50_on_ms": pct(on, 0.5) * 1000, "p99_on_ms": pct(on, 0.99) * 1000}
    figures.update(p50_ratio=figures["p50_on_ms"] / figures["p50_off_ms"],
                   p99_ratio=figures["p99_on_ms"] / figures["p99_off_ms"])
    print(f"served turns, practice off: p50 {figures['p50_off_ms']:.0f} ms, p99 {figures['p99_off_ms']:.0f} ms "
          f"({len(off)} turns)")
    print(f"served turns, practice on:  p50 {figures['p50_on_ms']:.0f} ms, p99 {figures['p99_on_ms']:.0f} ms "
          f"({len(on)} turns, {answers} practice answers meanwhile)")
    print(f"ratio on/off: p50 {figures['p50_ratio']:.2f}x, p99 {figures['p99_ratio']:.2f}x")
    print(json.dumps({"bench": "practice_cost", "model": args.model, "clients": args.clients,
                      "think_s": args.think_s, "max_tokens": args.max_tokens,
                      "practice_concurrency": args.practice_concurrency, "preempt": args.preempt == "true",
                      "turns_off": len(off), "turns_on": len(on), "practice_answers": answers,
                      "verified": status.get("verified"), "yielded": status.get("yielded"),
                      **{k: round(v, 3) for k, v in figures.items()}}))


if __name__ == "__main__":
    main()
