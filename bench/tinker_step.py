"""A Tinker training step through reefd against a bare PEFT loop on the same batch (issue 46, point 5).

A real reefd serves one scenario on the tiny model or SmolLM2; the unmodified `tinker` SDK opens a LoRA training
client on it (rank 8 on q/k/v/o/gate/up/down, what create_model trains with train_attn and train_mlp; seed 0)
and runs the supervised loop: `forward_backward(batch, "cross_entropy")`, `.result()`, then `optim_step(AdamParams())`,
`.result()`, each call timed from submit to result. The baseline runs in this process: the same model folder,
float32 on CPU, torch seeded as reefd/train/session.py seeds it before loading (so both LoRAs start identical),
the same LoRA, one forward per datum, the sum of -logp * weights, backward, AdamW with the SDK's AdamParams
defaults. The batch: 8 datums of 64 positions (prompt + completion from fixed text, weights 0 on the prompt).
The two loops alternate step by step (warm-up steps first, not timed), so a busy machine slows both alike.
Reported: medians per step, reefd's total over the bare step, and each loop's nll (mean over weighted tokens, from
each step's forward pass, before its update) with the largest gap between the two curves.
Goal: reefd's step at most 1.2x the bare loop's.
Run: python bench/tinker_step.py --model smollm2|tiny [--steps 10] [--warmup 2]   (a table, then one JSON line)
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
import warnings
from pathlib import Path
from typing import Any

from _harness import median, scratch_dir, start_reefd

from reefd.tinker.service import ATTENTION, MLP
from reefd.train import quiet_peft

GOAL = 1.2
BATCH, POSITIONS, RANK, SEED = 8, 64, 8, 0
EXAMPLES = [
    ("Q: What colour is the sky on a clear day?\nA:",
     " Blue, because the air scatters the short blue wavelengths of sunlight far more than the red ones."),
    ("Q: How many legs does a spider have?\nA:",
     " Eight legs, attached to the front part of a body made of two segments, with fangs and silk glands."),
    ("Q: What do bees make?\nA:",
     " Honey, from the nectar of flowers, which they store in wax cells to feed the colony through winter."),
    ("Q: Which planet is nearest the sun?\nA:",
     " Mercury, at about fifty-eight million kilometres, a small rocky world with almost no atmosphere."),
    ("Q: Why does ice float on water?\nA:",
     " Because water expands as it freezes: its crystals hold the molecules apart, so ice is less dense."),
    ("Q: What makes a rainbow?\nA:",
     " Sunlight bent and reflected inside raindrops, each colour leaving at a slightly different angle."),
    ("Q: How do plants feed themselves?\nA:",
     " By photosynthesis: their leaves turn light, water and carbon dioxide into sugar and oxygen."),
    ("Q: What causes the tides?\nA:",
     " Mostly the moon's gravity, pulling the oceans into two bulges that the earth turns beneath each day."),
]


def make_batch(tokenizer: Any) -> list[tuple[list[int], list[int], list[float]]]:
    """(input tokens, target tokens, weights) per datum, POSITIONS each: position i predicts token i+1."""
    batch = []
    for prompt, completion in EXAMPLES[:BATCH]:
        prompt_ids = tokenizer.encode(prompt, add_special_tokens=True)
        completion_ids = tokenizer.encode(completion, add_special_tokens=False)
        while len(prompt_ids) + len(completion_ids) <= POSITIONS:
            completion_ids += tokenizer.encode(completion, add_special_tokens=False)
        tokens = (prompt_ids + completion_ids)[:POSITIONS + 1]
        weights = ([0.0] * len(prompt_ids) + [1.0] * len(completion_ids))[:POSITIONS + 1]
        batch.append((tokens[:-1], tokens[1:], weights[1:]))
    return batch


def nll(logprobs: list[list[float]], batch: list[tuple[list[int], list[int], list[float]]]) -> float:
    total = sum(-lp * w for lps, (_, _, ws) in zip(logprobs, batch, strict=True) for lp, w in zip(lps, ws, strict=True))
    return total / sum(sum(ws) for _, _, ws in batch)


class BareLoop:
    """The baseline: reefd/train/session.py's model, LoRA and AdamW, called directly, nothing else."""

    def __init__(self, folder: Path, adam: Any) -> None:
        import torch
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        torch.manual_seed(SEED)
        base: Any = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, dtype="auto",
                                                         attn_implementation="sdpa")
        config = LoraConfig(r=RANK, lora_alpha=2 * RANK, lora_dropout=0.0, target_modules=list(ATTENTION + MLP),
                            task_type="CAUSAL_LM")
        with quiet_peft():
            self.model: Any = get_peft_model(base.float(), config).train()
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=adam.learning_rate, betas=(adam.beta1, adam.beta2),
                                     eps=adam.eps, weight_decay=adam.weight_decay)

    def step(self, batch: list[tuple[list[int], list[int], list[float]]]) -> tuple[float, float]:
        """(seconds, nll) of one step: a forward and backward per datum, then AdamW."""
        import torch

        began = time.perf_counter()
        logprobs = []
        for tokens, targets, weights in batch:
            logits = self.model(input_ids=torch.tensor([tokens]), use_cache=False).logits[0].float()
            logp = torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(targets)[:, None])[:, 0]
            (-logp * torch.tensor(weights)).sum().backward()
            logprobs.append(logp.detach().tolist())
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return time.perf_counter() - began, nll(logprobs, batch)


def reefd_step(training: Any, data: list[Any], adam: Any,
               batch: list[tuple[list[int], list[int], list[float]]]) -> tuple[float, float, float]:
    """(forward_backward seconds, optim_step seconds, nll) of one step through the SDK."""
    began = time.perf_counter()
    result = training.forward_backward(data, "cross_entropy").result()
    middle = time.perf_counter()
    training.optim_step(adam).result()
    ended = time.perf_counter()
    logprobs = [out["logprobs"].tolist() for out in result.loss_fn_outputs]
    return middle - began, ended - middle, nll(logprobs, batch)


def run(model: str, steps: int, warmup: int) -> dict[str, Any]:
    import tinker
    from tinker import types
    from transformers import AutoTokenizer

    tmp = scratch_dir()
    scenario = f"defaults:\n  - model: {model}\n  - _self_\n"
    d = start_reefd(tmp, {"bench": scenario}, seed_model=model)
    try:
        folder = d.state / "models" / model
        batch = make_batch(AutoTokenizer.from_pretrained(folder, local_files_only=True))
        data = [types.Datum(model_input=types.ModelInput.from_ints(tokens),
                            loss_fn_inputs={"target_tokens": targets, "weights": weights})
                for tokens, targets, weights in batch]
        adam = types.AdamParams()  # the SDK's defaults, for both loops
        bare = BareLoop(folder, adam)
        os.environ["TINKER_TELEMETRY"] = "0"
        service = tinker.ServiceClient(base_url=d.url, api_key="tml-" + d.token)
        training = service.create_lora_training_client(base_model="bench", rank=RANK, seed=SEED,
                                                       train_unembed=False).result()
        rows = []
        for _ in range(warmup + steps):
            bare_s, bare_nll = bare.step(batch)
            fwd_s, opt_s, reefd_nll = reefd_step(training, data, adam, batch)
            rows.append({"bare_s": bare_s, "fwd_bwd_s": fwd_s, "optim_s": opt_s, "total_s": fwd_s + opt_s,
                         "bare_nll": bare_nll, "reefd_nll": reefd_nll})
        service.close("success").result()
    finally:
        d.stop()
    timed = rows[warmup:]
    figures = {key: median([r[key] for r in timed]) for key in ("bare_s", "fwd_bwd_s", "optim_s", "total_s")}
    return {**figures, "ratio": figures["total_s"] / figures["bare_s"], "lr": adam.learning_rate,
            "tokens_per_step": sum(len(t) for t, _, _ in batch),
            "nll_bare": [r["bare_nll"] for r in rows], "nll_reefd": [r["reefd_nll"] for r in rows],
            "nll_max_abs_diff": max(abs(r["bare_nll"] - r["reefd_nll"]) for r in rows)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=["tiny", "smollm2"], default="smollm2")
    p.add_argument("--steps", type=int, default=10, help="timed steps, after the warm-up ones")
    p.add_argument("--warmup", type=int, default=2)
    args = p.parse_args()
    warnings.filterwarnings("ignore", category=ResourceWarning)  # the SDK's own pool, dropped on close
    # a step longer than reefd's 20 s long poll: the SDK asks again at once, and warns each time it does
    logging.getLogger("tinker.lib.api_future_impl").setLevel(logging.ERROR)
    got = run(args.model, args.steps, args.warmup)
    met = got["ratio"] <= GOAL
    print(f"tinker_step.py  model={args.model}  {BATCH} datums x {POSITIONS} positions  LoRA r={RANK} "
          f"(attn+mlp)  AdamW lr={got['lr']:g}  {args.steps} steps after {args.warmup} warm-up (medians)")
    print(f"  bare PEFT step        {got['bare_s'] * 1000:9.1f} ms")
    print(f"  reefd forward_backward {got['fwd_bwd_s'] * 1000:8.1f} ms")
    print(f"  reefd optim_step      {got['optim_s'] * 1000:9.1f} ms")
    print(f"  reefd step (total)    {got['total_s'] * 1000:9.1f} ms  {got['ratio']:5.2f}x the bare step "
          f"(goal <= {GOAL}x: {'met' if met else 'MISSED'})")
    print("  step  nll bare   nll reefd  (each step's forward, before its update; * warm-up)")
    for i, (a, b) in enumerate(zip(got["nll_bare"], got["nll_reefd"], strict=True)):
        print(f"  {i:>3}{'*' if i < args.warmup else ' '} {a:9.5f}  {b:9.5f}")
    print(f"  nll curves: max abs difference {got['nll_max_abs_diff']:.2e}")
    print(json.dumps({"bench": "tinker_step", "model": args.model, "batch": BATCH, "positions": POSITIONS,
                      "rank": RANK, "steps": args.steps, "warmup": args.warmup, **got, "goal": GOAL, "met": met}))


if __name__ == "__main__":
    main()
