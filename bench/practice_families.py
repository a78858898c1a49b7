"""Practice beyond the demo's task: the README's practice scenario, copied as it stands, on arithmetic families from
a public generator, each with its own prompts and its own scorer, measured on held-out tasks before and after.

Families (bench/families/<family>.jsonl, written once from reasoning-gym 0.1.25 by --write-tasks, which needs
`pip install reasoning-gym`; the bench itself reads the files and needs no reasoning-gym):
- chain_sum: "State the final answer to the following arithmetic problem: 8 + 1 =" (2 terms, 1 digit, + and -);
- products: "Solve the following multiplication: 2 * 7. Give only the result as your final answer." (1 digit);
- gcd: "Find the Greatest Common Divisor (GCD) of these numbers: 55, 100. Give only the GCD as your final answer."
  (2 numbers, 1 to 100).
Each file holds 32 held-out tasks (never practised) and the practice set, deduplicated by prompt. The scorer is the
generator's own (bench/families/rg_score.py, a copy checked against reasoning-gym when the files are written): 1 for
the bare answer, len(expected) / len(answer) for a wordy answer that holds it ("The answer is 7." scores 1/16), so
the base SmolLM2, which answers in sentences, earns a little credit on each.
The scenario is the README's `# scenarios/add.yaml` block, read from README.md as a user would copy it, with its
`tasks` and `verifier` replaced by the family's (`--set key=value`, dotted, changes more, for tuning runs). reefd
runs it for --minutes from the start of its first practice round; nobody sends a request or a report.
Held-out score: each evaluated release's adapter (evenly spread over the run, and the last) on the 32 held-out
tasks, 2 answers each at temperature 0.5 and up to 32 tokens (and, for the base model and the last release, once
greedily), with HF generate in this process
(the score of 64 answers is known to about +-0.06).
Goal: the last release's held-out score is at least 0.2 above the base model's.
Run: python bench/practice_families.py --family products [--minutes 15] [--set practice.rounds_per_hour=6]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import yaml
from _harness import ROOT, Daemon, scratch_dir, start_reefd
from learning import model_folder
from learning_bare import Bare
from practice_demo import gauge, get, watch_releases

from reefd.commit.chain import ReleaseChain

HERE = ROOT / "bench" / "families"
sys.path.insert(0, str(HERE))
from rg_score import score  # noqa: E402

NAME, EVAL_TEMPERATURE, EVAL_TOKENS, EVAL_SAMPLES, HELDOUT = "add", 0.5, 32, 2, 32
GENERATOR = {  # family: reasoning-gym dataset, its config, the scorer it uses
    "chain_sum": ("chain_sum", {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}, "decimal"),
    "products": ("products", {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}, "decimal"),
    "gcd": ("gcd", {"min_numbers": 2, "max_numbers": 2, "min_value": 1, "max_value": 100}, "exact"),
}


def write_tasks(seed: int = 44, size: int = 600, keep: int = 300) -> None:
    """bench/families/<family>.jsonl from reasoning-gym, each generated answer scored by the copy and the generator
    alike (the bench's copy must agree)."""
    import random

    import reasoning_gym

    for family, (dataset, kw, scorer) in GENERATOR.items():
        ds = reasoning_gym.create_dataset(dataset, size=size, seed=seed, **kw)
        seen: set[str] = set()
        rows = []
        for entry in (ds[i] for i in range(size)):
            if entry["question"] in seen:
                continue
            seen.add(entry["question"])
            rows.append({"prompt": entry["question"], "answer": entry["answer"], "scorer": scorer})
            for answer in (entry["answer"], f"The answer is {entry['answer']}.", entry["answer"] + "0", "x"):
                assert abs(score(answer, rows[-1]) - ds.score_answer(answer, entry)) < 1e-12, (family, answer)
        random.Random(seed).shuffle(rows)
        with (HERE / f"{family}.jsonl").open("w") as f:
            for i, row in enumerate(rows[:keep]):
                f.write(json.dumps({**row, "split": "heldout" if i < HELDOUT else "practice"}) + "\n")
        print(f"{family}: {min(len(rows), keep)} tasks, {HELDOUT} held out")


def tasks(family: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    rows = [json.loads(line) for line in (HERE / f"{family}.jsonl").read_text().splitlines()]
    return [r for r in rows if r["split"] == "practice"], [r for r in rows if r["split"] == "heldout"]


def readme_scenario() -> dict[str, Any]:
    """The README's practice scenario, as a user copies it."""
    text = (ROOT / "README.md").read_text()
    found = re.search(r"```yaml\n(# scenarios/add\.yaml\n.*?)```", text, re.S)
    if found is None:
        raise SystemExit("README.md: no ```yaml block starting '# scenarios/add.yaml'")
    return dict(yaml.safe_load(found.group(1)))


def scenario(tmp: Path, practice: list[dict[str, Any]], sets: list[str]) -> dict[str, Any]:
    """The README's scenario on this family's practice set and scorer, with --set's changes; writes the set and the
    verifier module into the scenarios folder."""
    folder = tmp / "scenarios"
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(HERE / "rg_score.py", folder / "rg_score.py")
    with (folder / "family-practice.jsonl").open("w") as f:
        for row in practice:
            f.write(json.dumps(row) + "\n")
    cfg = readme_scenario()
    cfg["practice"].update(tasks="family-practice.jsonl", verifier={"function": "rg_score:score"})
    for item in sets:
        key, _, value = item.partition("=")
        *path, last = key.split(".")
        node = cfg
        for part in path:
            node = node.setdefault(part, {})
        node[last] = yaml.safe_load(value)
    return cfg


def practise(cfg: dict[str, Any], tmp: Path, budget_s: float) -> tuple[list[tuple[float, str]], dict[str, Any]]:
    """reefd serving the scenario for `budget_s` from the start of its first round: (clock, release) of each release,
    and practice's status at the end."""
    d: Daemon = start_reefd(tmp, {NAME: yaml.safe_dump(cfg, sort_keys=False)}, seed_model="smollm2")
    print(f"reefd: ready at {d.url} (log {d.log_path})", flush=True)
    try:
        while not any((get(d, "/reef/status")["scenarios"][0].get("practice") or {}).get(k)
                      for k in ("generating", "answers")):
            time.sleep(0.05)
        releases = watch_releases(d, NAME, budget_s, poll_s=0.5)
        status = next(s for s in get(d, "/reef/status")["scenarios"] if s["name"] == NAME)["practice"]
    finally:
        d.stop()
    return sorted(releases), status


class Evaluator:
    """Held-out score of the base model or of a release's adapter: sampled (EVAL_SAMPLES answers a task) and greedy."""

    def __init__(self, heldout: list[dict[str, Any]]) -> None:
        self.bare = Bare(model_folder(), lr=5e-4, max_tokens=EVAL_TOKENS, temperature=EVAL_TEMPERATURE, seed=0)
        self.heldout = heldout

    def _mean(self, rows: list[dict[str, Any]]) -> tuple[float, list[str]]:
        texts = self.bare.sample([r["prompt"] for r in rows])[1]
        return sum(score(t, r) for t, r in zip(texts, rows, strict=True)) / len(rows), texts

    def __call__(self, folder: Path | None, greedy: bool = True) -> dict[str, Any]:
        from peft import get_peft_model_state_dict, set_peft_model_state_dict
        from safetensors.torch import load_file

        model, torch = self.bare.model, self.bare.torch
        saved = {k: v.detach().clone() for k, v in get_peft_model_state_dict(model).items()}
        try:
            state = load_file(str(folder / "adapter_model.safetensors")) if folder is not None else {
                k: torch.zeros_like(v) if "lora_B" in k else v for k, v in saved.items()}
            if set_peft_model_state_dict(model, state).unexpected_keys:
                raise RuntimeError(f"{folder}: not this LoRA's shape")
            sampled, texts = self._mean([r for r in self.heldout for _ in range(EVAL_SAMPLES)])
            out = {"sampled": round(sampled, 3), "greedy": None, "examples": texts[:4:2]}
            if greedy:
                self.bare.temperature = 1e-5  # effectively greedy; generate's do_sample stays on
                try:
                    out["greedy"] = round(self._mean(self.heldout)[0], 3)
                finally:
                    self.bare.temperature = EVAL_TEMPERATURE
            return out
        finally:
            set_peft_model_state_dict(model, saved)


def spread(releases: list[tuple[float, str]], k: int) -> list[tuple[float, str]]:
    """At most k releases, evenly over the run, always the last."""
    if len(releases) <= k:
        return releases
    picked = {round(i * (len(releases) - 1) / (k - 1)) for i in range(k)}
    return [r for i, r in enumerate(releases) if i in picked]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", choices=sorted(GENERATOR), default="products")
    ap.add_argument("--minutes", type=float, default=15.0)
    ap.add_argument("--evals", type=int, default=4, help="releases evaluated, spread over the run")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="change the README's scenario")
    ap.add_argument("--write-tasks", action="store_true", help="regenerate bench/families/ (needs reasoning-gym)")
    args = ap.parse_args()
    if args.write_tasks:
        write_tasks()
        return
    practice, heldout = tasks(args.family)
    tmp = scratch_dir()
    cfg = scenario(tmp, practice, args.set)
    print(f"{args.family}: {len(practice)} practice tasks, {len(heldout)} held out; scenario "
          f"{json.dumps(cfg)}", flush=True)
    ev = Evaluator(heldout)
    speed = {"before": gauge(ev.bare)}
    base = ev(None)
    print(f"base: held-out {base}", flush=True)
    try:
        load = os.getloadavg()[0]
        releases, status = practise(cfg, tmp, args.minutes * 60)
        load, speed["after"] = (load + os.getloadavg()[0]) / 2, gauge(ev.bare)
        chain, curve = ReleaseChain(tmp / "state" / "releases.git"), [(0.0, "base", base)]
        picked = spread(releases, args.evals)
        for clock, rid in picked:
            dest = tmp / "eval" / rid
            chain.materialize(rid, dest, folder="adapter")
            curve.append((clock, rid, ev(dest, greedy=rid == picked[-1][1])))
            print(f"{rid} at {clock:.0f} s: held-out {curve[-1][2]}", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    last = curve[-1][2]
    rise = {k: None if last[k] is None else round(last[k] - base[k], 3) for k in ("sampled", "greedy")}
    print(f"{args.family}: held-out {base['sampled']} -> {last['sampled']} sampled, {base['greedy']} -> "
          f"{last['greedy']} greedy, with {len(releases)} releases in {args.minutes:g} min (goal: +0.2 "
          f"sampled: {'met' if (rise['sampled'] or 0) >= 0.2 else 'missed'}); practice {status}")
    print(f"machine: load average {load:.1f} (start and end of practice, {os.cpu_count()} cores); s per forward+"
          f"backward of a 16 x 60 batch: " + ", ".join(f"{k} {v:.2f}" for k, v in speed.items()))
    print(json.dumps({"bench": "practice_families", "family": args.family, "minutes": args.minutes,
                      "set": args.set, "releases": len(releases), "base": base, "last": last, "rise": rise,
                      "curve": [(round(t, 1), rid, {k: s[k] for k in ("sampled", "greedy")}) for t, rid, s in curve],
                      "practice": status, "load": round(load, 2),
                      "speed_s": {k: round(v, 3) for k, v in speed.items()}, "goal": {"rise": 0.2}}))


if __name__ == "__main__":
    main()
