"""Learning from reports alone: SmolLM2 served by reefd gets better at "Answer in one word." on 2 CPU cores.

Task (bench/learning_tasks.py): short open questions ending "Answer in one word."; score 1 when the
answer has 1-3 words, else 0. Held-out success: the mean score over a fixed held-out set (24 questions
x 2 answers at temperature 1.0, disjoint from the training and gate questions), never reported.
Baseline, measured in the same run: a bare policy-gradient script in this process, no server: LoRA r 8
(alpha 16) on q/k/v/o, AdamW lr 5e-4, per iteration 8 questions x 2 samples at temperature 1.0 (16 new
tokens at most, chat template), advantages (score - batch mean) / (batch std + 1e-6), one REINFORCE step
(token mean of -A log p over the completion up to its first EOS, grad norm clipped at 1.0).
The daemon arm: a real reefd serving scenario `learn` (model smollm2 with max_batch 16, recipe sao with
matching settings and one optimizer step per batch of 16, trigger every 16 records, holdout gate on 8
questions of its own with margin -0.15, release follow). One AsyncOpenAI client sends the same 8 x 2
questions per iteration with `x-reef-scenario`, reports every score to /reef/report with its receipt,
then waits for the job that its batch triggered (train -> gate -> publish or reject -> hot swap) before
the next iteration, as the bare loop waits for its own update. Held-out success is measured through
reefd after every new release (answers must carry the new `x-reef-release-id`).
Clocks: each arm's wall clock starts once its model is loaded and its base success measured, and is
paused during every held-out evaluation, in both arms. Everything else counts: for reefd that is HTTP,
records, reports, the trainer subprocess (its start-up and model load included), the gate and the swap.
The figure of merit is the wall time to the first held-out evaluation at or above --target (0.8); the
ratio is daemon / bare (goal <= 1.3x). With 48 binary answers per evaluation its noise is about +-0.06.
Run: python bench/learning.py [--iterations 15] [--arm both|bare|daemon] [--quick] [--keep]
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import learning_tasks as lt
from _harness import ROOT, Daemon, scratch_dir, start_reefd

GOAL = 1.3
NAME = "learn"
LR, MAX_TOKENS, TEMPERATURE, PROMPTS, SAMPLES = 5e-4, 16, 1.0, 8, 2
LORA = {"r": 8, "lora_alpha": 16, "lora_dropout": 0.0, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}
PNG = ROOT / "bench" / "out" / "learning.png"


@dataclass
class Arm:
    """One arm's learning curve: (clock s, held-out success, label) points, plus per-iteration notes."""

    name: str
    clock: float = 0.0
    started: float | None = None
    points: list[tuple[float, float, str]] = field(default_factory=list)
    notes: list[dict[str, Any]] = field(default_factory=list)
    samples: dict[str, list[str]] = field(default_factory=dict)

    def resume(self) -> None:
        self.started = time.perf_counter()

    def pause(self) -> float:
        assert self.started is not None
        self.clock += time.perf_counter() - self.started
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


class Bare:
    """A PEFT LoRA policy, batched sampling with HF generate, and one REINFORCE step per batch."""

    def __init__(self, folder: Path, seed: int) -> None:
        import torch
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
        torch.manual_seed(seed)
        self.torch = torch
        self.tok = AutoTokenizer.from_pretrained(folder, padding_side="left")
        base = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        self.model = get_peft_model(base, LoraConfig(task_type="CAUSAL_LM", **LORA))
        self.eos = int(self.tok.eos_token_id)
        self.opt = torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad], lr=LR,
                                     weight_decay=0.0)

    def sample(self, questions: list[str]) -> tuple[Any, Any, Any, list[str]]:
        """One answer per question: prompt ids and mask (left-padded), completion ids and mask, texts."""
        torch = self.torch
        chats = [self.tok.apply_chat_template([{"role": "user", "content": lt.prompt(q)}], tokenize=False,
                                              add_generation_prompt=True) for q in questions]
        enc = self.tok(chats, return_tensors="pt", padding=True, add_special_tokens=False)
        self.model.eval()
        with torch.no_grad():
            out = self.model.generate(**enc, do_sample=True, temperature=TEMPERATURE, top_k=0, top_p=1.0,
                                      max_new_tokens=MAX_TOKENS, pad_token_id=self.eos)
        comp = out[:, enc["input_ids"].shape[1]:]
        is_eos = (comp == self.eos).int()
        mask = (is_eos.cumsum(1) - is_eos == 0).long()  # up to and including the first EOS
        texts = [self.tok.decode(c[m.bool()], skip_special_tokens=True) for c, m in zip(comp, mask, strict=True)]
        return enc["input_ids"], enc["attention_mask"], (comp, mask), texts

    def step(self, prompt: Any, prompt_mask: Any, completion: tuple[Any, Any], scores: list[float]) -> float:
        torch = self.torch
        comp, mask = completion
        r = torch.tensor(scores)
        adv = (r - r.mean()) / (r.std(unbiased=False) + 1e-6)
        ids, attn = torch.cat([prompt, comp], 1), torch.cat([prompt_mask, mask], 1)
        pos = (attn.cumsum(1) - 1).clamp(min=0)
        self.model.train()
        logits = self.model(input_ids=ids, attention_mask=attn, position_ids=pos).logits[:, prompt.shape[1] - 1:-1]
        logp = torch.log_softmax(logits.float(), -1).gather(-1, comp[..., None])[..., 0]
        loss = -(adv[:, None] * logp * mask).sum() / mask.sum()
        self.opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for p in self.model.parameters() if p.requires_grad], 1.0)
        self.opt.step()
        return float(loss)

    def heldout(self, questions: list[str], samples: int) -> tuple[float, list[str]]:
        texts = self.sample([q for q in questions for _ in range(samples)])[3]
        return sum(lt.score(t) for t in texts) / len(texts), texts


def bare_arm(folder: Path, iterations: int, heldout: list[str], samples: int, seed: int) -> Arm:
    arm = Arm("bare")
    bare = Bare(folder, seed)
    base, texts = bare.heldout(heldout, samples)
    arm.points.append((0.0, base, "base"))
    arm.samples["before"] = texts[:6]
    print(f"bare: held-out before {base:.3f}", flush=True)
    for it in range(iterations):
        arm.resume()
        t0 = time.perf_counter()
        questions = [q for q in batch_questions(it) for _ in range(SAMPLES)]
        prompt, prompt_mask, completion, answers = bare.sample(questions)
        scores = [lt.score(t) for t in answers]
        t1 = time.perf_counter()
        loss = bare.step(prompt, prompt_mask, completion, scores)
        t2 = time.perf_counter()
        clock = arm.pause()
        success, texts = bare.heldout(heldout, samples)
        arm.points.append((clock, success, f"it{it + 1}"))
        arm.samples["after"] = texts[:6]
        arm.notes.append({"iteration": it + 1, "batch_score": sum(scores) / len(scores), "sample_s": t1 - t0,
                          "train_s": t2 - t1, "loss": loss})
        print(f"bare: iteration {it + 1}: batch {sum(scores) / len(scores):.2f}, sample {t1 - t0:.1f} s, "
              f"update {t2 - t1:.1f} s, clock {clock:.1f} s, held-out {success:.3f}", flush=True)
    return arm


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

    async def wait_job(self, receipts: set[str], timeout_s: float = 900) -> dict[str, Any]:
        """The job that took these receipts, once it is over; notes when each stage was first seen."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for job in (await self.get(f"/reef/jobs?scenario={NAME}"))["data"]:
                seen = self.stages.setdefault(job["id"], {})
                seen.setdefault(job["stage"], time.time())
                if receipts & set(job["receipts"]) and job["state"] not in ("queued", "running"):
                    return dict(job)
            await asyncio.sleep(0.1)
        raise RuntimeError(f"no finished job for the batch within {timeout_s:.0f} s:\n{self.daemon.logs()}")

    async def heldout(self, questions: list[str], samples: int, release: str) -> tuple[float, list[str]]:
        answers = await asyncio.gather(*(self.ask(q) for q in questions for _ in range(samples)))
        stale = [rel for _, _, rel in answers if rel != release]
        if stale:
            raise RuntimeError(f"held-out answers from {sorted(set(stale))}, not the head {release}")
        texts = [t for t, _, _ in answers]
        return sum(lt.score(t) for t in texts) / len(texts), texts


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
            "train_s": span("train", "gate"), "gate_s": span("gate", "publish"),
            "publish_swap_s": span("publish", None), "gate_verdict": gate.get("reason"), "trainer": job["metrics"]}


async def daemon_loop(client: Client, arm: Arm, iterations: int, heldout: list[str], samples: int) -> None:
    head = (await client.get(f"/reef/scenarios/{NAME}/releases"))["serving"]
    base, texts = await client.heldout(heldout, samples, head)
    arm.points.append((0.0, base, head))
    arm.samples["before"] = texts[:6]
    print(f"daemon: held-out before {base:.3f} ({head})", flush=True)
    for it in range(iterations):
        arm.resume()
        t0 = time.perf_counter()
        answers = await asyncio.gather(*(client.ask(q) for q in batch_questions(it) for _ in range(SAMPLES)))
        scores = [lt.score(t) for t, _, _ in answers]
        await asyncio.gather(*(client.report(rec, s) for (_, rec, _), s in zip(answers, scores, strict=True)))
        t1 = time.perf_counter()
        job = await client.wait_job({rec for _, rec, _ in answers})
        t2 = time.perf_counter()
        clock = arm.pause()
        note = {"iteration": it + 1, "batch_score": sum(scores) / len(scores), "sample_report_s": t1 - t0,
                "job_wait_s": t2 - t1, **job_note(job, client.stages.get(job["id"], {}))}
        arm.notes.append(note)
        line = (f"daemon: iteration {it + 1}: batch {note['batch_score']:.2f}, sample+report {t1 - t0:.1f} s, "
                f"job {job['id']} {job['state']} {job['release'] or ''} after {t2 - t1:.1f} s "
                f"(train {note['train_s']} s, gate {note['gate_s']} s, publish+swap {note['publish_swap_s']} s), "
                f"clock {clock:.1f} s")
        if job["state"] == "published":
            success, texts = await client.heldout(heldout, samples, job["release"])
            arm.points.append((clock, success, job["release"]))
            arm.samples["after"] = texts[:6]
            line += f", held-out {success:.3f}"
        elif job["state"] == "rejected":
            line += f": {note['gate_verdict']}"
        else:
            line += f": {job['error']}"
        print(line, flush=True)


def daemon_arm(folder: Path, iterations: int, heldout: list[str], samples: int, keep: bool) -> tuple[Arm, list]:
    tmp = scratch_dir()
    (tmp / "state" / "models").mkdir(parents=True)
    (tmp / "state" / "models" / "smollm2").symlink_to(folder)  # the copy converted once, not a fresh one
    arm, ok = Arm("daemon"), False
    daemon = start_reefd(tmp, scenario_files(tmp), env={"REEF_KEEP_FAILED_JOBS": "1"})
    print(f"daemon: reefd ready at {daemon.url}; scratch {tmp} (log {daemon.log_path})", flush=True)

    async def run() -> list[dict[str, Any]]:
        client = Client(daemon)
        try:
            await daemon_loop(client, arm, iterations, heldout, samples)
            releases: list[dict[str, Any]] = (await client.get(f"/reef/scenarios/{NAME}/releases?all=1"))["data"]
            return releases
        finally:
            await client.close()

    try:
        releases = asyncio.run(run())
        ok = True
    finally:
        daemon.stop()
        if ok and not keep:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            print(f"daemon: scratch kept at {tmp}", flush=True)
    return arm, releases


# ---------------------------------------------------------------- output


def plot(arms: list[Arm], target: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for arm in arms:
        ts, ss = [t for t, _, _ in arm.points], [s for _, s, _ in arm.points]
        ax.step(ts, ss, where="post", marker="o", label=f"{arm.name} ({len(arm.points) - 1} evaluations)")
    ax.axhline(target, color="grey", linestyle="--", linewidth=1, label=f"target {target:g}")
    ax.set(xlabel="wall time, held-out evaluation excluded (s)", ylabel="held-out success",
           title="SmolLM2-135M, 'Answer in one word.', 2 CPU cores", ylim=(0, 1.05))
    ax.legend(loc="lower right")
    ax.grid(alpha=0.3)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def report(arms: dict[str, Arm], releases: list[dict[str, Any]], target: float, args: argparse.Namespace) -> None:
    result: dict[str, Any] = {"bench": "learning", "model": "smollm2", "iterations": args.iterations,
                              "heldout_answers": args.heldout_n * args.heldout_samples, "target": target, "goal": GOAL}
    for arm in arms.values():
        reach = arm.reach(target)
        first, last = arm.points[0][1], arm.points[-1][1]
        print(f"{arm.name}: held-out success {first:.3f} -> {last:.3f} (best {max(s for _, s, _ in arm.points):.3f}); "
              f"clock {arm.clock:.1f} s over {len(arm.notes)} iterations; reached {target:g} "
              + (f"at {reach:.1f} s" if reach is not None else "never"))
        for when, texts in arm.samples.items():
            print(f"  {when}: " + " | ".join(repr(t[:40]) for t in texts))
        result[arm.name] = {"before": round(first, 4), "after": round(last, 4), "clock_s": round(arm.clock, 2),
                            "reach_s": None if reach is None else round(reach, 2),
                            "curve": [[round(t, 2), round(s, 4), label] for t, s, label in arm.points]}
    if releases:
        made = [r for r in releases if r["status"] == "released" and r["kind"] != "base"]
        print(f"releases ({len(made)} published, {len(releases) - len(made) - 1} rejected), newest first:")
        for r in releases:
            gate = (r["meta"].get("gate") or {}).get("reason", "")
            print(f"  {r['id']:>12} {r['status']:>8} {r['kind']:>7} {gate}")
        result["daemon"]["releases"] = [{"id": r["id"], "status": r["status"], "kind": r["kind"],
                                         "gate": (r["meta"].get("gate") or {}).get("reason")} for r in releases]
        result["daemon"]["jobs"] = [{k: v for k, v in n.items() if k != "trainer"} for n in arms["daemon"].notes]
    if "bare" in arms:
        result["bare"]["iterations"] = arms["bare"].notes
    if len(arms) == 2:
        bare_s, daemon_s = arms["bare"].reach(target), arms["daemon"].reach(target)
        ratio = None if bare_s is None or daemon_s is None else daemon_s / bare_s
        verdict = "n/a" if ratio is None else "meets" if ratio <= GOAL else "misses"
        print(f"time to held-out {target:g}: bare {bare_s} s, daemon {daemon_s} s; ratio daemon / bare "
              + (f"{ratio:.2f}x" if ratio is not None else "n/a (an arm never reached the target)")
              + f" ({verdict} the {GOAL}x goal)")
        result["ratio"] = None if ratio is None else round(ratio, 3)
    print(f"learning curve: {PNG}")
    print(json.dumps(result))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iterations", type=int, default=15)
    ap.add_argument("--arm", choices=("both", "bare", "daemon"), default="both")
    ap.add_argument("--quick", action="store_true", help="a smoke run: 2 iterations, 8 held-out answers")
    ap.add_argument("--target", type=float, default=0.8, help="held-out success whose time is compared")
    ap.add_argument("--heldout-samples", type=int, default=2, help="answers per held-out question")
    ap.add_argument("--seed", type=int, default=0, help="the bare script's torch seed")
    ap.add_argument("--keep", action="store_true", help="keep the daemon's scratch folder (log, state)")
    args = ap.parse_args()
    args.heldout_n = len(lt.HELDOUT)
    if args.quick:
        args.iterations, args.heldout_n, args.heldout_samples = 2, 8, 1
    heldout = lt.HELDOUT[: args.heldout_n]
    folder = model_folder()
    arms: dict[str, Arm] = {}
    releases: list[dict[str, Any]] = []
    if args.arm in ("both", "bare"):
        arms["bare"] = bare_arm(folder, args.iterations, heldout, args.heldout_samples, args.seed)
    if args.arm in ("both", "daemon"):
        arms["daemon"], releases = daemon_arm(folder, args.iterations, heldout, args.heldout_samples, args.keep)
    plot(list(arms.values()), args.target, PNG)
    report(arms, releases, args.target, args)


if __name__ == "__main__":
    main()
