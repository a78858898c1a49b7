"""GEPA on SmolLM2 through reefd: reflective evolution of the harness's rules against a small labelled task.

SmolLM2 answers "What is the capital of X?" under the served harness (its rules go into the system prompt); the
regex scorer checks that the answer names the right city. The seed rules file says only "Answer the question.", under
which SmolLM2 often drifts into other languages. Each GEPA job answers a minibatch of training questions under a
parent candidate, asks the reflection model for a better rules text, keeps the child only if it strictly beats its
parent on that minibatch, scores it on the validation questions, and serves the best candidate only if it strictly
beats the serving harness there.

Two runs, each labelled in the output:
- the reflection model is a SCRIPTED STAND-IN (bench/gepa_demo.py:scripted_reflector), a fixed function that
  answers every reflection prompt with one rules text; it shows the loop can find and serve a better harness;
- the reflection model is SmolLM2 itself (reflector: null, the scenario's own engine), whatever that gives.

Before and after each run, the validation questions are also asked through reefd's OpenAI API, as a client
would, with the harness injected by reefd: the served harness's accuracy before and after.

Run: python bench/gepa_demo.py        (make demo runs it; about 5 minutes on 2 cores)
Writes bench/out/gepa.png and bench/out/gepa.json; the last line printed is a JSON summary.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import re
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from _harness import ROOT, Daemon, scratch_dir

from tests.conftest import make_scenarios

OUT = ROOT / "bench" / "out"
CAPITALS = [("France", "Paris"), ("Japan", "Tokyo"), ("Italy", "Rome"), ("Spain", "Madrid"), ("Germany", "Berlin"),
            ("Egypt", "Cairo"), ("Canada", "Ottawa"), ("Russia", "Moscow"), ("China", "Beijing"),
            ("Greece", "Athens"), ("Portugal", "Lisbon"), ("Austria", "Vienna"), ("Norway", "Oslo"),
            ("Poland", "Warsaw"), ("Ireland", "Dublin"), ("Kenya", "Nairobi")]
TRAIN, VAL = CAPITALS[:8], CAPITALS[8:]
SEED_RULES = "Answer the question."
SCRIPTED_RULES = ("Answer in English with one short sentence that names the city, for example: "
                  "The capital of France is Paris.")
SCENARIO = """defaults:
  - model: smollm2
  - recipe: gepa
  - trigger: manual
  - gate: always
  - release: follow
  - _self_
recipe:
  params:
    trainset: train.jsonl
    valset: val.jsonl
    scorer: regex
    minibatch: 3
    iterations: {iterations}
    max_tokens: 16
    reflector: {reflector}
    reflection_max_tokens: 160
harness:
  dir: harness
serve:
  default_max_tokens: 16
"""


def scripted_reflector(messages: list[dict[str, Any]]) -> str:
    """A SCRIPTED STAND-IN for the reflection model: the same rules text for every prompt."""
    return f"New instructions:\n```\n{SCRIPTED_RULES}\n```"


def task_line(country: str, city: str) -> str:
    return json.dumps({"prompt": f"What is the capital of {country}?", "answer": rf"\b{city}\b"}) + "\n"


class Run:
    def __init__(self, label: str, reflector: str, args: argparse.Namespace) -> None:
        from reefd.worker.prepare import prepare

        self.label, self.args = label, args
        tmp = scratch_dir()
        scen = make_scenarios(tmp / "scenarios", names=(), extra={"learn": SCENARIO.format(
            iterations=args.iterations, reflector=reflector)})
        (scen / "harness" / "rules").mkdir(parents=True)
        (scen / "harness" / "rules" / "answer.md").write_text(SEED_RULES + "\n")
        (scen / "train.jsonl").write_text("".join(task_line(*t) for t in TRAIN))
        (scen / "val.jsonl").write_text("".join(task_line(*t) for t in VAL))
        state = tmp / "state"
        home = Path.home() / ".local" / "state" / "reefd"
        (state / "models").mkdir(parents=True)
        (state / "models" / "smollm2").symlink_to(Path(prepare("smollm2", home / "models" / "smollm2")))
        self.state = state
        self.d = Daemon(scenarios=scen, state=state, log_path=tmp / "reefd.log",
                        env={"PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'bench'}"})
        self.d.start(wait_ready=False)
        self.d.wait_ready(600)

    def served_accuracy(self) -> tuple[float, str]:
        """The validation questions through reefd's OpenAI API (the harness injected by reefd), greedy."""
        import openai

        client = openai.OpenAI(base_url=self.d.url + "/v1", api_key=self.d.token, max_retries=2, timeout=600,
                               default_headers={"x-reef-scenario": "learn"})

        def one(pair: tuple[str, str]) -> bool:
            out = client.chat.completions.create(model="learn", temperature=0.0, max_tokens=16, messages=[
                {"role": "user", "content": f"What is the capital of {pair[0]}?"}])
            return re.search(rf"\b{pair[1]}\b", out.choices[0].message.content or "") is not None

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            hits = list(pool.map(one, VAL))
        return sum(hits) / len(hits), self.rules()

    def rules(self) -> str:
        req = urllib.request.Request(self.d.url + "/reef/harness",
                                     headers={**self.d.headers(), "x-reef-scenario": "learn"})
        with urllib.request.urlopen(req, timeout=30) as r:
            files = {f["path"]: f["content"] for f in json.loads(r.read())["files"]}
        return str(files["rules/answer.md"]).strip()

    def go(self) -> dict[str, Any]:
        started = time.monotonic()
        try:
            before, rules_before = self.served_accuracy()
            print(f"  [{self.label}] served before: validation accuracy {before:.3f} under {rules_before!r}",
                  flush=True)
            jobs = []
            for i in range(self.args.jobs):
                code, job, _ = self.d.post("/reef/scenarios/learn/train", {}, headers={"x-reef-scenario": "learn"})
                if code not in (200, 202):
                    raise RuntimeError(f"train: {code} {job}")
                while job["state"] in ("queued", "running"):
                    time.sleep(1)
                    job = json.loads(self.d.get(f"/reef/jobs/{job['id']}")[1])
                m = job.get("metrics") or {}
                jobs.append({"state": job["state"], "release": job.get("release"), "error": job.get("error"),
                             **{k: m.get(k) for k in ("serving_val", "best_val", "candidates", "calls")}})
                outcome = job.get("error") or job.get("release")
                print(f"  [{self.label}] job {i + 1}: {job['state']}; serving val {m.get('serving_val')}, best val "
                      f"{m.get('best_val')}, {m.get('candidates')} candidates; {outcome}", flush=True)
            archive = json.loads((self.state / "archives" / "learn.json").read_text())
            after, rules_after = self.served_accuracy()
            print(f"  [{self.label}] served after: validation accuracy {after:.3f} under {rules_after!r}", flush=True)
        finally:
            self.d.stop()
        seeded = archive["candidates"][0]
        best = max(archive["candidates"], key=lambda c: sum(c["val"]) / len(c["val"]))
        return {"label": self.label, "jobs": jobs, "val_before": sum(seeded["val"]) / len(seeded["val"]),
                "val_best": sum(best["val"]) / len(best["val"]), "served_before": before, "served_after": after,
                "rules_before": rules_before, "rules_after": rules_after,
                "accepted": sum(1 for e in archive["log"] if "accepted" in e),
                "rejected": [e.get("rejected") for e in archive["log"] if "rejected" in e],
                "reflections": [e.get("reflection") for e in archive["log"]],
                "seconds": round(time.monotonic() - started, 1)}


def plot(runs: list[dict[str, Any]], path: Path) -> None:
    """Per run: the served harness's validation accuracy before and after (through the API), and GEPA's own
    validation mean of the seed and of its best candidate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.2
    keys = [("served_before", "served, before"), ("served_after", "served, after"), ("val_before", "GEPA: seed"),
            ("val_best", "GEPA: best candidate")]
    for i, (key, label) in enumerate(keys):
        ax.bar([j + (i - 1.5) * width for j in range(len(runs))], [r[key] for r in runs], width, label=label)
    ax.set_xticks(range(len(runs)), [r["label"] for r in runs])
    ax.set_ylabel("validation accuracy")
    ax.set_ylim(0, 1.05)
    ax.set_title("GEPA on SmolLM2-135M: the harness's rules, before and after")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", type=int, default=3, help="GEPA jobs per run")
    p.add_argument("--iterations", type=int, default=3, help="GEPA iterations per job")
    args = p.parse_args()
    runs = []
    for label, reflector in (("scripted stand-in reflector", "gepa_demo:scripted_reflector"),
                             ("SmolLM2 reflector", "null")):
        print(f"run: GEPA with a {label.upper() if 'scripted' in label else label}, {args.jobs} jobs of "
              f"{args.iterations} iterations", flush=True)
        runs.append(Run(label, reflector, args).go())
    for r in runs:
        if r["reflections"]:
            print(f"\n{r['label']}: the first reflection's answer began: {r['reflections'][0][:300]!r}")
    print("\nvalidation accuracy of the served harness (asked through reefd's API):")
    for r in runs:
        print(f"  {r['label']:30} before {r['served_before']:.3f} after {r['served_after']:.3f}  (GEPA's own "
              f"validation: seed {r['val_before']:.3f}, best candidate {r['val_best']:.3f}; {r['accepted']} accepted, "
              f"{len(r['rejected'])} rejected; {r['seconds'] / 60:.1f} min)")
    summary = {"bench": "gepa_demo", "model": "smollm2", "runs": [
        {k: r[k] for k in ("label", "served_before", "served_after", "val_before", "val_best", "accepted",
                           "rules_after", "seconds")} for r in runs]}
    OUT.mkdir(parents=True, exist_ok=True)
    plot(runs, OUT / "gepa.png")
    summary["png"] = str(OUT / "gepa.png")
    (OUT / "gepa.json").write_text(json.dumps({**summary, "details": runs}, indent=1))
    print(json.dumps(summary))
    scripted = runs[0]  # the goal is the loop's: with a reflector that writes a better text, it is served
    if not scripted["served_after"] > scripted["served_before"]:
        print("gepa_demo: goal missed (the scripted run's served harness did not beat the seed)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
