"""Engine batching: output tokens/s of N concurrent requests vs the same N sent one by one, per engine.

Starts each engine named by --engines as reefd launches it (a real `python -m reefd.worker`, vLLM's OpenAI server
from its own environment) and speaks to it with reefd's own client (token ids in, ids and logprobs out), one
engine after the other in the same run. For each it measures both (keep-alive, median of alternating rounds),
prints a human line with the ratio (goal >= 5x), then a line comparing the engines, and ends with one JSON line.
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
    wait_healthy(proc, port, log, 300)
    return proc


def start_vllm(model: Path, port: int, max_batch: int, log: Path, dtype: str = "float32"
               ) -> subprocess.Popen[bytes]:
    """vLLM's server as reefd launches it for `engine: vllm` (its own Python: REEF_VLLM_PYTHON)."""
    from reefd.engines.kind_configs import VLLMConfig
    from reefd.engines.vllm import launch_argv, launch_env

    cfg = VLLMConfig(max_batch=max_batch, dtype=dtype)
    if cfg.launcher() is None:
        raise SystemExit("vLLM's environment is missing: make vllm-venv, then REEF_VLLM_PYTHON=its python")
    with log.open("wb") as out:
        proc = subprocess.Popen(launch_argv(cfg, model, port, "base", 4096), stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, **launch_env(cfg)}, cwd=ROOT)
    wait_healthy(proc, port, log, 600)
    return proc


def wait_healthy(proc: subprocess.Popen[bytes], port: int, log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"engine exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise SystemExit(f"engine did not become ready in {timeout_s:.0f} s")


async def measure(engine: str, url: str, model: Path, bodies: list[dict[str, Any]], rounds: int
                  ) -> tuple[float, float]:
    """Median output tok/s of the bodies sent one by one, and all at once (alternating rounds)."""
    import aiohttp

    from reefd.engines.sglang_client import SGLangClient
    from reefd.engines.vllm import eos_ids
    from reefd.engines.vllm_client import VLLMClient

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
        client = VLLMClient(session, url, "base", eos_ids(model)) if engine == "vllm" else SGLangClient(session, url)

        async def post(body: dict[str, Any]) -> int:
            async for answer in client.generate(body, 3600):
                return int(answer["meta_info"]["completion_tokens"])
            raise RuntimeError("no answer")

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


def run_engine(engine: str, folder: Path, args: argparse.Namespace, tmp: Path) -> tuple[float, float]:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    port = free_port()
    log = tmp / f"{engine}.log"
    proc = start_vllm(folder, port, args.concurrency, log, args.vllm_dtype) if engine == "vllm" else \
        start_worker(folder, port, args.concurrency, args.threads, log)
    try:
        bodies = [{"input_ids": tokenizer.encode(PROMPTS[i % len(PROMPTS)]).ids, "return_logprob": True,
                   "sampling_params": {"max_new_tokens": args.tokens, "temperature": 1.0, "sampling_seed": i,
                                       "ignore_eos": True}} for i in range(args.concurrency)]
        return asyncio.run(measure(engine, f"http://127.0.0.1:{port}", folder, bodies, args.rounds))
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default="tiny", help="tiny, smollm2 or a model folder")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--tokens", type=int, default=32, help="new tokens per request (ignore_eos: all equal)")
    p.add_argument("--threads", type=int, default=0, help="worker torch threads (default: all cores)")
    p.add_argument("--rounds", type=int, default=3, help="sequential/concurrent rounds; medians are reported")
    p.add_argument("--engines", default="worker,vllm", help="engines to measure, one after the other")
    p.add_argument("--vllm-dtype", default="float32", help="vLLM's model.dtype (float32: reefd's default)")
    args = p.parse_args(argv)

    folder = model_folder(args.model)
    name = args.model if args.model in ("tiny", "smollm2") else str(folder)
    engines: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="reef-bench-") as tmp:
        for engine in args.engines.split(","):
            sequential, concurrent = run_engine(engine, folder, args, Path(tmp))
            ratio = concurrent / sequential
            verdict = "meets" if ratio >= GOAL else "below"
            print(f"engine batching ({engine}, {name}, {args.concurrency} requests x {args.tokens} tokens): "
                  f"sequential {sequential:.1f} tok/s, concurrent {concurrent:.1f} tok/s, "
                  f"ratio {ratio:.2f}x ({verdict} the {GOAL:.0f}x goal)")
            engines[engine] = {"sequential_tok_s": round(sequential, 2), "concurrent_tok_s": round(concurrent, 2),
                               "ratio": round(ratio, 3)}
    if "worker" in engines and "vllm" in engines:
        w, v = engines["worker"], engines["vllm"]
        print(f"vllm / worker: {v['sequential_tok_s'] / w['sequential_tok_s']:.2f}x one by one, "
              f"{v['concurrent_tok_s'] / w['concurrent_tok_s']:.2f}x concurrent")
    print(json.dumps({"bench": "engine_batching", "model": name, "vllm_dtype": args.vllm_dtype,
                      "concurrency": args.concurrency,
                      "tokens": args.tokens, "rounds": args.rounds, "goal": GOAL, "engines": engines}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
