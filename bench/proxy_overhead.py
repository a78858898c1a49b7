"""What reefd adds in front of a provider: latency, throughput and reefd's own CPU per turn vs calling it directly.

reefd (upstream engine, every turn recorded durably) in front of a trivially fast
OpenAI-compatible server, against that server called directly, at concurrency 1 and 64.
reefd's CPU per turn is the daemon process's user + system time (all its threads: the event loop and the
record writer) over the proxied run, divided by its turns.
Beside it run two floors (bench/bare_proxy.py), measured the same way: the least an aiohttp proxy spends per turn
(`bare`), and that plus one fsynced LMDB put per turn (`bare_durable`), so what reefd spends of its own (its
checks, sessions, records, metrics) is reefd's CPU minus bare_durable's.
Goals: added p50 ≤ 2 ms, throughput ≥ 0.5× direct, ≤ 150 µs of reefd CPU per non-streamed turn.
Run: python bench/proxy_overhead.py [--n1 400] [--n64 4000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import subprocess
import sys
from pathlib import Path

from _harness import (
    ROOT,
    free_port,
    load,
    pct,
    process_cpu_s,
    scratch_dir,
    start_reefd,
    start_upstream,
    upstream_scenario,
    wait_answering,
)

BODY = {"model": "up", "messages": [{"role": "user", "content": "ping"}], "max_tokens": 8}


def start_bare(upstream: str, durable: Path | None) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    argv = [sys.executable, str(ROOT / "bench" / "bare_proxy.py"), "--port", str(port), "--upstream", upstream]
    proc = subprocess.Popen(argv + (["--durable", str(durable)] if durable is not None else []))
    wait_answering(f"http://127.0.0.1:{port}", "bench/bare_proxy.py")
    return proc, f"http://127.0.0.1:{port}/v1/chat/completions"


def cpu_per_turn(pid: int, target: tuple[str, dict[str, str]], n: int, conc: int) -> tuple[float, list[float], float]:
    """reefd's (or a floor's) CPU µs per turn over n requests, with their latencies and wall time."""
    cpu0 = process_cpu_s(pid)
    lat, wall = asyncio.run(load(*target, BODY, n, conc))
    return (process_cpu_s(pid) - cpu0) / n * 1e6, lat, wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n1", type=int, default=400, help="requests at concurrency 1")
    ap.add_argument("--n64", type=int, default=4000, help="requests at concurrency 64")
    args = ap.parse_args()
    tmp = scratch_dir()
    upstream, url = start_upstream()
    daemon = start_reefd(tmp, {"up": upstream_scenario(url)}, env={"UP_KEY": "up-key"})
    direct = (url + "/chat/completions", {"Authorization": "Bearer up-key"})
    proxied = (daemon.url + "/v1/chat/completions",
               {"Authorization": f"Bearer {daemon.token}", "x-reef-scenario": "up"})
    bare, bare_url = start_bare(url, None)
    durable, durable_url = start_bare(url, tmp / "bare-lmdb")
    floors = {"bare": (bare, (bare_url, direct[1])), "bare_durable": (durable, (durable_url, direct[1]))}
    result: dict[str, object] = {"bench": "proxy_overhead"}
    try:
        for conc, n in ((1, args.n1), (64, args.n64)):
            for target in (direct, proxied, *(t for _, t in floors.values())):  # warm every path
                asyncio.run(load(target[0], target[1], BODY, min(n, 200), conc))
            d_lat, d_wall = asyncio.run(load(*direct, BODY, n, conc))
            assert daemon.proc is not None
            cpu_us, p_lat, p_wall = cpu_per_turn(daemon.proc.pid, proxied, n, conc)
            floor = {name: cpu_per_turn(proc.pid, target, n, conc)[0] for name, (proc, target) in floors.items()}
            added_p50 = (pct(p_lat, 0.5) - pct(d_lat, 0.5)) * 1000
            added_p99 = (pct(p_lat, 0.99) - pct(d_lat, 0.99)) * 1000
            ratio = (n / p_wall) / (n / d_wall)
            print(f"concurrency {conc:>2}: direct p50 {pct(d_lat, .5) * 1e3:6.2f} ms "
                  f"p99 {pct(d_lat, .99) * 1e3:6.2f} ms {n / d_wall:7.0f} req/s | via reefd "
                  f"p50 {pct(p_lat, .5) * 1e3:6.2f} ms p99 {pct(p_lat, .99) * 1e3:6.2f} ms "
                  f"{n / p_wall:7.0f} req/s | added p50 {added_p50:+.2f} ms "
                  f"p99 {added_p99:+.2f} ms, throughput {ratio:.2f}x direct")
            print(f"               reefd CPU {cpu_us:.0f} µs/turn | floors: aiohttp proxy {floor['bare']:.0f}, "
                  f"+ a durable record {floor['bare_durable']:.0f} | reefd's own "
                  f"{cpu_us - floor['bare_durable']:.0f} µs/turn ({cpu_us / floor['bare_durable']:.2f}x the floor)")
            result[f"c{conc}"] = {"added_p50_ms": round(added_p50, 3),
                                  "added_p99_ms": round(added_p99, 3),
                                  "direct_rps": round(n / d_wall, 1),
                                  "reefd_rps": round(n / p_wall, 1),
                                  "throughput_ratio": round(ratio, 3),
                                  "reefd_cpu_us_per_turn": round(cpu_us, 1),
                                  "bare_cpu_us_per_turn": round(floor["bare"], 1),
                                  "bare_durable_cpu_us_per_turn": round(floor["bare_durable"], 1),
                                  "reefd_over_floor": round(cpu_us / floor["bare_durable"], 3)}
        result["goal"] = {"added_p50_ms": 2.0, "throughput_ratio": 0.5, "reefd_cpu_us_per_turn": 150}
        print(json.dumps(result))
    finally:
        daemon.stop()
        for proc, _ in floors.values():
            proc.terminate()
            proc.wait()
        upstream.terminate()
        upstream.wait()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
