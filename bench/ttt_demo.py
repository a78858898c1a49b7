"""TTT-Discover on SmolLM2 through reefd: get better at one packing problem by many scored attempts, against the
control (the same PUCT archive and the same attempts with the frozen base model: pure search, no training).

The problem: pack a box of capacity 100 with items of the given sizes, each at most once. The model writes a
packing; a program scores it (packing.score below): the valid items it names are summed, and the score is the
fill, S/100, when S <= 100, and falls to 0 as S overshoots to 200. The state kept in the archive is the packing the
program read (e.g. "37 + 51"), so the next attempts start from it.

The solver loop is the client the recipe README describes: POST /reef/scenarios/NAME/attempts/next gives the step's
parent states (PUCT) and their prompts; each group's R attempts go through the official `openai` SDK; each score is
reported at its coordinate with the packing as its state. reefd trains one LoRA step per full grid (TTT-Discover)
or only updates the archive (`train: false`, the control).

Per step it prints, for both arms, the mean reward, the best so far, β per group and the dropped groups, and draws
both curves in bench/out/ttt.png (bench/out/ttt.json has the figures).

Run: python bench/ttt_demo.py                       (make demo runs it; about 10 minutes on 2 cores)
     python bench/ttt_demo.py --steps 4 --model tiny  (the plumbing only: the tiny model writes no packings)
The last line printed is a JSON summary.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import re
import sys
import time
from pathlib import Path
from typing import Any

from _harness import ROOT, Daemon, scratch_dir

from tests.conftest import make_scenarios

OUT = ROOT / "bench" / "out"
CAPACITY = 100
ITEMS = [37, 12, 45, 8, 23, 51, 19, 30, 14, 6]
TASK = (f"Pack a box of capacity {CAPACITY} as full as possible without going over. Item sizes: "
        f"{', '.join(map(str, ITEMS))}. Each item at most once.")
PROMPT = TASK + ("\nThe best packing so far (score {score}): {state}\n"
                 "Answer with a better packing: the sizes joined by +.")
ARMS = {"ttt": ("TTT-Discover", True), "control": ("control: frozen base, same search", False)}
SCENARIO = """defaults:
  - model: {model}
  - recipe: ttt-discover
  - trigger: manual
  - gate: always
  - release: follow
  - _self_
model:
  max_batch: 8
recipe:
  params:
    groups: {groups}
    rollouts: {rollouts}
    lr: {lr}
    lora_r: 16
    lora_alpha: 32
    kl_coef: 0.1
    train: {train}
    temperature: 1.0
    max_tokens: {max_tokens}
    initial_state: "(nothing packed yet)"
    initial_score: 0.0
    prompt: {prompt}
    seed: {seed}
"""


class Packing:
    """The deterministic scorer: which listed items an answer names (each at most once), and their fill."""

    @staticmethod
    def read(text: str) -> list[int]:
        left = list(ITEMS)
        packed = []
        for token in re.findall(r"\d+", text):
            size = int(token)
            if size in left:
                left.remove(size)
                packed.append(size)
        return packed

    @staticmethod
    def score(text: str) -> tuple[float, str]:
        packed = Packing.read(text)
        total = sum(packed)
        value = total / CAPACITY if total <= CAPACITY else max(0.0, (2 * CAPACITY - total) / CAPACITY)
        return round(value, 4), " + ".join(map(str, packed)) if packed else "(nothing packed)"


class Arm:
    def __init__(self, arm: str, args: argparse.Namespace) -> None:
        import openai

        self.arm, self.args = arm, args
        label, train = ARMS[arm]
        self.label = label
        tmp = scratch_dir()
        scen = make_scenarios(tmp / "scenarios", names=(), extra={"learn": SCENARIO.format(
            model=args.model, groups=args.groups, rollouts=args.rollouts, lr=args.lr, train=str(train).lower(),
            max_tokens=args.max_tokens, prompt=json.dumps(PROMPT), seed=args.seed)})
        state = tmp / "state"
        if args.model == "smollm2":
            from reefd.worker.prepare import prepare

            home = Path.home() / ".local" / "state" / "reefd"
            (state / "models").mkdir(parents=True)
            (state / "models" / "smollm2").symlink_to(Path(prepare("smollm2", home / "models" / "smollm2")))
        self.d = Daemon(scenarios=scen, state=state, log_path=tmp / "reefd.log")
        self.d.start(wait_ready=False)
        self.d.wait_ready(600)
        self.client = openai.OpenAI(base_url=self.d.url + "/v1", api_key=self.d.token, max_retries=2, timeout=600,
                                    default_headers={"x-reef-scenario": "learn"})

    def plan(self) -> dict[str, Any]:
        deadline = time.monotonic() + 1800
        while time.monotonic() < deadline:
            code, body, _ = self.d.post("/reef/scenarios/learn/attempts/next?wait=60", {},
                                        headers={"x-reef-scenario": "learn"})
            if code == 200:
                return body
            if code != 202:
                raise RuntimeError(f"next step: {code} {body}")
            if body.get("job_state") == "failed":
                raise RuntimeError(f"the grid's job failed: {body.get('error')}\n{self.d.logs()[-3000:]}")
        raise RuntimeError("no next step within 30 minutes")

    def attempt(self, plan: dict[str, Any], group: int, rollout: int) -> float:
        parent = plan["parents"][group]
        raw = self.client.chat.completions.with_raw_response.create(
            model="learn", messages=parent["messages"], max_tokens=plan["sampling"]["max_tokens"],
            temperature=plan["sampling"]["temperature"], seed=self.args.seed * 1_000_003 + plan["step"] * 1009
            + group * 31 + rollout)
        text = raw.parse().choices[0].message.content or ""
        score, state = Packing.score(text)
        code, body, _ = self.d.post("/reef/report", {
            "references": [raw.headers["x-reef-agent-record-id"]], "score": score,
            "metadata": {"step": plan["step"], "group": group, "rollout": rollout, "state": state}},
            headers={"x-reef-scenario": "learn"})
        if code != 200:
            raise RuntimeError(f"report: {code} {body}")
        return score

    def run(self) -> dict[str, Any]:
        steps: list[dict[str, Any]] = []
        started = time.monotonic()
        try:
            for _ in range(self.args.steps):
                t0 = time.monotonic()
                plan = self.plan()
                cells = [(g, r) for g in range(plan["groups"]) for r in range(plan["rollouts"])]
                with concurrent.futures.ThreadPoolExecutor(8) as pool:
                    list(pool.map(self.attempt, [plan] * len(cells), *zip(*cells, strict=True)))
                if ARMS[self.arm][1]:  # wait for the grid's release (the next plan is served by it)
                    self.plan()
                entry = next(e for e in self.archive()["curve"] if e["step"] == plan["step"])
                entry["seconds"] = round(time.monotonic() - t0, 1)
                entry["parents"] = [p["id"] for p in plan["parents"]]
                steps.append(entry)
                betas = ",".join("-" if b is None else f"{b:.2f}" for b in entry.get("betas") or [])
                print(f"  [{self.arm}] step {entry['step']:2d} on {entry['release']}: mean {entry.get('mean', 0):.3f}"
                      f" max {entry.get('max', 0):.3f} best so far {entry.get('best_so_far') or 0:.3f}; beta "
                      f"{betas or '-'}; dropped {entry.get('dropped') or '-'}; {entry['state']} "
                      f"({entry['seconds']:.0f}s)", flush=True)
            best = self.archive()["best"]
        finally:
            self.d.stop()
        return {"arm": self.arm, "label": self.label, "steps": steps, "best": best,
                "seconds": round(time.monotonic() - started, 1)}

    def archive(self) -> dict[str, Any]:
        return dict(json.loads(self.d.get("/reef/scenarios/learn/archive")[1]))


def plot(runs: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for run in runs:
        xs = [e["step"] for e in run["steps"]]
        line = ax.plot(xs, [e.get("mean", 0) for e in run["steps"]], marker="o", label=f"{run['label']}: mean")[0]
        ax.plot(xs, [e.get("best_so_far") or 0 for e in run["steps"]], linestyle="--", color=line.get_color(),
                label=f"{run['label']}: best so far")
    ax.set_xlabel("step (one grid of attempts)")
    ax.set_ylabel("packing score (fill of the box)")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title("TTT-Discover vs. search alone: packing, SmolLM2-135M")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--rollouts", type=int, default=6)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--max-tokens", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", choices=list(ARMS))
    args = p.parse_args()
    runs = []
    for arm in [args.only] if args.only else list(ARMS):
        print(f"run: {ARMS[arm][0]}, {args.steps} steps of {args.groups} x {args.rollouts} attempts "
              f"({args.model})", flush=True)
        runs.append(Arm(arm, args).run())
    print("\nper step (mean reward / best so far):")
    print(f"  {'step':>4} " + " ".join(f"{r['arm'] + ' mean':>13} {r['arm'] + ' best':>13}" for r in runs))
    for i in range(max(len(r["steps"]) for r in runs)):
        cells = []
        for r in runs:
            e = r["steps"][i] if i < len(r["steps"]) else {}
            cells.append(f"{e.get('mean', float('nan')):13.3f} {e.get('best_so_far') or float('nan'):13.3f}")
        print(f"  {i:4d} " + " ".join(cells))
    summary: dict[str, Any] = {"bench": "ttt_demo", "model": args.model, "steps": args.steps, "groups": args.groups,
                               "rollouts": args.rollouts, "lr": args.lr, "png": str(OUT / "ttt.png")}
    for r in runs:
        means = [e.get("mean", 0.0) for e in r["steps"]]
        trained = [e["seconds"] for e in r["steps"]]
        summary[r["arm"]] = {"final_mean": means[-1], "last3_mean": sum(means[-3:]) / len(means[-3:]),
                             "first_mean": means[0], "best": r["best"]["score"], "best_state": r["best"]["state"],
                             "seconds_per_step": round(sum(trained) / len(trained), 1),
                             "dropped_groups": sum(len(e.get("dropped") or []) for e in r["steps"])}
    if len(runs) == 2:
        t, c = summary["ttt"], summary["control"]
        summary["ttt_mean_above_control"] = t["last3_mean"] > c["last3_mean"]
        summary["ttt_best_at_least_control"] = t["best"] >= c["best"]
        print(f"\nTTT-Discover's mean reward over the last 3 steps {t['last3_mean']:.3f} vs the control's "
              f"{c['last3_mean']:.3f} ({'above' if summary['ttt_mean_above_control'] else 'NOT above'}); best "
              f"{t['best']:.3f} vs {c['best']:.3f} ({'at least' if summary['ttt_best_at_least_control'] else 'BELOW'}"
              f"); {t['seconds_per_step']:.0f} s per TTT step, {c['seconds_per_step']:.0f} s per control step")
    OUT.mkdir(parents=True, exist_ok=True)
    plot(runs, OUT / "ttt.png")
    (OUT / "ttt.json").write_text(json.dumps({**summary, "runs": runs}, indent=1))
    print(json.dumps(summary))
    if len(runs) == 2 and not summary["ttt_mean_above_control"]:
        print("ttt_demo: goal missed (TTT-Discover's mean reward over its last 3 steps above the control's)",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
