"""OpenClaw-RL on SmolLM2 through reefd: the served model learns a user's preference from the conversation
alone. No `/reef/report` call is ever made.

A simulated user (bench/openclaw_user.py) wants every answer to start with an opening ("Hello" by default) and
says so only as a correction ("Please start your answer with 'Hello'.") when an answer misses it. Conversations
go through the official `openai` SDK with a session header. Each turn is judged from the user's next message (a
scripted judge by default, labelled as such), a count trigger trains a LoRA from the judgments, and the release
is hot-swapped. After each round the demo measures held-out compliance: greedy answers to questions never used
in training, sent as side calls (`x-reef-turn: side`) so they never train. A run stops when it reaches the
target (0.8) or its time budget.

Before training, a preflight checks on the base model, for the chosen opening and a few others, that the hint
raises the teacher's log p of the opening, how often the opening's first token is the hinted teacher's top token
(a bound on what distillation can teach), and how often it is in the policy's own top 4 (the engine's set).
Then the arms: RL + OPD (the main run, up to 15 min), RL only, OPD only, RL + OPD over the engine's top-K set
alone (the paper's set; the others use `opd_set: union`), and RL + OPD with SmolLM2 itself as the judge.

Run: python bench/openclaw_demo.py            (make demo runs it; about 25 minutes on 2 cores)
     python bench/openclaw_demo.py --only both --opening "In short"
Writes bench/out/openclaw.png and bench/out/openclaw.json; the last line printed is a JSON summary.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

import openclaw_user as user_sim
from _harness import ROOT, Daemon, scratch_dir

from tests.conftest import make_scenarios

OUT = ROOT / "bench" / "out"
CANDIDATES = ["OK:", "In short", "Hello", "Sure"]
PUNCT = ".,:;!?\"'"
# arm: label, w_rl, w_opd, opd_set (None: --opd-set), judge
ARMS: dict[str, tuple[str, float, float, str | None, str]] = {
    "both": ("RL + OPD", 1.0, 1.0, None, "scripted"),
    "rl": ("RL term only", 1.0, 0.0, None, "scripted"),
    "opd": ("OPD term only", 0.0, 1.0, None, "scripted"),
    "engine": ("RL + OPD, engine top-K set", 1.0, 1.0, "engine", "scripted"),
    "judge": ("RL + OPD, SmolLM2 as judge", 1.0, 1.0, None, "smollm2"),
}
SCENARIO = """defaults:
  - model: smollm2
  - recipe: openclaw-rl
  - trigger: count
  - gate: always
  - release: follow
  - _self_
model:
  max_batch: 8
recipe:
  params:
    batch_size: {batch}
    lr: {lr}
    w_rl: {w_rl}
    w_opd: {w_opd}
    top_k: {top_k}
    opd_set: {opd_set}
    judge: {judge}
serve:
  temperature: 1.0
  default_max_tokens: {max_tokens}
"""


# ------------------------------------------------------------------ preflight: does the hint help the teacher?

def preflight(openings: list[str]) -> list[dict[str, Any]]:
    """For each opening, on the held-out questions with the base model: log p of the whole opening without and with
    the hint (the teacher's prompt), how often its first token is the hinted teacher's top token, and how often it
    is in the base model's top 4 (the set distillation works on)."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from recipes.openclaw_rl.objective import with_hint
    from reefd.serve.chat import ChatRequest, ChatTemplate
    from reefd.worker.prepare import prepare

    hf_logging.disable_progress_bar()
    folder = model_folder(prepare)
    template = ChatTemplate(folder)
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    rows = []
    for opening in openings:
        target = template.encode(opening)
        hint = f"Start every answer with '{opening}'."
        stats: dict[str, list[float]] = {"bare": [], "hinted": [], "teacher_top1": [], "student_top4": []}
        for q in user_sim.HELD_OUT:
            for key, messages in (("bare", [{"role": "user", "content": q}]),
                                  ("hinted", with_hint([{"role": "user", "content": q}], hint))):
                prompt = template.prompt_ids(ChatRequest(messages=messages, max_tokens=1))
                ids = torch.tensor([prompt + target])
                with torch.no_grad():
                    logp = model(ids).logits[0].float().log_softmax(-1)
                n = len(prompt)
                stats[key].append(sum(float(logp[n - 1 + i, t]) for i, t in enumerate(target)))
                first = logp[n - 1]
                rank = int((first > first[target[0]]).sum())
                if key == "hinted":
                    stats["teacher_top1"].append(float(rank == 0))
                else:
                    stats["student_top4"].append(float(rank < 4))
        rows.append({"opening": opening, **{k: sum(v) / len(v) for k, v in stats.items()}})
    return rows


def model_folder(prepare: Any) -> Path:
    home = Path(os.environ.get("REEF_STATE") or Path.home() / ".local" / "state" / "reefd")
    return Path(prepare("smollm2", home / "models" / "smollm2"))


# ------------------------------------------------------------------ one run through reefd

class Run:
    def __init__(self, arm: str, args: argparse.Namespace) -> None:
        from reefd.worker.prepare import prepare

        self.arm, self.args = arm, args
        _, w_rl, w_opd, opd_set, judge = ARMS[arm]
        opd_set = opd_set or args.opd_set
        judge_cfg = ("{model: bench.openclaw_user:judge}" if judge == "scripted"
                     else "{model: null, votes: 3, max_tokens: " + str(args.judge_tokens) + ", concurrency: 2}")
        tmp = scratch_dir()
        scen = make_scenarios(tmp / "scenarios", names=(), extra={"learn": SCENARIO.format(
            batch=args.batch, lr=args.lr, w_rl=w_rl, w_opd=w_opd, top_k=args.top_k, opd_set=opd_set,
            judge=judge_cfg,
            max_tokens=args.max_tokens)})
        (scen / "trigger" / "count.yaml").write_text(f"every_n_records: {args.batch}\n")
        state = tmp / "state"
        (state / "models").mkdir(parents=True)
        (state / "models" / "smollm2").symlink_to(model_folder(prepare))
        self.d = Daemon(scenarios=scen, state=state, log_path=tmp / "reefd.log",
                        env={"REEF_DEMO_OPENING": args.opening, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'bench'}"})
        self.d.start(wait_ready=False)
        self.d.wait_ready(600)
        import openai

        self.client = openai.OpenAI(base_url=self.d.url + "/v1", api_key=self.d.token, max_retries=2,
                                    timeout=600, default_headers={"x-reef-scenario": "learn"})
        self.rng = random.Random(args.seed)
        self.sessions = 0

    def ask(self, messages: list[dict[str, Any]], headers: dict[str, str], temperature: float | None = None,
            max_tokens: int | None = None) -> tuple[str, str]:
        raw = self.client.chat.completions.with_raw_response.create(
            model="learn", messages=messages, max_tokens=max_tokens or self.args.max_tokens,  # type: ignore[arg-type]
            extra_headers=headers, **({"temperature": temperature} if temperature is not None else {}))
        return raw.parse().choices[0].message.content or "", raw.headers["x-reef-release-id"]

    def conversation(self) -> None:
        """One user: three questions' worth of turns, corrected whenever an answer misses the opening."""
        self.sessions += 1
        session = f"{self.arm}-{self.sessions}-{self.rng.random():.6f}"
        questions = self.rng.sample(user_sim.TRAIN, 3)
        messages: list[dict[str, Any]] = [{"role": "user", "content": questions[0]}]
        for turn in range(self.args.turns):
            answer, _ = self.ask(messages, {"x-reef-session": session})
            messages.append({"role": "assistant", "content": answer})
            if turn + 1 < self.args.turns:
                messages.append({"role": "user", "content": user_sim.reply(answer, questions[(turn + 1) % 3])})

    def round(self) -> None:
        with concurrent.futures.ThreadPoolExecutor(self.args.users) as pool:
            list(pool.map(lambda _: self.conversation(), range(self.args.users)))

    def evaluate(self) -> tuple[float, float, str]:
        """Held-out compliance, and the share that at least opens with the opening's first word: greedy answers,
        sent as side calls (never judged or trained)."""
        first = self.args.opening.split()[0].strip(PUNCT).lower()

        def one(q: str) -> tuple[bool, bool, str]:
            answer, release = self.ask([{"role": "user", "content": q}], {"x-reef-turn": "side"}, temperature=0.0,
                                       max_tokens=6)
            words = answer.split()
            return user_sim.complies(answer), bool(words) and words[0].strip(PUNCT).lower() == first, release

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            results = list(pool.map(one, user_sim.HELD_OUT))
        n = len(results)
        return sum(r[0] for r in results) / n, sum(r[1] for r in results) / n, results[-1][2]

    def settle(self, timeout_s: float = 600) -> list[dict[str, Any]]:
        """Wait until every linked turn is judged and every job it triggered has finished; the jobs."""
        deadline = time.monotonic() + timeout_s
        quiet = 0
        while time.monotonic() < deadline:
            status = json.loads(self.d.get("/reef/status")[1])["scenarios"][0]
            jobs = json.loads(self.d.get("/reef/jobs?scenario=learn")[1])["data"]
            busy = status.get("judge", {}).get("pending", 0) or any(
                j["state"] not in ("published", "rejected", "failed", "skipped") for j in jobs)
            quiet = 0 if busy else quiet + 1
            if quiet >= 3:
                return list(jobs)
            time.sleep(0.5)
        raise RuntimeError(f"reefd did not settle:\n{self.d.logs()[-3000:]}")

    def verdicts(self, job: dict[str, Any]) -> dict[str, int]:
        mix = {"+1": 0, "-1": 0, "0": 0, "hinted": 0}
        for receipt in job.get("receipts") or []:
            record = json.loads(self.d.get(f"/reef/records/{receipt}")[1])
            judged = [r for r in record.get("reports") or [] if r.get("source") == "judge"]
            if judged:
                meta = judged[-1]["metadata"]
                mix[f"{meta['verdict']:+d}" if meta["verdict"] else "0"] += 1
                mix["hinted"] += bool(meta.get("hints"))
        return mix

    def go(self, minutes: float, target: float) -> dict[str, Any]:
        started = time.monotonic()
        compliance, opens, release = self.evaluate()
        curve = [{"t_s": 0.0, "release": release, "compliance": compliance, "first_word": opens, "jobs": 0}]
        print(f"  [{self.arm}] t=   0s release {release}: held-out compliance {compliance:.2f}, first word "
              f"{opens:.2f} (base)", flush=True)
        seen: dict[str, str] = {}
        while time.monotonic() - started < minutes * 60 and compliance < target:
            self.round()
            jobs = self.settle()
            new = [j for j in jobs if j["id"] not in seen]
            seen.update({j["id"]: j["state"] for j in new})
            compliance, opens, release = self.evaluate()
            t = time.monotonic() - started
            mixes = [self.verdicts(j) for j in new if j["state"] == "published"]
            curve.append({"t_s": round(t, 1), "release": release, "compliance": compliance, "first_word": opens,
                          "jobs": len(seen), "verdicts": mixes,
                          "job_states": [j["state"] for j in new]})
            mix = "; ".join(f"+1:{m['+1']} -1:{m['-1']} 0:{m['0']} hinted:{m['hinted']}" for m in mixes) or "-"
            made = ", ".join(f"{j['release']} ({j['state']})" if j.get("release") else j["state"] for j in new)
            print(f"  [{self.arm}] t={t:4.0f}s release {release}: held-out compliance {compliance:.2f}, first word "
                  f"{opens:.2f}; jobs {len(seen)}: {made or '-'}; verdicts per batch: {mix}", flush=True)
        self.d.stop()
        reached = next((p["t_s"] for p in curve if p["compliance"] >= target), None)
        return {"arm": self.arm, "base": curve[0]["compliance"], "final": curve[-1]["compliance"],
                "best": max(p["compliance"] for p in curve), "reached_target_s": reached,
                "first_word_base": curve[0]["first_word"], "first_word_final": curve[-1]["first_word"],
                "first_word_best": max(p["first_word"] for p in curve),
                "seconds": curve[-1]["t_s"], "releases": sum(s == "published" for s in seen.values()), "curve": curve}


def plot(runs: list[dict[str, Any]], target: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for run in runs:
        minutes = [p["t_s"] / 60 for p in run["curve"]]
        line = ax.plot(minutes, [p["compliance"] for p in run["curve"]], marker="o", label=run["label"])[0]
        ax.plot(minutes, [p["first_word"] for p in run["curve"]], linestyle="--", color=line.get_color(),
                label=f"{run['label']}: first word only")
    ax.axhline(target, color="grey", linestyle=":", label=f"goal {target}")
    ax.set_xlabel("minutes")
    ax.set_ylabel("held-out share (greedy)")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title("OpenClaw-RL on SmolLM2-135M: learning from the conversation alone")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--opening", default="Hello", help="the user's hidden preference: the answer's opening")
    p.add_argument("--only", choices=list(ARMS), help="run one arm only")
    p.add_argument("--minutes", type=float, default=15.0, help="time budget of the main run (both terms)")
    p.add_argument("--ablation-minutes", type=float, default=6.0, help="time budget of each ablation arm")
    p.add_argument("--judge-minutes", type=float, default=4.0, help="time budget of the SmolLM2-judge run")
    p.add_argument("--judge-tokens", type=int, default=48, help="max tokens per SmolLM2 judge vote")
    p.add_argument("--target", type=float, default=0.8)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--users", type=int, default=8, help="conversations per round, at once")
    p.add_argument("--turns", type=int, default=3, help="assistant turns per conversation (the last is final)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--opd-set", choices=["engine", "union"], default="union",
                   help="distill over the engine's top-K, or its union with the hinted teacher's own top-K")
    p.add_argument("--max-tokens", type=int, default=3, help="answer length in training rounds (the opening "
                   "is what the user judges; short answers put more of each sample's loss on it, and are faster)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-preflight", action="store_true")
    args = p.parse_args()
    os.environ["REEF_DEMO_OPENING"] = args.opening
    summary: dict[str, Any] = {"bench": "openclaw_demo", "model": "smollm2", "opening": args.opening,
                               "judge": "scripted (bench/openclaw_user.py:judge)", "runs": []}
    if not args.skip_preflight:
        print("preflight: does the hint raise the teacher's log p of the opening? (base model, held-out questions)")
        print(f"  {'opening':10} {'log p bare':>10} {'log p hinted':>12} {'teacher top-1':>13} "
              f"{'in student top-4':>16}")
        rows = preflight(list(dict.fromkeys([args.opening, *CANDIDATES])))
        for row in rows:
            print(f"  {row['opening']:10} {row['bare']:10.2f} {row['hinted']:12.2f} {row['teacher_top1']:13.2f} "
                  f"{row['student_top4']:16.2f}")
        chosen = rows[0]
        raises = chosen["hinted"] > chosen["bare"]
        print(f"  the hint {'raises' if raises else 'does NOT raise'} log p of {args.opening!r} by "
              f"{chosen['hinted'] - chosen['bare']:+.2f} nats; the hinted teacher's top token is the opening's first "
              f"token on {chosen['teacher_top1']:.0%} of held-out questions (a bound on what distillation alone "
              f"can teach)")
        summary["preflight"] = rows
    for arm in [args.only] if args.only else list(ARMS):
        label, _, _, opd_set, judge = ARMS[arm]
        minutes = {"both": args.minutes, "judge": args.judge_minutes}.get(arm, args.ablation_minutes)
        print(f"run: {label}, distillation set {opd_set or args.opd_set}, judge: "
              f"{'SCRIPTED function' if judge == 'scripted' else 'SmolLM2 (the base model)'}; up to {minutes:g} min",
              flush=True)
        result = Run(arm, args).go(minutes, args.target)
        result.update({"label": label, "judge": judge, "opd_set": opd_set or args.opd_set})
        summary["runs"].append(result)
    print("\nablation (the judge is the scripted function, except in the last arm):")
    print(f"  {'arm':30} {'base':>5} {'final':>6} {'best':>5} {'reached':>8} {'first word':>15} {'minutes':>8} "
          f"{'releases':>8}")
    for run in summary["runs"]:
        reached = "-" if run["reached_target_s"] is None else f"{run['reached_target_s'] / 60:.1f}m"
        words = f"{run['first_word_base']:.2f} -> {run['first_word_final']:.2f}"
        print(f"  {run['label']:30} {run['base']:5.2f} {run['final']:6.2f} {run['best']:5.2f} {reached:>8} "
              f"{words:>15} {run['seconds'] / 60:8.1f} {run['releases']:8d}")
    png = OUT / "openclaw.png"
    plot(summary["runs"], args.target, png)
    (OUT / "openclaw.json").write_text(json.dumps(summary, indent=1))
    print(f"curve: {png}")
    main_run = next((r for r in summary["runs"] if r["arm"] == "both" and r["judge"] == "scripted"), None)
    ok = main_run is not None and main_run["reached_target_s"] is not None
    print(json.dumps({"bench": "openclaw_demo", "opening": args.opening,
                      "runs": [{k: r[k] for k in ("label", "base", "final", "best", "reached_target_s",
                                                  "first_word_base", "first_word_final", "seconds", "releases")}
                               for r in summary["runs"]],
                      "goal_met": ok if main_run else None}))
    return 0 if (main_run is None or ok) else 1


if __name__ == "__main__":
    sys.exit(main())
