"""Trainer backends: what `recipe.backend: ray` adds to a weight job, against the local backend.

A Ray head of the bench's own is started as a child process (`ray start --head --block`, its own short
--temp-dir, loopback only, token auth, 2 CPUs), exactly as tests/e2e/test_ray.py does, and timed from Popen to
its dashboard answering `GET /api/version` (head start). The job: the same SAO spec every run (the samples of
bench/trainer.py: 8 rollouts of 32 prompt + 32 completion tokens, the model's own logprobs; LoRA r=8 on
q/k/v/o; a few steps, one micro-batch of 8 each), a fresh job id and output folder per run. Each round runs it
through:
  - local, cold (the baseline): a fresh `LocalTrainers` and no prewarm, so the job pays for a new Python
    process importing torch, transformers and peft. A Ray job starts a fresh process too: this is the fair
    comparison.
  - ray: `RayJobs` against the head (submit through the Jobs REST API, events relayed from the job's logs,
    polled every 0.5 s by the backend).
  - local, warm (information): one `LocalTrainers` kept for the whole bench, its process warmed by an untimed
    first job; what reefd does by default (it prewarms a trainer when a scenario trains weights).
Rounds alternate local and ray. Per run: submit → start (from the `run` call to the trainer's first
`{"event": "start"}`: imports done, model loaded, training begins), total (from the `run` call to its return,
exit 0 and the candidate folder complete required), their difference (start → end: training and saving) and,
for ray, submit → RUNNING (the job's status, polled every 0.1 s beside the backend). Medians are compared:
ray / local cold, and ray − local cold in seconds. Note that Ray runs a job's entrypoint with
OMP_NUM_THREADS=1 and RayJobs passes no thread setting, so a Ray job trains on one torch thread where the local
trainer uses every core: start → end shows that part apart from the submission and start-up overhead.
Goal (information, not a test): Ray adds ≤ 5 s per job. The head is ended by its process group (SIGTERM, then
SIGKILL after 3 s), never `ray stop`, which would stop every Ray process on the machine.
Run: python bench/trainer_backends.py --model tiny|smollm2 [--runs N] [--steps N]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import aiohttp
from _harness import scratch_dir
from trainer import LORA, LR, make_samples, model_folder

from reefd.grow.backends.local import LocalTrainers
from reefd.grow.backends.ray_jobs import RayConfig, RayJobs
from tests.conftest import free_port

GOAL_S = 5.0  # Ray's overhead per job, against a cold local process
STEPS = {"tiny": 3, "smollm2": 2}
RUNS = {"tiny": 3, "smollm2": 3}
JOB_TIMEOUT_S = 600.0


@dataclass
class Run:
    start_s: float  # `run` called → first start event
    total_s: float  # `run` called → it returned
    running_s: float | None = None  # ray: `run` called → the job's status RUNNING

    @property
    def train_s(self) -> float:  # first start event → `run` returned
        return self.total_s - self.start_s


@dataclass
class Series:
    name: str
    runs: list[Run] = field(default_factory=list)

    def median(self, attr: str) -> float | None:
        values = [getattr(r, attr) for r in self.runs if getattr(r, attr) is not None]
        return statistics.median(values) if values else None

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"submit_to_start_s": _r(self.median("start_s")), "total_s": _r(self.median("total_s")),
                               "start_to_end_s": _r(self.median("train_s")),
                               "runs_total_s": [_r(r.total_s) for r in self.runs],
                               "runs_submit_to_start_s": [_r(r.start_s) for r in self.runs]}
        if any(r.running_s is not None for r in self.runs):
            out["submit_to_running_s"] = _r(self.median("running_s"))
        return out


def _r(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


class Head:
    """A Ray head of the bench's own (the test_ray fixture's recipe): (dashboard URL, token file)."""

    def __init__(self, work: Path) -> None:
        self.temp = Path(tempfile.mkdtemp(prefix="r", dir="/tmp"))  # short: Ray's socket paths are limited
        self.token = work / "ray-token"
        self.token.write_text(secrets.token_hex(16))
        self.log_path = work / "head.log"
        self.url = ""
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    def start(self) -> float:
        """Start it; seconds from Popen to `/api/version` answering 200."""
        dashboard = free_port()
        env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(self.token)}
        ray = Path(sys.executable).with_name("ray")
        self._log = self.log_path.open("wb")
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(
            [str(ray), "start", "--head", "--block", "--temp-dir", str(self.temp), "--port", str(free_port()),
             "--dashboard-host", "127.0.0.1", "--dashboard-port", str(dashboard), "--node-ip-address", "127.0.0.1",
             "--ray-client-server-port", str(free_port()), "--num-cpus", "2", "--include-dashboard", "true",
             "--disable-usage-stats"],
            env=env, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        self.url = f"http://127.0.0.1:{dashboard}"
        deadline = time.monotonic() + 120
        while True:
            req = urllib.request.Request(self.url + "/api/version",
                                         headers={"Authorization": f"Bearer {self.token.read_text()}"})
            with contextlib.suppress(OSError), urllib.request.urlopen(req, timeout=5) as r:
                if r.status == 200:
                    return time.perf_counter() - t0
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the Ray head did not start:\n{self.log_path.read_text()[-3000:]}")
            time.sleep(0.1)

    def stop(self) -> None:
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):  # the head and everything it started: its process group
                os.killpg(self.proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(3)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(15)
        if self._log is not None:
            self._log.close()
        shutil.rmtree(self.temp, ignore_errors=True)


class Job:
    """Writes a fresh spec (new job id, new output folder) for each run; the content is otherwise the same."""

    def __init__(self, folder: Path, samples: list[dict[str, Any]], steps: int, work: Path) -> None:
        self.folder, self.samples, self.steps, self.work = folder, samples, steps, work
        self.tag = uuid.uuid4().hex[:8]
        self.count = 0

    def spec(self, backend: str) -> tuple[Path, Path]:
        self.count += 1
        job = f"bench-{self.tag}-{self.count}-{backend}"
        folder = self.work / job
        folder.mkdir()
        out = folder / "out"
        spec = {"job": job, "objective": "recipes.sao.objective:SAOObjective", "base_model": str(self.folder),
                "init_adapter": None, "output_dir": str(out), "samples": self.samples, "lora": LORA, "seed": 0,
                "optim": {"lr": LR, "epochs": self.steps, "micro_batch": len(self.samples), "max_grad_norm": 1.0}}
        path = folder / "spec.json"
        path.write_text(json.dumps(spec))
        return path, out


async def timed(backend: LocalTrainers | RayJobs, job: Job, name: str, ray_url: str | None = None,
                token: str | None = None) -> Run:
    """One job through `backend`: submit → start, total and (ray) submit → RUNNING."""
    spec, out = job.spec(name)
    events: list[dict[str, Any]] = []
    started: list[float] = []

    def on_event(event: dict[str, Any]) -> None:
        events.append(event)
        if event.get("event") == "start" and not started:
            started.append(time.perf_counter())

    running: list[float] = []

    async def watch(t0: float) -> None:  # the Ray job's status, until it leaves PENDING
        submission = f"reef-{json.loads(spec.read_text())['job']}"
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {token}"}) as http:
            while True:
                with contextlib.suppress(aiohttp.ClientError, ValueError):
                    async with http.get(f"{ray_url}/api/jobs/{submission}") as r:
                        if r.status == 200:
                            state = (await r.json()).get("status")
                            if state not in (None, "PENDING"):
                                if state == "RUNNING":
                                    running.append(time.perf_counter() - t0)
                                return
                await asyncio.sleep(0.1)

    t0 = time.perf_counter()
    watcher = asyncio.create_task(watch(t0)) if ray_url else None
    try:
        status = await backend.run(spec, on_event, JOB_TIMEOUT_S)
        total = time.perf_counter() - t0
    finally:
        if watcher is not None:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
    if status != 0 or not started:
        raise SystemExit(f"{name}: the job failed ({status}): {events[-3:]}")
    if not (out / "metrics.json").is_file():
        raise SystemExit(f"{name}: exit 0 but no complete candidate folder at {out}")
    shutil.rmtree(spec.parent, ignore_errors=True)
    return Run(started[0] - t0, total, running[0] if running else None)


async def measure(head: Head, job: Job, runs: int, work: Path) -> tuple[Series, Series, Series]:
    cold, ray, warm = Series("local, cold process"), Series("ray"), Series("local, warm process")
    token = head.token.read_text().strip()
    rayjobs = RayJobs(work / "ray", 1, RayConfig(address=head.url))
    kept = LocalTrainers(work / "warm", 1)
    try:
        await timed(kept, job, "warmup")  # untimed: the kept process imports once, as a prewarmed one has
        for i in range(runs):
            fresh = LocalTrainers(work / f"cold-{i}", 1)
            try:
                cold.runs.append(await timed(fresh, job, "local"))
            finally:
                await fresh.close()
            ray.runs.append(await timed(rayjobs, job, "ray", head.url, token))
            warm.runs.append(await timed(kept, job, "warm"))
            print(f"  round {i + 1}/{runs}: local cold {cold.runs[-1].total_s:.2f} s, ray {ray.runs[-1].total_s:.2f} s,"
                  f" local warm {warm.runs[-1].total_s:.2f} s", file=sys.stderr, flush=True)
    finally:
        await rayjobs.close()
        await kept.close()
    return cold, ray, warm


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny", help="tiny, smollm2 or a model folder")
    p.add_argument("--runs", type=int, default=0, help="rounds (local cold, ray, local warm); default 3")
    p.add_argument("--steps", type=int, default=0, help="training steps per job (default: 3 tiny, 2 otherwise)")
    p.add_argument("--samples", type=int, default=8)
    args = p.parse_args(argv)
    name = args.model if args.model in ("tiny", "smollm2") else str(args.model)
    runs = args.runs or RUNS.get(name, 3)
    steps = args.steps or STEPS.get(name, 2)

    folder = model_folder(args.model)
    samples = make_samples(folder, args.samples, 32, 32)
    work = scratch_dir()
    head = Head(work)
    try:
        os.environ["RAY_AUTH_TOKEN_PATH"] = str(head.token)  # RayJobs reads its token from here
        os.environ.pop("RAY_AUTH_TOKEN", None)
        head_start = head.start()
        cold, ray, warm = asyncio.run(measure(head, Job(folder, samples, steps, work), runs, work))
    finally:
        head.stop()
        shutil.rmtree(work, ignore_errors=True)

    def m(s: Series, attr: str) -> float:
        value = s.median(attr)
        assert value is not None
        return value

    ratio_start, ratio_total = m(ray, "start_s") / m(cold, "start_s"), m(ray, "total_s") / m(cold, "total_s")
    over_start, over_total = m(ray, "start_s") - m(cold, "start_s"), m(ray, "total_s") - m(cold, "total_s")
    running = ray.median("running_s")
    print(f"trainer backends ({name}, SAO, {args.samples} x 32+32 tokens, {steps} steps per job, {runs} rounds; "
          f"medians). Ray head start: {head_start:.2f} s")
    print(f"  {'backend':<22}{'submit→start s':>16}{'start→end s':>13}{'total s':>10}{'vs local cold':>15}")
    for s in (cold, ray, warm):
        print(f"  {s.name:<22}{m(s, 'start_s'):>16.2f}{m(s, 'train_s'):>13.2f}{m(s, 'total_s'):>10.2f}"
              f"{m(s, 'total_s') / m(cold, 'total_s'):>14.2f}x")
    if running is not None:
        print(f"  ray submit → RUNNING: {running:.2f} s")
    verdict = "meets" if over_total <= GOAL_S else "misses"
    print(f"  ray / local cold: submit→start {ratio_start:.2f}x ({over_start:+.2f} s), total {ratio_total:.2f}x "
          f"({over_total:+.2f} s per job; {verdict} the ≤ {GOAL_S:.0f} s goal)")
    print(json.dumps({
        "bench": "trainer_backends", "model": name, "samples": args.samples, "steps": steps, "runs": runs,
        "head_start_s": round(head_start, 3), "local": cold.summary(), "ray": ray.summary(),
        "local_warm": warm.summary(), "ratio_start": round(ratio_start, 3), "ratio_total": round(ratio_total, 3),
        "overhead_start_s": round(over_start, 3), "overhead_total_s": round(over_total, 3), "goal_overhead_s": GOAL_S,
    }))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
