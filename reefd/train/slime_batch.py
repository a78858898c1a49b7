"""reef_slime.py: the two steps around slime's train.py in a `backend: slime` job, run on the cluster.

Shipped in the job's working_dir and run by the cluster's Python, the one that has slime. It needs nothing of
reefd: the standard library, and torch for `prepare`. Its JSON lines are the job's events, which reefd relays
as it does the trainer's.

    python reef_slime.py prepare batch.jsonl rollout.pt --num-rollout N
        batch.jsonl (slime Sample dicts, one per line) -> torch.save({"rollout_id": 0, "samples": [...]}), the file
        slime's --load-debug-rollout-data reads (slime/observability/rollout_data_utils.py)
    python reef_slime.py finish SAVE_HF_TEMPLATE --num-rollout N --out DIR
        slime's last --save-hf checkpoint (the template formatted with rollout_id=N-1) renamed to DIR
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

STATUSES = ("pending", "completed", "truncated", "aborted", "failed")  # slime's Sample.Status values


def emit(event: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


def prepare(batch: Path, out: Path, num_rollout: int) -> int:
    samples = [json.loads(line) for line in batch.read_text().splitlines() if line.strip()]
    for i, s in enumerate(samples):
        problem = None
        if s.get("status") not in STATUSES:
            problem = f"status {s.get('status')!r}"
        elif not 0 < int(s.get("response_length", 0)) <= len(s.get("tokens") or ()):
            problem = "response_length"
        elif s.get("loss_mask") is not None and len(s["loss_mask"]) != s["response_length"]:
            problem = "loss_mask length"
        if problem is not None:
            emit({"event": "error", "reason": f"batch.jsonl line {i + 1}: bad {problem}"})
            return 2
    import torch

    out.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"rollout_id": 0, "samples": samples}, out)
    emit({"event": "start", "samples": len(samples), "steps": num_rollout, "trainer": "slime"})
    return 0


def finish(template: str, num_rollout: int, out: Path) -> int:
    last = Path(template.format(rollout_id=num_rollout - 1))
    if not (last / "config.json").is_file():
        emit({"event": "error", "reason": f"slime wrote no HF checkpoint at {last}"})
        return 1
    out.parent.mkdir(parents=True, exist_ok=True)
    os.rename(last, out)  # the job's folder: on the filesystem the cluster shares with reefd
    emit({"event": "progress", "step": num_rollout, "steps": num_rollout})
    emit({"event": "done", "adapter": str(out), "metrics": {"trainer": "slime", "steps": num_rollout,
                                                            "checkpoint": last.name}})
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="reef_slime.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="step", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("batch", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--num-rollout", type=int, required=True)
    f = sub.add_parser("finish")
    f.add_argument("template")
    f.add_argument("--num-rollout", type=int, required=True)
    f.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.step == "prepare":
        return prepare(args.batch, args.out, args.num_rollout)
    return finish(args.template, args.num_rollout, args.out)


if __name__ == "__main__":
    sys.exit(main())
