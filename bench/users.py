"""Per-user serving: many users' adapters in one batch, and a turn whose adapter must be paged in.

A real reefd serves `assist` (users: {slots: 8}) on the tiny model or SmolLM2, with the release proof on. The
bench publishes one real LoRA adapter per user (`POST …/releases?user=uNN`), then measures, in one run:

- Mixed batch: 8 concurrent greedy turns of 8 different users (8 adapters resident, each row its own LoRA),
  against the same 8 turns for one user (one adapter) and for nobody (the base model). Throughput is completion
  tokens per second of wall time. Goal: mixed ≥ 0.7× the single adapter's.
- Page-in: 64 users cycling through the 8 slots in order, one turn at a time, so that every turn's adapter was
  paged out (least recently used) and must be paged in (written from the chain, proven, loaded). Its p50 and
  p99 against the same turns of 8 users whose adapters stay resident.
Every answer must be a 200 naming the user's own release (`x-reef-release-id`); any other is a failure.
Run: python bench/users.py --model tiny|smollm2   (prints a table, then one JSON line)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import warnings
from pathlib import Path
from typing import Any

import aiohttp
from _harness import Daemon, link_smollm2, median, pct, scratch_dir
from hot_swap import tar_bytes

from tests.conftest import make_scenarios
from tests.loras import make_lora

USERS, SLOTS, ROUNDS = 64, 8, 3
MESSAGES = [{"role": "user", "content": "Tell me something about yourself."}]
TIMEOUT = aiohttp.ClientTimeout(total=600)


def scenario(model: str) -> str:
    return (f"defaults:\n  - model: {model}\n  - _self_\nserve:\n  default_max_tokens: 16\n"
            f"users:\n  slots: {SLOTS}\n")


async def turn(session: aiohttp.ClientSession, d: Daemon, user: str | None, tokens: int) -> tuple[float, int, str]:
    """One greedy turn: (seconds, completion tokens, release) ; raises on anything but a 200."""
    headers = {"Authorization": f"Bearer {d.token}", "x-reef-scenario": "assist",
               **({"x-reef-user": user} if user else {})}
    began = time.perf_counter()
    async with session.post(d.url + "/v1/chat/completions", headers=headers, json={
            "model": "assist", "messages": MESSAGES, "max_tokens": tokens, "temperature": 0,
            "ignore_eos": True}) as r:
        body = await r.json()
        if r.status != 200:
            raise RuntimeError(f"{user}: {r.status} {body}")
        return time.perf_counter() - began, int(body["usage"]["completion_tokens"]), r.headers["x-reef-release-id"]


async def publish_all(session: aiohttp.ClientSession, d: Daemon, model: str, out: Path) -> dict[str, str]:
    """One adapter per user, published on that user's line; user -> release."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    warnings.filterwarnings("ignore", ".*is_gradient_checkpointing.*", FutureWarning)
    base = d.state / "models" / model
    extra: dict[str, Any] = {"r": 8, "lora_alpha": 16} if model == "smollm2" else {}
    released = {}
    for i in range(USERS):
        user = f"u{i:02d}"
        tar = tar_bytes(make_lora(base, out / user, seed=100 + i, scale=2.0, **extra))
        async with session.post(d.url + "/reef/scenarios/assist/releases", params={"user": user}, data=tar,
                                headers={"Authorization": f"Bearer {d.token}",
                                         "Content-Type": "application/x-tar"}) as r:
            body = await r.json()
            if r.status != 201:
                raise RuntimeError(f"publish {user}: {r.status} {body}")
            released[user] = body["release"]["id"]
    return released


async def batch(session: aiohttp.ClientSession, d: Daemon, users: list[str | None], tokens: int,
                released: dict[str, str]) -> float:
    """Tokens per second of 8 concurrent turns, after one warm-up round (adapters resident)."""
    await asyncio.gather(*(turn(session, d, u, tokens) for u in users))
    began = time.perf_counter()
    done = await asyncio.gather(*(turn(session, d, u, tokens) for u in users))
    wall = time.perf_counter() - began
    for user, (_, _, release) in zip(users, done, strict=True):
        if user is not None and release != released[user]:
            raise RuntimeError(f"{user} was answered by {release}, not {released[user]}")
    return sum(n for _, n, _ in done) / wall


async def cycle(session: aiohttp.ClientSession, d: Daemon, users: list[str], tokens: int,
                released: dict[str, str]) -> list[float]:
    """Each user in order, one turn at a time, ROUNDS times (the first round of a fresh set is not timed)."""
    for user in users[:SLOTS]:
        await turn(session, d, user, tokens)
    seconds = []
    for _ in range(ROUNDS):
        for user in users:
            took, _, release = await turn(session, d, user, tokens)
            if release != released[user]:
                raise RuntimeError(f"{user} was answered by {release}, not {released[user]}")
            seconds.append(took)
    return seconds


async def measure(d: Daemon, model: str, tmp: Path, tokens: int) -> dict[str, Any]:
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        released = await publish_all(session, d, model, tmp / "loras")
        names = sorted(released)
        mixed = await batch(session, d, names[:SLOTS], tokens, released)
        single = await batch(session, d, [names[0]] * SLOTS, tokens, released)
        base = await batch(session, d, [None] * SLOTS, tokens, released)
        resident = await cycle(session, d, names[:SLOTS], 1, released)
        paged = await cycle(session, d, names, 1, released)
    return {"tok_s": {"mixed": mixed, "single": single, "base": base},
            "resident_s": {"p50": median(resident), "p99": pct(resident, 0.99)},
            "page_in_s": {"p50": median(paged), "p99": pct(paged, 0.99)}, "turns": len(resident) + len(paged)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=["tiny", "smollm2"], default="tiny")
    p.add_argument("--tokens", type=int, default=16, help="completion tokens per turn in the batches")
    args = p.parse_args()
    tmp = scratch_dir()
    if args.model == "smollm2":
        link_smollm2(tmp / "state")
    d = Daemon(scenarios=make_scenarios(tmp / "scenarios", names=(), extra={"assist": scenario(args.model)}),
               state=tmp / "state", log_path=tmp / "reefd.log")
    d.start()
    try:
        got = asyncio.run(measure(d, args.model, tmp, args.tokens))
    finally:
        d.stop()
    tok, res, paged = got["tok_s"], got["resident_s"], got["page_in_s"]
    print(f"users.py  model={args.model}  users={USERS}  slots={SLOTS}  proof on  (worker)")
    print(f"  8 turns at once      {'tok/s':>8}  vs one adapter")
    for name in ("mixed", "single", "base"):
        print(f"  {name:<20} {tok[name]:8.1f}  {tok[name] / tok['single']:5.2f}x")
    print(f"  one turn, 1 token    {'p50 s':>8}  {'p99 s':>8}")
    print(f"  resident (8 users)   {res['p50']:8.3f}  {res['p99']:8.3f}")
    print(f"  paged in (64 users)  {paged['p50']:8.3f}  {paged['p99']:8.3f}  "
          f"{paged['p50'] / res['p50']:5.1f}x the resident p50")
    mixed_ratio = tok["mixed"] / tok["single"]
    print(json.dumps({"bench": "users", "model": args.model, "users": USERS, "slots": SLOTS, **got,
                      "mixed_vs_single": round(mixed_ratio, 3), "goal_mixed_vs_single": 0.7,
                      "met": mixed_ratio >= 0.7}))


if __name__ == "__main__":
    main()
