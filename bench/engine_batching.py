"""Engine batching: output tokens/s of N concurrent requests vs the same N sent one by one.

Starts a real `python -m reefd.worker` subprocess, measures both in the same run (aiohttp
client, keep-alive, median of alternating rounds), prints a human line with the ratio
(goal >= 5x) and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
GOAL = 5.0
PROMPTS = [
    "Write a short poem about the sea.",
    "Explain what a coral reef is to a child.",
    "List three uses of a paperclip.",
    "What is the capital of Norway, and why is it famous?",
    "Describe your favourite breakfast.",
    "Give two tips for learning a new language.",
    "Summarise the plot of a detective story in one paragraph.",
    "Why is the sky blue? Answer briefly.",
]


def model_folder(model: str) -> Path:
    """A built-in source is prepared where `make run` keeps it; anything else is a folder path."""
    if model not in ("tiny", "smollm2"):
        return Path(model)
    from reefd.worker.prepare import prepare

    if model == "tiny":
        return prepare("tiny", ROOT / ".bench-tmp" / "models" / "tiny")
    state = Path(os.environ.get("REEF_STATE") or Path.home() / ".local" / "state" / "reefd")
    return prepare("smollm2", state / "models" / "smollm2")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_worker(model: Path, port: int, max_batch: int, threads: int, log: Path) -> subprocess.Popen[bytes]:
    cmd = [
        sys.executable,
        "-m",
        "reefd.worker",
        "--model",
        str(model),
        "--port",
        str(port),
        "--max-batch",
        str(max_batch),
    ]
    if threads:
        cmd += ["--threads", str(threads)]
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"worker exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                if r.status == 200:
                    return proc
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise SystemExit("worker did not become ready in 300 s")


async def measure(url: str, bodies: list[dict[str, Any]], rounds: int) -> tuple[float, float]:
    """Median output tok/s of the bodies sent one by one, and all at once (alternating rounds)."""
    import aiohttp

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:

        async def post(body: dict[str, Any]) -> int:
            async with session.post(url, json=body) as r:
                r.raise_for_status()
                return int((await r.json())["meta_info"]["completion_tokens"])

        await post(bodies[0])  # warm-up: first-call allocations, lazy imports
        sequential, concurrent = [], []
        for _ in range(rounds):
            start = time.perf_counter()
            tokens = [await post(b) for b in bodies]
            sequential.append(sum(tokens) / (time.perf_counter() - start))
            start = time.perf_counter()
            tokens = await asyncio.gather(*(post(b) for b in bodies))
            concurrent.append(sum(tokens) / (time.perf_counter() - start))
    return statistics.median(sequential), statistics.median(concurrent)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default="tiny", help="tiny, smollm2 or a model folder")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--tokens", type=int, default=32, help="new tokens per request (ignore_eos: all equal)")
    p.add_argument("--threads", type=int, default=0, help="worker torch threads (default: all cores)")
    p.add_argument("--rounds", type=int, default=3, help="sequential/concurrent rounds; medians are reported")
    args = p.parse_args(argv)

    folder = model_folder(args.model)
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="reef-bench-") as tmp:
        proc = start_worker(folder, port, args.concurrency, args.threads, Path(tmp) / "worker.log")
        try:
            url = f"http://127.0.0.1:{port}/generate"
            bodies = [
                {
                    "text": PROMPTS[i % len(PROMPTS)],
                    "sampling_params": {
                        "max_new_tokens": args.tokens,
                        "temperature": 1.0,
                        "sampling_seed": i,
                        "ignore_eos": True,
                    },
                }
                for i in range(args.concurrency)
            ]
            sequential, concurrent = asyncio.run(measure(url, bodies, args.rounds))
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
    ratio = concurrent / sequential
    name = args.model if args.model in ("tiny", "smollm2") else str(folder)
    verdict = "meets" if ratio >= GOAL else "below"
    print(
        f"engine batching ({name}, {args.concurrency} requests x {args.tokens} tokens): "
        f"sequential {sequential:.1f} tok/s, concurrent {concurrent:.1f} tok/s, "
        f"ratio {ratio:.2f}x ({verdict} the {GOAL:.0f}x goal)"
    )
    result = {
        "bench": "engine_batching",
        "model": name,
        "concurrency": args.concurrency,
        "tokens": args.tokens,
        "rounds": args.rounds,
        "sequential_tok_s": round(sequential, 2),
        "concurrent_tok_s": round(concurrent, 2),
        "ratio": round(ratio, 3),
        "goal": GOAL,
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
