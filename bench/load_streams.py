"""Many concurrent streams against one engine: what its line (model.max_queue) does to them.

`--clients` clients (default 200) each stream answers from the tiny model through a real reefd, back to back, for
`--seconds` (default 60). A refusal (429, or 503 past model.max_queue_wait_s) is retried after its Retry-After, as
the SDKs do. Reported: streams completed, errors (anything but an answer or a refusal), 429s and 503s, time to the
first byte of the streams that were admitted (p50, p99), and reefd's RSS before and after.

Baseline, in the same run: the same load with no line (max_queue large enough for every client), where every
client waits in the engine's batch queue however long that takes.

Run: python bench/load_streams.py [--clients 200] [--seconds 60]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import time

import aiohttp
from _harness import pct, rss_mb, scratch_dir, start_reefd

SCENARIO = """defaults:
  - model: tiny
  - _self_
model:
  max_batch: 8
  max_queue: {queue}
  max_queue_wait_s: {wait}
serve:
  default_max_tokens: 32
"""
BODY = {"model": "tiny", "max_tokens": 32, "stream": True, "messages": [{"role": "user", "content": "tell me"}]}


async def client(session: aiohttp.ClientSession, url: str, headers: dict[str, str], stop: float,
                 out: dict[str, list[float] | int]) -> None:
    while time.monotonic() < stop:
        began = time.monotonic()
        try:
            async with session.post(url, json=BODY, headers=headers) as r:
                if r.status in (429, 503):
                    out[str(r.status)] += 1  # type: ignore[operator]
                    await r.read()
                    await asyncio.sleep(float(r.headers.get("Retry-After", "1")))
                    continue
                if r.status != 200:
                    out["errors"] += 1  # type: ignore[operator]
                    await r.read()
                    continue
                first = None
                async for _ in r.content.iter_any():
                    first = first or time.monotonic()
                out["ttfb"].append((first or time.monotonic()) - began)  # type: ignore[union-attr]
                out["streams"] += 1  # type: ignore[operator]
        except (aiohttp.ClientError, TimeoutError):
            out["errors"] += 1  # type: ignore[operator]


async def load(url: str, token: str, clients: int, seconds: float) -> dict[str, list[float] | int]:
    out: dict[str, list[float] | int] = {"streams": 0, "errors": 0, "429": 0, "503": 0, "ttfb": []}
    headers = {"Authorization": f"Bearer {token}", "x-reef-scenario": "line"}
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:
        stop = time.monotonic() + seconds
        await asyncio.gather(*(client(session, url, headers, stop, out) for _ in range(clients)))
    return out


def run(queue: int, wait: float, clients: int, seconds: float) -> dict[str, float | int]:
    tmp = scratch_dir()
    daemon = start_reefd(tmp, {"line": SCENARIO.format(queue=queue, wait=wait)})
    try:
        pid = daemon.proc.pid  # type: ignore[union-attr]
        before = rss_mb(pid)
        out = asyncio.run(load(daemon.url + "/v1/chat/completions", daemon.token, clients, seconds))
        after = rss_mb(pid)
    finally:
        daemon.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    ttfb = out["ttfb"] or [float("nan")]
    assert isinstance(ttfb, list)
    return {"streams": out["streams"], "errors": out["errors"], "429": out["429"], "503": out["503"],  # type: ignore[dict-item]
            "ttfb_p50_s": round(pct(ttfb, 0.5), 3), "ttfb_p99_s": round(pct(ttfb, 0.99), 3),
            "rss_before_mb": round(before, 1), "rss_after_mb": round(after, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=200)
    ap.add_argument("--seconds", type=float, default=60)
    args = ap.parse_args()
    lined = run(32, 30, args.clients, args.seconds)
    unbounded = run(args.clients, 3600, args.clients, args.seconds)
    for name, r in (("max_queue 32, wait 30 s", lined), ("no line (baseline)", unbounded)):
        print(f"{name:>24}: {r['streams']} streams, {r['errors']} errors, {r['429']} x 429, {r['503']} x 503, "
              f"first byte p50 {r['ttfb_p50_s']} s p99 {r['ttfb_p99_s']} s, reefd RSS {r['rss_before_mb']} -> "
              f"{r['rss_after_mb']} MB")
    ratio = unbounded["ttfb_p99_s"] / lined["ttfb_p99_s"] if lined["ttfb_p99_s"] else float("nan")
    print(f"p99 time to first byte: {ratio:.1f}x shorter with the line")
    print(json.dumps({"bench": "load_streams", "clients": args.clients, "seconds": args.seconds,
                      "with_line": lined, "without_line": unbounded, "p99_ttfb_ratio": round(ratio, 2)}))


if __name__ == "__main__":
    main()
