"""Trainer throughput: tokens/s of a real `python -m reefd.train` job against a bare PEFT loop.

The batch: 8 rollouts of 32 prompt + 32 completion tokens (seeded random ids, the model's own
logprobs as the rollout logprobs), one micro-batch of 8 per step. The trainer runs an SAO job on it
(`epochs` = warm-up + measured steps) and reports tokens/s per step in its progress lines.
Baseline, measured in the same run on the same model, LoRA (r=8 on q/k/v/o), micro-batch and AdamW:
a bare loop of `PeftModel(...).logits` -> log_softmax -> -A * log p over the completion tokens ->
backward -> clip -> step, with no spec, no JSON lines and no critic, timed the same way (the whole
step, prompt + completion tokens over its wall time). Rounds alternate trainer and bare loop; the
medians of the measured steps are compared. Goal: trainer >= 0.9x the bare loop.
Run: python bench/trainer.py --model tiny|smollm2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
GOAL = 0.9
LORA = {"r": 8, "alpha": 16, "dropout": 0.0, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}
LR = 5e-4


def model_folder(model: str) -> Path:
    """tiny is built under .bench-tmp; smollm2 is prepared where `make run` keeps it (idempotent)."""
    if model == "tiny":
        folder = ROOT / ".bench-tmp" / "models" / "tiny"
    elif model == "smollm2":
        state = Path(os.environ.get("REEF_STATE") or Path.home() / ".local" / "state" / "reefd")
        folder = state / "models" / "smollm2"
    else:
        return Path(model)
    subprocess.run([sys.executable, "-m", "reefd.worker.prepare", model, "--out", str(folder)],
                   check=True, stdout=subprocess.DEVNULL, cwd=ROOT)
    return folder


def make_samples(folder: Path, n: int, prompt_len: int, completion_len: int) -> list[dict[str, Any]]:
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, dtype=torch.float32).eval()
    vocab = int(model.get_input_embeddings().weight.shape[0])
    gen = torch.Generator().manual_seed(0)
    samples = []
    for i in range(n):
        ids = torch.randint(3, vocab, (prompt_len + completion_len,), generator=gen).tolist()
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids])).logits[0, prompt_len - 1 : -1]
        logp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[prompt_len:])[:, None])[:, 0]
        samples.append({"receipt": f"b{i}", "prompt_ids": ids[:prompt_len], "completion_ids": ids[prompt_len:],
                        "logprobs": logp.tolist(), "reward": float(i % 2), "group": "bench"})
    return samples


def trainer_round(folder: Path, samples: list[dict[str, Any]], warmup: int, steps: int, tmp: Path) -> list[float]:
    """Per-step tokens/s of the real job, warm-up steps dropped."""
    out = tmp / f"out-{time.monotonic_ns()}"
    spec = {"job": "bench", "objective": "recipes.sao.objective:SAOObjective", "base_model": str(folder),
            "init_adapter": None, "output_dir": str(out), "samples": samples, "lora": LORA, "seed": 0,
            "optim": {"lr": LR, "epochs": warmup + steps, "micro_batch": len(samples), "max_grad_norm": 1.0}}
    path = tmp / "spec.json"
    path.write_text(json.dumps(spec))
    proc = subprocess.run([sys.executable, "-m", "reefd.train", "--spec", str(path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    events = [json.loads(line) for line in proc.stdout.splitlines()]
    if proc.returncode != 0:
        raise SystemExit(f"trainer failed ({proc.returncode}): {events[-1:]}\n{proc.stderr[-2000:]}")
    return [e["tokens_per_s"] for e in events if e["event"] == "progress"][warmup:]


class BareLoop:
    """The baseline: the same model, LoRA, micro-batch and AdamW, nothing else."""

    def __init__(self, folder: Path, samples: list[dict[str, Any]]) -> None:
        import torch
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        torch.manual_seed(0)
        base = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, dtype=torch.float32,
                                                    attn_implementation="sdpa")
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", ".*is_gradient_checkpointing.*", FutureWarning)
            config = LoraConfig(r=LORA["r"], lora_alpha=LORA["alpha"], lora_dropout=LORA["dropout"],
                                target_modules=LORA["target_modules"], task_type="CAUSAL_LM")
            self.model: Any = get_peft_model(base, config).train()
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=LR, weight_decay=0.0)
        self.samples = samples

    def step(self) -> float:
        import torch

        t0 = time.perf_counter()
        rows = [s["prompt_ids"] + s["completion_ids"] for s in self.samples]
        width = max(len(r) for r in rows)
        ids = torch.zeros((len(rows), width), dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        completion = torch.zeros((len(rows), width - 1))
        for i, (s, row) in enumerate(zip(self.samples, rows, strict=True)):
            ids[i, : len(row)], mask[i, : len(row)] = torch.tensor(row), 1
            completion[i, len(s["prompt_ids"]) - 1 : len(row) - 1] = 1
        adv = torch.tensor([s["reward"] - 0.5 for s in self.samples])[:, None]
        logits = self.model(input_ids=ids, attention_mask=mask, use_cache=False).logits[:, :-1]
        logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]
        loss = -(adv * logp * completion).sum() / completion.sum()
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.opt.step()
        return sum(len(r) for r in rows) / (time.perf_counter() - t0)

    def round(self, warmup: int, steps: int) -> list[float]:
        return [self.step() for _ in range(warmup + steps)][warmup:]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default="tiny", help="tiny, smollm2 or a model folder")
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--prompt", type=int, default=32, help="prompt tokens per sample")
    p.add_argument("--completion", type=int, default=32, help="completion tokens per sample")
    p.add_argument("--steps", type=int, default=0, help="measured steps per round (default: 20 tiny, 4 otherwise)")
    p.add_argument("--rounds", type=int, default=2, help="alternating trainer/bare rounds; medians are reported")
    args = p.parse_args(argv)

    folder = model_folder(args.model)
    steps = args.steps or (20 if args.model == "tiny" else 4)
    warmup = 2
    samples = make_samples(folder, args.samples, args.prompt, args.completion)
    bare = BareLoop(folder, samples)
    trainer_tok_s: list[float] = []
    bare_tok_s: list[float] = []
    with tempfile.TemporaryDirectory(prefix="reef-bench-trainer-") as tmp:
        for _ in range(args.rounds):
            trainer_tok_s += trainer_round(folder, samples, warmup, steps, Path(tmp))
            bare_tok_s += bare.round(warmup, steps)
    trainer, baseline = statistics.median(trainer_tok_s), statistics.median(bare_tok_s)
    ratio = trainer / baseline
    name = args.model if args.model in ("tiny", "smollm2") else str(folder)
    tokens = args.samples * (args.prompt + args.completion)
    verdict = "meets" if ratio >= GOAL else "below"
    print(f"trainer ({name}, {args.samples} x {args.prompt}+{args.completion} tokens per step): "
          f"bare PEFT loop {baseline:.1f} tok/s, reefd.train {trainer:.1f} tok/s, "
          f"ratio {ratio:.2f}x ({verdict} the {GOAL}x goal)")
    print(json.dumps({
        "bench": "trainer", "model": name, "samples": args.samples, "tokens_per_step": tokens,
        "steps": len(trainer_tok_s), "rounds": args.rounds, "trainer_tok_s": round(trainer, 2),
        "bare_tok_s": round(baseline, 2), "ratio": round(ratio, 3), "goal": GOAL,
    }))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
