"""Learning from reports alone: SmolLM2 served by reefd gets better at "Answer in one word." on 2 CPU cores.

Task (bench/learning_tasks.py): short open questions ending "Answer in one word."; score 1 when the answer
has 1-3 words, else 0. Held-out success: the mean score of 24 held-out questions x 2 answers at temperature
1.0 (disjoint from the training and the gate's questions), never reported, so never trained on.
Baseline, measured in the same run (bench/learning_bare.py): a bare policy-gradient loop in this process, no
server: LoRA r 8 (alpha 16) on q/k/v/o, AdamW lr 5e-4, per iteration 8 questions x 2 samples at temperature
1.0 (chat template, 16 new tokens at most), advantages (score - mean) / (std + 1e-6) over the batch, one
REINFORCE step (token mean of -A log p up to the first EOS, grad norm clipped at 1.0).
The daemon arm: a real reefd serving scenario `learn`: model smollm2 (max_batch 16), recipe sao with the same
LoRA, lr and clipping and one optimizer step per batch of 16, trigger every 16 records, holdout gate on 8
questions of its own (margin -0.15; after the first gate, which answers with both sides, the serving
release's scores come from the gate that admitted it, so a gate generates the candidate's 8 answers), release
follow. One AsyncOpenAI client sends the same 8 x 2 questions per iteration with `x-reef-scenario`, reports
each score to /reef/report with its receipt, then waits until the job its batch triggered is over (train ->
gate -> publish or reject -> hot swap), as the bare loop waits for its own update. Held-out success is
measured through reefd after each new release (every answer must carry the new `x-reef-release-id`).
Clocks: each arm's clock starts after its model is loaded and its base success measured, and stops during
every held-out evaluation, in both arms; all else counts (for reefd: HTTP, records, reports, the trainer
process, the gate and the swap). The arms' iterations alternate (bare, daemon, bare, ...), and each clock
also counts the CPU-seconds other processes on the machine used meanwhile, reported as a caveat.
Figure of merit: the clock time of the first held-out evaluation at or above --target (0.8), daemon / bare
(goal <= 1.3x); with 48 binary answers an evaluation's noise is about +-0.06. Also printed: the clock per
iteration, daemon / bare, which does not depend on how fast either learns.
Both arms' learning is noisy (which answers get sampled early decides when the rise starts), so with --runs N
the whole comparison is repeated N times and the figure of merit is the ratio of the arms' median times;
`make demo` runs 3.
Run: python bench/learning.py [--iterations 15] [--runs 1] [--arm both|bare|daemon] [--quick] [--keep]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import learning_tasks as lt
from _harness import ROOT, Daemon, cpu_busy_s, scratch_dir, start_reefd, tree_cpu_s
from learning_bare import Bare

GOAL = 1.3
NAME = "learn"
LR, MAX_TOKENS, TEMPERATURE, PROMPTS, SAMPLES = 5e-4, 16, 1.0, 8, 2
PNG = ROOT / "bench" / "out" / "learning.png"


@dataclass
class Arm:
    """One arm's clock and learning curve: (clock s, held-out success, label) points, plus per-iteration notes.

    While the clock runs it also counts the CPU-seconds that processes outside this bench used (other
    work on the machine), so a run disturbed by it says so."""

    name: str
    clock: float = 0.0
    foreign_cpu_s: float = 0.0
    started: tuple[float, float, float] | None = None
    points: list[tuple[float, float, str]] = field(default_factory=list)
    notes: list[dict[str, Any]] = field(default_factory=list)
    samples: dict[str, list[str]] = field(default_factory=dict)

    def resume(self) -> None:
        self.started = (time.perf_counter(), cpu_busy_s(), tree_cpu_s(os.getpid()))

    def pause(self) -> float:
        assert self.started is not None
        t0, busy0, own0 = self.started
        self.clock += time.perf_counter() - t0
        self.foreign_cpu_s += max(0.0, (cpu_busy_s() - busy0) - (tree_cpu_s(os.getpid()) - own0))
        self.started = None
        return self.clock

    def reach(self, target: float) -> float | None:
        return next((t for t, s, _ in self.points if s >= target - 1e-9), None)


def batch_questions(iteration: int) -> list[str]:
    start = iteration * PROMPTS % len(lt.TRAIN)
    return [lt.TRAIN[(start + i) % len(lt.TRAIN)] for i in range(PROMPTS)]


def model_folder() -> Path:
    """SmolLM2 where `make run` keeps it, converted once (idempotent)."""
    state = Path(os.environ.get("REEF_STATE") or Path.home() / ".local" / "state" / "reefd")
    folder = state / "models" / "smollm2"
    subprocess.run([sys.executable, "-m", "reefd.worker.prepare", "smollm2", "--out", str(folder)],
                   check=True, stdout=subprocess.DEVNULL, cwd=ROOT)
    return folder


# ---------------------------------------------------------------- the bare script


class BareRunner:
    """The baseline arm: bench/learning_bare.py's loop, one iteration at a time."""

    def __init__(self, folder: Path, heldout: list[str], samples: int, seed: int) -> None:
        self.arm = Arm("bare")
        self.heldout_prompts = [lt.prompt(q) for q in heldout for _ in range(samples)]
        self.bare = Bare(folder, lr=LR, max_tokens=MAX_TOKENS, temperature=TEMPERATURE, seed=seed)

    async def evaluate(self, label: str) -> float:
        texts = self.bare.sample(self.heldout_prompts)[1]
        success = sum(lt.score(t) for t in texts) / len(texts)
        self.arm.points.append((self.arm.clock, success, label))
        self.arm.samples["before" if label == "base" else "after"] = texts[:6]
        return success

    async def iteration(self, it: int) -> None:
        arm = self.arm
        arm.resume()
        t0 = time.perf_counter()
        batch, answers = self.bare.sample([lt.prompt(q) for q in batch_questions(it) for _ in range(SAMPLES)])
        scores = [lt.score(t) for t in answers]
        t1 = time.perf_counter()
        loss = self.bare.step(batch, scores)
        t2 = time.perf_counter()
        clock = arm.pause()
        success = await self.evaluate(f"it{it + 1}")
        arm.notes.append({"iteration": it + 1, "batch_score": sum(scores) / len(scores),
                          "sample_s": round(t1 - t0, 2), "train_s": round(t2 - t1, 2), "loss": round(loss, 4)})
        print(f"bare: iteration {it + 1}: batch {sum(scores) / len(scores):.2f}, sample {t1 - t0:.1f} s, "
              f"update {t2 - t1:.1f} s, clock {clock:.1f} s, held-out {success:.3f}", flush=True)

    async def close(self) -> None:
        pass


# ---------------------------------------------------------------- through reefd


def scenario_files(tmp: Path) -> dict[str, str]:
    (tmp / "scenarios").mkdir(parents=True, exist_ok=True)
    with (tmp / "scenarios" / "learn-gate.jsonl").open("w") as f:
        for q in lt.GATE:
            f.write(json.dumps({"prompt": lt.prompt(q), "answer": "1-3 words"}) + "\n")
    return {NAME: (
        "defaults: [{model: smollm2}, {recipe: sao}, {trigger: count}, {gate: holdout}, {release: follow}, _self_]\n"
        "description: bench/learning.py, one-word answers learned from reports alone.\n"
        f"model: {{max_batch: {PROMPTS * SAMPLES}}}\n"
        f"recipe: {{params: {{batch_size: {PROMPTS * SAMPLES}, micro_batch: {PROMPTS * SAMPLES}, epochs: 1, "
        f"lr: {LR}, lora_r: 8, lora_alpha: 16, max_grad_norm: 1.0, "
        "target_modules: [q_proj, k_proj, v_proj, o_proj]}}\n"
        f"trigger: {{every_n_records: {PROMPTS * SAMPLES}}}\n"
        "gate: {tasks: learn-gate.jsonl, scorer: \"bench.learning_tasks:one_word\", min_tasks: 8, "
        f"max_tokens: {MAX_TOKENS}, temperature: {TEMPERATURE}, samples: 1, margin: -0.15}}\n"
        f"serve: {{default_max_tokens: {MAX_TOKENS}}}\n")}


class Client:
    """The agent side: one AsyncOpenAI client for answers, one aiohttp session for reports and the admin API."""

    def __init__(self, daemon: Daemon) -> None:
        import aiohttp
        from openai import AsyncOpenAI

        self.daemon = daemon
        self.openai = AsyncOpenAI(base_url=daemon.url + "/v1", api_key=daemon.token, max_retries=0, timeout=600,
                                  default_headers={"x-reef-scenario": NAME})
        self.http = aiohttp.ClientSession(headers={**daemon.headers(), "x-reef-scenario": NAME},
                                          timeout=aiohttp.ClientTimeout(total=600))
        self.gate = asyncio.Semaphore(PROMPTS * SAMPLES)
        self.stages: dict[str, dict[str, float]] = {}  # job id -> stage -> first time seen (epoch s)

    async def close(self) -> None:
        await self.openai.close()
        await self.http.close()

    async def ask(self, question: str) -> tuple[str, str, str]:
        """(answer text, receipt, release id) for one question."""
        async with self.gate:
            raw = await self.openai.chat.completions.with_raw_response.create(
                model=NAME, messages=[{"role": "user", "content": lt.prompt(question)}],
                max_tokens=MAX_TOKENS, temperature=TEMPERATURE)
        text = raw.parse().choices[0].message.content or ""
        return text, raw.headers["x-reef-agent-record-id"], raw.headers["x-reef-release-id"]

    async def report(self, receipt: str, score: float) -> None:
        async with self.http.post(self.daemon.url + "/reef/report",
                                  json={"score": score, "references": [receipt]}) as r:
            if r.status != 200:
                raise RuntimeError(f"report {receipt}: {r.status} {await r.text()}")

    async def get(self, path: str) -> dict[str, Any]:
        async with self.http.get(self.daemon.url + path) as r:
            if r.status != 200:
                raise RuntimeError(f"GET {path}: {r.status} {await r.text()}")
            result: dict[str, Any] = await r.json()
            return result

    async def job_ids(self) -> set[str]:
        return {j["id"] for j in (await self.get(f"/reef/jobs?scenario={NAME}"))["data"]}

    async def wait_job(self, before: set[str], timeout_s: float = 900) -> dict[str, Any]:
        """The newest job not in `before`, once no job of the scenario is queued or running; notes when each
        stage was first seen."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            jobs = (await self.get(f"/reef/jobs?scenario={NAME}"))["data"]  # newest first
            for job in jobs:
                self.stages.setdefault(job["id"], {}).setdefault(job["stage"], time.time())
            new = [j for j in jobs if j["id"] not in before]
            if new and not any(j["state"] in ("queued", "running") for j in jobs):
                return dict(new[0])
            await asyncio.sleep(0.1)
        raise RuntimeError(f"no job ran on the batch within {timeout_s:.0f} s:\n{self.daemon.logs()}")


def job_note(job: dict[str, Any], seen: dict[str, float]) -> dict[str, Any]:
    """A finished job's durations: stage boundaries as first seen by 0.1 s polling, ends from the job itself."""
    def span(a: str | None, b: str | None) -> float | None:
        start = job["started_at"] if a is None else seen.get(a)
        end = job["finished_at"] if b is None else seen.get(b)
        return None if start is None or end is None else round(end - start, 2)

    gate = job.get("verdict") or {}
    return {"job": job["id"], "state": job["state"], "release": job["release"], "error": job["error"],
            "queued_s": round(job["started_at"] - job["created_at"], 2) if job["started_at"] else None,
            "total_s": round(job["finished_at"] - job["started_at"], 2) if job["started_at"] else None,
            "train_s": span("train", "gate"), "gate_s": span("gate", "publish" if "publish" in seen else None),
            "publish_swap_s": span("publish", None), "gate_verdict": gate.get("reason"), "trainer": job["metrics"]}


class DaemonRunner:
    """The daemon arm: a real reefd serving `learn`, driven by Client one iteration at a time."""

    def __init__(self, folder: Path, heldout: list[str], samples: int, keep: bool) -> None:
        self.arm, self.keep, self.ok = Arm("daemon"), keep, False
        self.heldout = [q for q in heldout for _ in range(samples)]
        self.tmp = scratch_dir()
        (self.tmp / "state" / "models").mkdir(parents=True)
        (self.tmp / "state" / "models" / "smollm2").symlink_to(folder)  # the copy converted once
        self.daemon = start_reefd(self.tmp, scenario_files(self.tmp), env={"REEF_KEEP_FAILED_JOBS": "1"})
        print(f"daemon: reefd ready at {self.daemon.url}; scratch {self.tmp} (log {self.daemon.log_path})",
              flush=True)
        self.client: Client | None = None
        self.failed = 0
        self.releases: list[dict[str, Any]] = []

    async def evaluate(self, label: str) -> float:
        """Held-out success of the serving release `label`, never reported (so never trained on)."""
        assert self.client is not None
        answers = await asyncio.gather(*(self.client.ask(q) for q in self.heldout))
        stale = sorted({rel for _, _, rel in answers if rel != label})
        if stale:
            raise RuntimeError(f"held-out answers came from {stale}, not the serving release {label}")
        texts = [t for t, _, _ in answers]
        success = sum(lt.score(t) for t in texts) / len(texts)
        self.arm.points.append((self.arm.clock, success, label))
        self.arm.samples["before" if len(self.arm.points) == 1 else "after"] = texts[:6]
        return success

    async def base(self) -> float:
        self.client = Client(self.daemon)
        return await self.evaluate((await self.client.get(f"/reef/scenarios/{NAME}/releases"))["serving"])

    async def iteration(self, it: int) -> None:
        client, arm = self.client, self.arm
        assert client is not None
        arm.resume()
        t0 = time.perf_counter()
        before = await client.job_ids()
        answers = await asyncio.gather(*(client.ask(q) for q in batch_questions(it) for _ in range(SAMPLES)))
        scores = [lt.score(t) for t, _, _ in answers]
        await asyncio.gather(*(client.report(rec, s) for (_, rec, _), s in zip(answers, scores, strict=True)))
        t1 = time.perf_counter()
        job = await client.wait_job(before)
        t2 = time.perf_counter()
        clock = arm.pause()
        note = {"iteration": it + 1, "batch_score": sum(scores) / len(scores), "sample_report_s": round(t1 - t0, 2),
                "job_wait_s": round(t2 - t1, 2), **job_note(job, client.stages.get(job["id"], {}))}
        arm.notes.append(note)
        line = (f"daemon: iteration {it + 1}: batch {note['batch_score']:.2f}, sample+report {t1 - t0:.1f} s, "
                f"job {job['id']} {job['state']} {job['release'] or ''} after {t2 - t1:.1f} s "
                f"(train {note['train_s']} s, gate {note['gate_s']} s, publish+swap {note['publish_swap_s']} s), "
                f"clock {clock:.1f} s")
        if job["state"] == "published":
            line += f", held-out {await self.evaluate(job['release']):.3f}"
        else:
            line += f": {note['gate_verdict'] if job['state'] == 'rejected' else job['error']}"
        print(line, flush=True)
        mine = {rec for _, rec, _ in answers}
        if set(job["receipts"]) != mine:
            print(f"daemon:   the job trained on {len(set(job['receipts']) & mine)} of this batch's "
                  f"{len(mine)} records (older ones were waiting)", flush=True)
        self.failed = self.failed + 1 if job["state"] == "failed" else 0
        if self.failed == 2:
            raise RuntimeError(f"two jobs failed in a row; the last one:\n{json.dumps(job, indent=1)}\n"
                               f"reefd log tail:\n{self.daemon.logs()}")

    async def close(self) -> None:
        if self.client is not None:
            self.releases = (await self.client.get(f"/reef/scenarios/{NAME}/releases?all=1"))["data"]
            await self.client.close()
            self.ok = True

    def stop(self) -> None:
        if self.daemon.proc is not None and self.daemon.proc.poll() is None:
            self.daemon.stop()
        if self.ok and not self.keep:
            shutil.rmtree(self.tmp, ignore_errors=True)
        else:
            print(f"daemon: scratch kept at {self.tmp}", flush=True)


async def drive(runners: list[Any], iterations: int) -> None:
    """Base success of each arm, then the arms' iterations alternate, so that other load on the machine
    falls on both alike; an arm is idle while the other runs."""
    for r in runners:
        base = await (r.base() if isinstance(r, DaemonRunner) else r.evaluate("base"))
        print(f"{r.arm.name}: held-out before {base:.3f}", flush=True)
    try:
        for it in range(iterations):
            for r in runners:
                await r.iteration(it)
    finally:
        for r in runners:
            await r.close()


# ---------------------------------------------------------------- output


def plot(runs: list[dict[str, Arm]], target: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    colors = {"bare": "tab:blue", "daemon": "tab:orange"}
    for i, arms in enumerate(runs):
        for arm in arms.values():
            ts, ss = [t for t, _, _ in arm.points], [s for _, s, _ in arm.points]
            label = f"{arm.name}, run {i + 1}" if len(runs) > 1 else f"{arm.name} ({len(arm.points) - 1} evaluations)"
            ax.step(ts, ss, where="post", marker="o", markersize=3, color=colors[arm.name],
                    alpha=1.0 if len(runs) == 1 else 0.4 + 0.6 / len(runs) * (i + 1), label=label)
    ax.axhline(target, color="grey", linestyle="--", linewidth=1, label=f"target {target:g}")
    ax.set(xlabel="wall time, held-out evaluation excluded (s)", ylabel="held-out success",
           title="SmolLM2-135M, 'Answer in one word.', 2 CPU cores", ylim=(0, 1.05))
    ax.legend(loc="best")
    ax.grid(alpha=0.3)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def summarize(arm: Arm, target: float) -> dict[str, Any]:
    reach = arm.reach(target)
    first, last = arm.points[0][1], arm.points[-1][1]
    share = arm.foreign_cpu_s / (2 * arm.clock) if arm.clock else 0.0
    print(f"{arm.name}: held-out success {first:.3f} -> {last:.3f} (best {max(s for _, s, _ in arm.points):.3f}); "
          f"clock {arm.clock:.1f} s over {len(arm.notes)} iterations ({arm.clock / max(1, len(arm.notes)):.1f} s "
          f"each); reached {target:g} " + (f"at {reach:.1f} s" if reach is not None else "never")
          + f"; other processes used {arm.foreign_cpu_s:.0f} CPU-s ({share:.0%} of 2 cores) while its clock ran")
    for when, texts in arm.samples.items():
        print(f"  {when}: " + " | ".join(repr(t[:40]) for t in texts))
    return {"before": round(first, 4), "after": round(last, 4), "clock_s": round(arm.clock, 2),
            "reach_s": None if reach is None else round(reach, 2), "foreign_cpu_s": round(arm.foreign_cpu_s, 1),
            "curve": [[round(t, 2), round(s, 4), label] for t, s, label in arm.points], "iterations": arm.notes}


def stages(arm: Arm) -> str:
    """Median seconds of each part of an iteration (the first one apart: it pays one-time start-up costs)."""
    keys = ("sample_s", "train_s") if arm.name == "bare" else (
        "sample_report_s", "train_s", "gate_s", "publish_swap_s", "total_s")
    later = arm.notes[1:] or arm.notes
    med = {k: statistics.median([n[k] for n in later if n.get(k) is not None] or [0.0]) for k in keys}
    first = {k: arm.notes[0].get(k) for k in keys} if arm.notes else {}
    return (f"{arm.name} iterations 2+, median: " + ", ".join(f"{k} {v:.2f}" for k, v in med.items())
            + "; iteration 1: " + ", ".join(f"{k} {v}" for k, v in first.items()))


def secs(x: float | None) -> str:
    return "never" if x is None else f"{x:.1f} s"


def compare(arms: dict[str, Arm], target: float) -> dict[str, Any]:
    """One run's figures of merit: time to the target, daemon / bare, and the clock per iteration."""
    bare, daemon = arms["bare"], arms["daemon"]
    bare_s, daemon_s = bare.reach(target), daemon.reach(target)
    ratio = None if bare_s is None or daemon_s is None else daemon_s / bare_s
    per_it = daemon.clock / bare.clock if bare.clock else None
    verdict = "n/a" if ratio is None else "meets" if ratio <= GOAL else "misses"
    print(f"time to held-out {target:g}: bare {secs(bare_s)}, daemon {secs(daemon_s)}; ratio daemon / bare "
          + (f"{ratio:.2f}x" if ratio is not None else "n/a (an arm never reached the target)")
          + f" ({verdict} the {GOAL}x goal); per iteration daemon / bare {per_it:.2f}x")
    return {"bare_reach_s": bare_s, "daemon_reach_s": daemon_s,
            "ratio": None if ratio is None else round(ratio, 3),
            "iteration_ratio": None if per_it is None else round(per_it, 3)}


def report_run(arms: dict[str, Arm], releases: list[dict[str, Any]], target: float) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for arm in arms.values():
        result[arm.name] = summarize(arm, target)
    for arm in arms.values():
        print(stages(arm))
    if releases:
        rejected = sum(r["status"] == "rejected" for r in releases)
        print(f"releases ({len(releases) - rejected - 1} published, {rejected} rejected candidates), newest first:")
        for r in releases:
            print(f"  {r['id']:>12} {r['status']:>8} {r['kind']:>7} {(r['meta'].get('gate') or {}).get('reason', '')}")
        result["daemon"]["releases"] = [{"id": r["id"], "status": r["status"], "kind": r["kind"],
                                         "gate": (r["meta"].get("gate") or {}).get("reason")} for r in releases]
    if len(arms) == 2:
        result.update(compare(arms, target))
    return result


def report(runs: list[tuple[dict[str, Arm], list[dict[str, Any]]]], target: float, args: argparse.Namespace) -> bool:
    """Each run's figures, then over several runs the medians: each arm's median time to the target (a run
    that never reached it counts as infinitely slow), their ratio, and the median clock-per-iteration ratio."""
    result: dict[str, Any] = {"bench": "learning", "model": "smollm2", "iterations": args.iterations,
                              "runs": len(runs), "heldout_answers": args.heldout_n * args.heldout_samples,
                              "target": target, "goal": GOAL}
    per_run = []
    for i, (arms, releases) in enumerate(runs):
        if len(runs) > 1:
            print(f"--- run {i + 1} of {len(runs)}")
        per_run.append(report_run(arms, releases, target))
    if len(runs) == 1:
        result.update(per_run[0])
    else:
        result["per_run"] = per_run
        if all("ratio" in r for r in per_run):
            def median_reach(key: str) -> float | None:
                value = statistics.median([math.inf if r[key] is None else r[key] for r in per_run])
                return None if math.isinf(value) else value

            bare_s, daemon_s = median_reach("bare_reach_s"), median_reach("daemon_reach_s")
            ratio = None if bare_s is None or daemon_s is None else daemon_s / bare_s
            per_it = statistics.median([r["iteration_ratio"] for r in per_run if r["iteration_ratio"] is not None])
            verdict = "n/a" if ratio is None else "meets" if ratio <= GOAL else "misses"
            ratios = ", ".join("n/a" if r["ratio"] is None else f"{r['ratio']:.2f}x" for r in per_run)
            print(f"over {len(runs)} runs: median time to held-out {target:g}: bare {secs(bare_s)}, daemon "
                  f"{secs(daemon_s)}; ratio daemon / bare "
                  + (f"{ratio:.2f}x" if ratio is not None else "n/a") + f" ({verdict} the {GOAL}x goal); "
                  f"each run: {ratios}; median per-iteration ratio {per_it:.2f}x")
            result.update({"bare_reach_s": bare_s, "daemon_reach_s": daemon_s,
                           "ratio": None if ratio is None else round(ratio, 3), "iteration_ratio": round(per_it, 3)})
    print(f"learning curve: {PNG}")
    result["goal_met"] = result.get("ratio") is not None and result["ratio"] <= GOAL
    print(json.dumps(result))
    return bool(result["goal_met"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iterations", type=int, default=15)
    ap.add_argument("--arm", choices=("both", "bare", "daemon"), default="both")
    ap.add_argument("--quick", action="store_true", help="a smoke run: 2 iterations, 8 held-out answers")
    ap.add_argument("--target", type=float, default=0.8, help="held-out success whose time is compared")
    ap.add_argument("--heldout-samples", type=int, default=2, help="answers per held-out question")
    ap.add_argument("--seed", type=int, default=0, help="the bare script's torch seed")
    ap.add_argument("--keep", action="store_true", help="keep the daemon's scratch folder (log, state)")
    ap.add_argument("--runs", type=int, default=1,
                    help="independent runs (a fresh reefd, and the bare loop seeded --seed + run): medians over runs")
    args = ap.parse_args()
    args.heldout_n = len(lt.HELDOUT)
    if args.quick:
        args.iterations, args.heldout_n, args.heldout_samples = 2, 8, 1
    heldout = lt.HELDOUT[: args.heldout_n]
    folder = model_folder()
    runs: list[tuple[dict[str, Arm], list[dict[str, Any]]]] = []
    for run in range(args.runs):
        if args.runs > 1:
            print(f"--- run {run + 1} of {args.runs} (bare seed {args.seed + run})", flush=True)
        runners: list[Any] = []
        if args.arm in ("both", "bare"):
            runners.append(BareRunner(folder, heldout, args.heldout_samples, args.seed + run))
        daemon = DaemonRunner(folder, heldout, args.heldout_samples, args.keep) if args.arm != "bare" else None
        try:
            if daemon is not None:
                runners.append(daemon)
            asyncio.run(drive(runners, args.iterations))
        finally:
            if daemon is not None:
                daemon.stop()
        runs.append(({r.arm.name: r.arm for r in runners}, daemon.releases if daemon else []))
        del runners  # the bare loop's model and optimizer
        gc.collect()
    plot([arms for arms, _ in runs], args.target, PNG)
    if not report(runs, args.target, args) and not args.quick:
        raise SystemExit(f"learning: the daemon did not reach held-out {args.target:g} within {GOAL}x the bare "
                         "loop's time (make demo fails on a missed goal)")


if __name__ == "__main__":
    main()
