"""Peak memory: reefd idle and under 64 concurrent requests, and the worker serving SmolLM2.

Baseline, measured in the same run: a bare Python process that imports aiohttp (the floor
of any asyncio HTTP daemon). Goals: reefd ≤ 150 MB (it never imports torch); worker ≤ 1.5 GB.
Run: python bench/memory.py [--skip-smollm2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from _harness import load, peak_rss_mb, rss_mb, scratch_dir, start_reefd, start_upstream, upstream_scenario

from tests.conftest import free_port


def bare_python_mb() -> float:
    proc = subprocess.Popen([sys.executable, "-c",
                             "import aiohttp, asyncio, sys; sys.stdout.write('ok\\n'); "
                             "sys.stdout.flush(); sys.stdin.read()"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdout.readline() == b"ok\n"
    try:
        return peak_rss_mb(proc.pid)
    finally:
        proc.kill()
        proc.wait()


def reefd_memory() -> dict[str, float]:
    tmp = scratch_dir()
    upstream, url = start_upstream()
    daemon = start_reefd(tmp, {"up": upstream_scenario(url)}, names=("tiny",),
                         env={"UP_KEY": "up-key"})
    assert daemon.proc is not None
    try:
        time.sleep(1)
        idle = rss_mb(daemon.proc.pid)
        body = {"model": "up", "messages": [{"role": "user", "content": "x" * 2000}]}
        asyncio.run(load(daemon.url + "/v1/chat/completions",
                         {"Authorization": f"Bearer {daemon.token}", "x-reef-scenario": "up"},
                         body, 3000, 64))
        tiny = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
        asyncio.run(load(daemon.url + "/v1/chat/completions",
                         {"Authorization": f"Bearer {daemon.token}", "x-reef-scenario": "tiny"},
                         tiny, 256, 64))
        torch_loaded = "libtorch" in Path(f"/proc/{daemon.proc.pid}/maps").read_text()
        return {"idle_mb": idle, "peak_mb": peak_rss_mb(daemon.proc.pid),
                "torch_mapped": float(torch_loaded)}
    finally:
        daemon.stop()
        upstream.terminate()
        upstream.wait()
        shutil.rmtree(tmp, ignore_errors=True)


def worker_memory() -> float:
    state = Path(os.environ.get("REEF_STATE") or Path.home() / ".local" / "state" / "reefd")
    model = state / "models" / "smollm2"  # the copy `make run` prepares, converted once
    subprocess.run([sys.executable, "-m", "reefd.worker.prepare", "smollm2", "--out", str(model)],
                   check=True, stdout=subprocess.DEVNULL)
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "reefd.worker", "--model", str(model),
                             "--port", str(port)])
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 300
        import urllib.request
        while time.monotonic() < deadline:
            try:
                urllib.request.urlopen(url + "/health", timeout=1)
                break
            except OSError:
                time.sleep(0.5)
        body = {"text": "Tell me about the sea.", "sampling_params": {"max_new_tokens": 32},
                "return_logprob": True}
        asyncio.run(load(url + "/generate", {}, body, 16, 8))
        return peak_rss_mb(proc.pid)
    finally:
        proc.terminate()
        proc.wait(60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--skip-smollm2", action="store_true")
    args = ap.parse_args()
    base = bare_python_mb()
    r = reefd_memory()
    print(f"bare python+aiohttp: {base:.0f} MB")
    print(f"reefd idle: {r['idle_mb']:.0f} MB, peak under 64 concurrent: {r['peak_mb']:.0f} MB "
          f"({r['peak_mb'] / base:.1f}x bare; goal <= 150 MB); torch mapped: {bool(r['torch_mapped'])}")
    result = {"bench": "memory", "bare_python_mb": round(base, 1),
              "reefd_idle_mb": round(r["idle_mb"], 1), "reefd_peak_mb": round(r["peak_mb"], 1),
              "reefd_vs_bare": round(r["peak_mb"] / base, 2),
              "reefd_imports_torch": bool(r["torch_mapped"]),
              "goal": {"reefd_mb": 150, "worker_mb": 1536}}
    if not args.skip_smollm2:
        w = worker_memory()
        print(f"worker serving SmolLM2, peak: {w:.0f} MB (goal <= 1536 MB)")
        result["worker_smollm2_peak_mb"] = round(w, 1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
