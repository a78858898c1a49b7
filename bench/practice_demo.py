"""Practice alone makes SmolLM2 more correct: single-digit addition, through reefd with no client at all, against a
bare policy-gradient script on the same tasks in the same run.

Tasks: "What is A + B? Answer with the number only." for A, B in 0..9; 24 pairs are held out (never practised),
the other 76 are the practice set. An answer is right when its last number is A + B ("3 + 4 = 7")
(reefd.grow.practice.checks:last_number, the verifier reefd runs in its sandbox; the bare arm calls it directly).
Sampling is at temperature 0.5 (at 1.0 on the whole vocabulary the base model is right 1 time in 10, too rarely
to learn from), 16 new tokens at most (SmolLM2 spends a token per digit).
Held-out accuracy: the 24 held-out tasks x 2 answers (--eval-samples; 48 answers measure it to about +-0.07, and
the bare arm, measured every step, then touches a level by chance sooner), sampled so, scored the same way,
by one evaluator in this process for both arms (HF generate on SmolLM2 with the arm's LoRA adapter), with every
arm's clock stopped.
- Bare (bench/learning_bare.py): LoRA r 8 on q/k/v/o, AdamW lr 5e-4; per iteration 8 practice tasks x 2 samples,
  batch-normalised advantages, one REINFORCE step; held-out after every iteration.
- reefd: a real reefd serving scenario `add` (SmolLM2, max_batch 64): practice (32 tasks x 2 samples per round,
  all 64 answers at once on an idle engine; the next round waits while the last one's 64 records wait for their job:
  `max_waiting`) with the verifier above; recipe sao (the same LoRA, lr and clipping; a job's batch of 64 is 4
  steps of 16, the bare arm's step, with the ratio band narrowed to 1 +- 0.3, as its later steps are off-policy,
  and each step's advantages whitened, as the bare arm normalises its batch: normalize_advantages); trigger every
  64 records; gate always. Nobody sends a request or a report.
  It runs for --budget-x times the bare arm's clock; each release's adapter is then taken from the chain and
  evaluated, its clock being the time from the start of reefd's first practice round (its first answer being asked
  for) to the release.
Goal: held-out accuracy rises by at least 0.3, and reefd reaches the bare script's final level within 1.2x of the
time the bare script took to reach it (first reached; the ratio to the script's whole run is printed too). Prints
the curves, a PNG (bench/out/practice.png), held-out tasks the model got wrong before and right after, and one
JSON line, with the machine's speed measured before, between and after the arms (`gauge`).
Run: python bench/practice_demo.py [--iterations 30] [--budget-x 1.5] [--eval-samples 2]
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import time
from pathlib import Path
from typing import Any

from _harness import ROOT, Daemon, scratch_dir, start_reefd
from learning import model_folder
from learning_bare import Bare

from reefd.commit.chain import ReleaseChain
from reefd.grow.practice.checks import last_number

NAME, LR, MAX_TOKENS, TEMPERATURE, PER_ROUND, SAMPLES = "add", 5e-4, 16, 0.5, 8, 2
# reefd's arm: a round of 32 tasks x 2 answers is one job's batch, trained as 4 steps of 16 (the bare arm's step);
# the next round waits until the job took it (max_waiting), so it answers with the release just trained
REEFD_TASKS, MICRO = 32, 16
PNG = ROOT / "bench" / "out" / "practice.png"


def prompt(a: int, b: int) -> str:
    return f"What is {a} + {b}? Answer with the number only."


def split(seed: int = 0) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    pairs = [(a, b) for a in range(10) for b in range(10)]
    random.Random(seed).shuffle(pairs)
    return pairs[24:], pairs[:24]  # practice, held out


def right(text: str, a: int, b: int) -> float:
    return float(last_number(text, {"answer": a + b}))


class Evaluator:
    """Held-out accuracy of the base model or of an adapter, sampled as the bare arm samples."""

    def __init__(self, bare: Bare, heldout: list[tuple[int, int]], samples: int) -> None:
        self.bare, self.tasks = bare, [t for t in heldout for _ in range(samples)]

    def __call__(self) -> tuple[float, list[float]]:
        texts = self.bare.sample([prompt(a, b) for a, b in self.tasks])[1]
        scores = [right(t, a, b) for t, (a, b) in zip(texts, self.tasks, strict=True)]
        return sum(scores) / len(scores), scores

    def adapter(self, folder: Path | None) -> tuple[float, list[float]]:
        """The same evaluation with the bare model's LoRA replaced by `folder`'s (None: zero, the base model)."""
        from peft import get_peft_model_state_dict, set_peft_model_state_dict
        from safetensors.torch import load_file

        model, torch = self.bare.model, self.bare.torch
        saved = {k: v.detach().clone() for k, v in get_peft_model_state_dict(model).items()}
        try:
            state = load_file(str(folder / "adapter_model.safetensors")) if folder is not None else {
                k: torch.zeros_like(v) if "lora_B" in k else v for k, v in saved.items()}
            loaded = set_peft_model_state_dict(model, state)
            if loaded.unexpected_keys:
                raise RuntimeError(f"{folder}: not this LoRA's shape: {loaded.unexpected_keys[:3]}")
            return self()
        finally:
            set_peft_model_state_dict(model, saved)


def gauge(bare: Bare) -> float:
    """The machine's speed now: seconds for one forward and backward pass of the bare arm's LoRA on a fixed batch of
    the step's shape (16 x 60 tokens), the median of 3. Shared VMs change speed over minutes; the arms run one after
    the other, so the bench measures this before the bare arm, between the arms and after reefd's."""
    torch = bare.torch
    ids = torch.randint(0, 1000, (16, 60), generator=torch.Generator().manual_seed(0))
    times = []
    bare.model.train()
    for _ in range(4):
        t0 = time.perf_counter()
        bare.model(input_ids=ids).logits.float().mean().backward()
        times.append(time.perf_counter() - t0)
        bare.opt.zero_grad()
    return sorted(times[1:])[1]


def bare_arm(ev: Evaluator, practice: list[tuple[int, int]],
             iterations: int) -> tuple[list[tuple[float, float]], list[float], list[float]]:
    bare = ev.bare
    base, base_scores = ev()
    print(f"bare: held-out before {base:.3f}", flush=True)
    curve, clock, order = [(0.0, base)], 0.0, list(practice)
    scores: list[float] = base_scores
    for it in range(iterations):
        t0 = time.perf_counter()
        tasks = [order[(it * PER_ROUND + i) % len(order)] for i in range(PER_ROUND) for _ in range(SAMPLES)]
        batch, texts = bare.sample([prompt(a, b) for a, b in tasks])
        rewards = [right(t, a, b) for t, (a, b) in zip(texts, tasks, strict=True)]
        bare.step(batch, rewards)
        clock += time.perf_counter() - t0
        acc, scores = ev()
        curve.append((clock, acc))
        print(f"bare: iteration {it + 1}: batch {sum(rewards) / len(rewards):.2f}, clock {clock:.1f} s, "
              f"held-out {acc:.3f}", flush=True)
    return curve, base_scores, scores


def scenario(tmp: Path, practice: list[tuple[int, int]]) -> dict[str, str]:
    (tmp / "scenarios").mkdir(parents=True, exist_ok=True)
    with (tmp / "scenarios" / "add-practice.jsonl").open("w") as f:
        for a, b in practice:
            f.write(json.dumps({"prompt": prompt(a, b), "answer": a + b}) + "\n")
    batch = REEFD_TASKS * SAMPLES
    return {NAME: (
        "defaults: [{model: smollm2}, {recipe: sao}, {trigger: count}, {gate: always}, {release: follow}, _self_]\n"
        "description: bench/practice_demo.py, single-digit addition learned from practice alone.\n"
        f"model: {{max_batch: {batch}}}\n"
        f"recipe: {{params: {{batch_size: {batch}, micro_batch: {MICRO}, epochs: 1, lr: {LR}, lora_r: 8, "
        "lora_alpha: 16, max_grad_norm: 1.0, eps_high: 0.3, normalize_advantages: true, "
        "target_modules: [q_proj, k_proj, v_proj, o_proj]}}\n"
        f"trigger: {{every_n_records: {batch}}}\n"
        f"practice: {{tasks: add-practice.jsonl, verifier: {{function: 'reefd.grow.practice.checks:last_number'}}, "
        f"tasks_per_round: {REEFD_TASKS}, samples: {SAMPLES}, rounds_per_hour: 3600, max_waiting: {batch}, "
        f"concurrency: {batch}, max_tokens: {MAX_TOKENS}, temperature: {TEMPERATURE}}}\n")}


def watch_releases(d: Daemon, name: str, budget_s: float, poll_s: float = 0.2) -> list[tuple[float, str]]:
    """Each adapter release of scenario `name` for `budget_s`, as (seconds, id) when first seen (within `poll_s` of
    its swap)."""
    start, seen, releases = time.time(), set(), []
    while time.time() - start < budget_s:
        for rel in get(d, f"/reef/scenarios/{name}/releases")["data"]:
            if rel["id"] not in seen and rel.get("kind") == "adapter":
                seen.add(rel["id"])
                releases.append((time.time() - start, rel["id"]))
                print(f"reefd: {rel['id']} at {releases[-1][0]:.1f} s", flush=True)
        time.sleep(poll_s)
    return releases


def get(d: Daemon, path: str) -> dict[str, Any]:
    code, body = d.get(path)
    if code != 200:
        raise RuntimeError(f"GET {path}: {code} {body!r}")
    return dict(json.loads(body))


def daemon_arm(practice: list[tuple[int, int]], budget_s: float) -> tuple[list[tuple[float, str]], Path, Path,
                                                                           dict[str, Any]]:
    """reefd practising for `budget_s` from the start of its first practice round: (clock, release) of each release, the
    chain's folder and the scratch folder (removed by the caller), and practice's status at the end."""
    tmp = scratch_dir()
    d = start_reefd(tmp, scenario(tmp, practice), seed_model="smollm2")
    print(f"reefd: ready at {d.url} (log {d.log_path})", flush=True)
    try:
        while not any((get(d, "/reef/status")["scenarios"][0].get("practice") or {}).get(k)
                      for k in ("generating", "answers")):  # the first round has begun
            time.sleep(0.05)
        releases = watch_releases(d, NAME, budget_s)
        status = next(s for s in get(d, "/reef/status")["scenarios"] if s["name"] == NAME)["practice"]
    finally:
        d.stop()
    return sorted(releases), d.state / "releases.git", tmp, status


def reach(curve: list[tuple[float, float]], level: float) -> float | None:
    return next((t for t, acc in curve if acc >= level - 1e-9), None)


def plot(bare: list[tuple[float, float]], reefd: list[tuple[float, float]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    PNG.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, curve in (("bare script", bare), ("reefd, practice alone", reefd)):
        ax.plot([t for t, _ in curve], [a for _, a in curve], marker="o", markersize=3, label=label)
    ax.set_xlabel("clock (s)")
    ax.set_ylabel("held-out accuracy")
    ax.set_title("SmolLM2-135M, single-digit addition, 2 CPU cores")
    ax.set_ylim(0, 1)
    ax.legend()
    fig.tight_layout()
    fig.savefig(PNG, dpi=120)


def examples(heldout: list[tuple[int, int]], before: list[float], after: list[float], k: int) -> list[str]:
    """Held-out tasks right in fewer of their `k` samples before than after."""
    out = []
    for i, (a, b) in enumerate(heldout):
        was, now = before[i * k:(i + 1) * k], after[i * k:(i + 1) * k]
        if sum(now) > sum(was):
            out.append(f"{a} + {b}: {int(sum(was))}/{k} right before, {int(sum(now))}/{k} after")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iterations", type=int, default=30)
    ap.add_argument("--budget-x", type=float, default=1.5, help="reefd's run, in multiples of the bare clock")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-samples", type=int, default=2, help="answers per held-out task in an evaluation")
    args = ap.parse_args()
    practice, heldout = split(args.seed)
    bare = Bare(model_folder(), lr=LR, max_tokens=MAX_TOKENS, temperature=TEMPERATURE, seed=args.seed)
    speed = {"before_bare": gauge(bare)}
    ev = Evaluator(bare, heldout, args.eval_samples)
    bare_curve, base_scores, _ = bare_arm(ev, practice, args.iterations)
    speed["between"] = gauge(bare)
    budget = args.budget_x * bare_curve[-1][0]
    releases, chain_dir, tmp, status = daemon_arm(practice, budget)
    speed["after_reefd"] = gauge(bare)
    print("machine speed (s per forward+backward of the step's shape; lower is faster): "
          + ", ".join(f"{k} {v:.2f}" for k, v in speed.items()), flush=True)
    try:
        chain = ReleaseChain(chain_dir)
        base, _ = ev.adapter(None)
        reefd_curve, last_scores = [(0.0, base)], base_scores
        for clock, rid in releases:
            dest = tmp / "eval" / rid
            chain.materialize(rid, dest, folder="adapter")
            acc, last_scores = ev.adapter(dest)
            reefd_curve.append((clock, acc))
            print(f"reefd: {rid} at {clock:.1f} s: held-out {acc:.3f}", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    level = bare_curve[-1][1]
    t_bare, t_reefd = reach(bare_curve, level), reach(reefd_curve, level)
    ratio = None if t_bare is None or t_reefd is None or t_bare == 0 else t_reefd / t_bare
    # the other reading of "its time": the bare script's whole run, the time it took to its final state
    run_ratio = None if t_reefd is None else t_reefd / bare_curve[-1][0]
    rise = {"bare": round(bare_curve[-1][1] - bare_curve[0][1], 3),
            "reefd": round(max(a for _, a in reefd_curve) - reefd_curve[0][1], 3)}
    plot(bare_curve, reefd_curve)
    print(f"held-out: bare {bare_curve[0][1]:.3f} -> {bare_curve[-1][1]:.3f} in {bare_curve[-1][0]:.0f} s; reefd "
          f"{reefd_curve[0][1]:.3f} -> {reefd_curve[-1][1]:.3f} (best {max(a for _, a in reefd_curve):.3f}) with "
          f"{len(releases)} releases in {budget:.0f} s")
    print(f"time to the bare script's final level {level:.3f}: bare {t_bare} s, reefd {t_reefd} s"
          + (f" = {ratio:.2f}x (goal <= 1.2x: {'met' if ratio <= 1.2 else 'missed'})" if ratio is not None else
             " (reefd did not reach it)"))
    if run_ratio is not None:
        print(f"  against the bare script's whole run ({bare_curve[-1][0]:.0f} s to its final state): {run_ratio:.2f}x")
    print(f"rise (goal >= 0.3): bare {rise['bare']}, reefd {rise['reefd']}; practice {status}")
    for line in examples(heldout, base_scores, last_scores, args.eval_samples)[:8]:
        print(f"  {line}")
    print(json.dumps({"bench": "practice_demo", "iterations": args.iterations, "eval_samples": args.eval_samples,
                      "budget_s": round(budget, 1),
                      "bare": [(round(t, 1), a) for t, a in bare_curve],
                      "reefd": [(round(t, 1), a) for t, a in reefd_curve], "level": level,
                      "time_to_level_s": {"bare": t_bare, "reefd": t_reefd},
                      "ratio": None if ratio is None else round(ratio, 3),
                      "ratio_to_bare_run": None if run_ratio is None else round(run_ratio, 3), "rise": rise,
                      "practice": status, "speed_s": {k: round(v, 3) for k, v in speed.items()},
                      "goal": {"rise": 0.3, "ratio": 1.2}, "png": str(PNG.relative_to(ROOT))}))
    if not (rise["reefd"] >= 0.3 and ratio is not None and ratio <= 1.2):
        raise SystemExit("practice_demo: a goal was missed (held-out rise >= 0.3, time to the bare script's final "
                         "level <= 1.2x); make demo fails on it")


if __name__ == "__main__":
    main()
