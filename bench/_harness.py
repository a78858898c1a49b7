"""Shared pieces of the benchmarks: start reefd or the fake upstream, load them, read RSS."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests import conftest  # noqa: E402
from tests.conftest import free_port, make_scenarios  # noqa: E402


@dataclasses.dataclass
class Daemon(conftest.Daemon):
    """A reefd as its users run it: every release proven (the test suite's daemons leave that to its own tests)."""

    proof: bool = True


def scratch_dir() -> Path:
    base = ROOT / ".bench-tmp"
    base.mkdir(exist_ok=True)
    return Path(tempfile.mkdtemp(dir=base))


def start_upstream() -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "fake_upstream.py"),
                             "--port", str(port)])
    wait_answering(f"http://127.0.0.1:{port}", "fake upstream")
    return proc, f"http://127.0.0.1:{port}/v1"


def wait_answering(url: str, what: str, timeout_s: float = 30.0) -> None:
    """Until a server answers `url` + "/" (a 404 will do: it is up)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(url + "/", timeout=1)
            return
        except urllib.error.HTTPError:
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"{what} did not start")


def smollm2_folder() -> Path:
    """SmolLM2's model folder: the copy `make run` converts once (in REEF_STATE or the default state folder)."""
    from reefd.worker.prepare import prepare

    home = Path(os.environ.get("REEF_STATE") or Path.home() / ".local" / "state" / "reefd")
    return Path(prepare("smollm2", home / "models" / "smollm2"))


def link_smollm2(state: Path) -> None:
    """SmolLM2 in a bench's state folder: the copy `make run` converts once, not a fresh conversion per run."""
    (state / "models").mkdir(parents=True, exist_ok=True)
    (state / "models" / "smollm2").symlink_to(smollm2_folder())


def start_reefd(tmp: Path, extra: dict[str, str], names: tuple[str, ...] = (),
                env: dict[str, str] | None = None, seed_model: str = "tiny") -> Daemon:
    if seed_model == "smollm2":
        link_smollm2(tmp / "state")
    d = Daemon(scenarios=make_scenarios(tmp / "scenarios", names=names, extra=extra),
               state=tmp / "state", log_path=tmp / "reefd.log", env=env or {})
    d.start()
    return d


def on_engine(text: str, engine: str) -> str:
    """A scenario file's text with its model on `engine` (worker: as written; vllm: vLLM's server from its own
    environment, REEF_VLLM_PYTHON, which `make vllm-venv` builds)."""
    if engine == "worker":
        return text
    from omegaconf import OmegaConf

    if engine == "vllm" and not os.access(os.environ.get("REEF_VLLM_PYTHON", ""), os.X_OK):
        raise SystemExit("vLLM's environment is missing: make vllm-venv, then REEF_VLLM_PYTHON=its python")
    cfg = OmegaConf.create(text)
    OmegaConf.update(cfg, "model.engine", engine, force_add=True)
    return OmegaConf.to_yaml(cfg)


def upstream_scenario(url: str) -> str:
    return (f"defaults:\n  - model: upstream\n  - _self_\nmodel:\n  url: {url}\n"
            "  api_key_env: UP_KEY\n  upstream_model: up\n")


def peak_rss_mb(pid: int) -> float:
    """VmHWM: the peak resident set of a process so far."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmHWM for pid {pid}")


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def cpu_busy_s() -> float:
    """CPU-seconds the whole machine has been busy (all cores, /proc/stat: everything but idle and iowait)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def process_cpu_s(pid: int) -> float:
    """CPU-seconds one process has used so far, all its threads (utime + stime)."""
    f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def tree_cpu_s(root: int) -> float:
    """CPU-seconds used by `root` and its descendants, living or reaped (utime + stime + cutime + cstime)."""
    stats: dict[int, tuple[int, float]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                f = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue  # it exited meanwhile
            stats[int(entry.name)] = (int(f[1]), sum(int(x) for x in f[11:15]) / os.sysconf("SC_CLK_TCK"))
    total = 0.0
    for pid, (_, cpu) in stats.items():
        p = pid
        while p > 1 and p != root:
            p = stats.get(p, (0, 0.0))[0]
        if p == root:
            total += cpu
    return total


async def load(url: str, headers: dict[str, str], body: dict, n: int, concurrency: int
               ) -> tuple[list[float], float]:
    """n POSTs at a fixed concurrency; returns per-request latencies (s) and wall time (s)."""
    import aiohttp

    latencies: list[float] = []
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(n):
        queue.put_nowait(i)
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:
        async def worker() -> None:
            while not queue.empty():
                queue.get_nowait()
                t0 = time.perf_counter()
                async with session.post(url, json=body, headers=headers) as r:
                    await r.read()
                    if r.status != 200:
                        raise RuntimeError(f"{url}: {r.status} {await r.text()}")
                latencies.append(time.perf_counter() - t0)

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return latencies, time.perf_counter() - start


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def median(values: list[float]) -> float:
    return statistics.median(values)


__all__ = ["ROOT", "Daemon", "cpu_busy_s", "free_port", "load", "os", "pct", "peak_rss_mb", "process_cpu_s", "rss_mb",
           "scratch_dir", "start_reefd", "start_upstream", "tree_cpu_s", "upstream_scenario", "wait_answering"]
