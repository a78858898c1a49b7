"""The two Tinker loops of the conformance tests (tests/tinker/sl_loop.py, rl_loop.py), unmodified, against a real
reefd on SmolLM2 (in `make demo`): the supervised loop must learn its four answers (nll down by at least
--min-drop), and its sampler checkpoint must go through the scenario's gate (always) and serve; the RL loop must
run, every sample a record of the scenario. Exits 1 on any miss.

Run: python bench/tinker_demo.py [--model smollm2|tiny] [--sl-steps 6] [--rl-steps 2]   (lines, then one JSON line)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from _harness import scratch_dir, start_reefd

ROOT = Path(__file__).resolve().parents[1]
SCENARIO = "defaults:\n  - model: {model}\n  - _self_\n"


def loop(d: Any, script: str, **env: str) -> list[dict[str, Any]]:
    out = subprocess.run([sys.executable, str(ROOT / "tests" / "tinker" / script)], capture_output=True, text=True,
                         env={**os.environ, "TINKER_BASE_URL": d.url, "TINKER_API_KEY": "tml-" + d.token,
                              "TINKER_TELEMETRY": "0", "HF_HUB_OFFLINE": "1", "BASE_MODEL": "demo", **env})
    if out.returncode != 0:
        raise SystemExit(f"{script} failed:\n{out.stderr[-3000:]}")
    return [json.loads(line) for line in out.stdout.splitlines()]


def published(d: Any, timeout_s: float = 900) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = json.loads(d.get("/reef/jobs?scenario=demo")[1])["data"]
        if found and found[0]["state"] not in ("queued", "running"):
            return dict(found[0])
        time.sleep(1)
    raise SystemExit("the offered checkpoint's job never ended")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2")
    p.add_argument("--sl-steps", type=int, default=6)
    p.add_argument("--rl-steps", type=int, default=2)
    p.add_argument("--min-drop", type=float, default=0.5, help="nats of nll the supervised loop must shed")
    args = p.parse_args()
    tmp = scratch_dir()
    d = start_reefd(tmp, {"demo": SCENARIO.format(model=args.model)}, seed_model=args.model)
    try:
        started = time.monotonic()
        sl = loop(d, "sl_loop.py", STEPS=str(args.sl_steps), LR="1e-3" if args.model == "smollm2" else "1e-2")
        sl_s = time.monotonic() - started
        job = published(d)
        started = time.monotonic()
        rl = loop(d, "rl_loop.py", STEPS=str(args.rl_steps))
        rl_s = time.monotonic() - started
        records = [json.loads(d.get(f"/reef/records/{r}")[1]) for r in rl[-1]["sequence_ids"]]
    finally:
        d.stop()
    steps = sl[:-1]
    drop = steps[0]["nll"] - steps[-1]["nll"]
    checks = {"sl_learns": drop >= args.min_drop, "checkpoint_served": job["state"] == "published",
              "rl_samples_are_records": all(r.get("turn_kind") == "tinker" for r in records)}
    print(f"tinker_demo.py  model={args.model}")
    print(f"  supervised loop: {len(steps)} steps in {sl_s:.0f} s, nll {steps[0]['nll']:.3f} -> "
          f"{steps[-1]['nll']:.3f} (drop {drop:.3f}, goal >= {args.min_drop})")
    print(f"  its checkpoint {sl[-1]['sampler_path']}: job {job['id']} {job['state']} ({job['release']})")
    print(f"  RL loop: {len(rl)} steps in {rl_s:.0f} s, rewards {[round(s['reward'], 3) for s in rl]}, "
          f"{len(records)} samples of the last step, each a record")
    print(json.dumps({"bench": "tinker_demo", "model": args.model, "sl_nll": [s["nll"] for s in steps],
                      "sl_s": sl_s, "rl_rewards": [s["reward"] for s in rl], "rl_s": rl_s, "job": job["state"],
                      **checks}))
    if not all(checks.values()):
        raise SystemExit(f"missed: {[k for k, ok in checks.items() if not ok]}")


if __name__ == "__main__":
    main()
