"""What running a shared opening once saves, in the engine worker's prefill and in a trainer step, against the same
work done row by row, in the same run on the same model.

The batch is a practice round of bench/practice_demo.py: "What is A + B? Answer with the number only." in the
model's chat template (SmolLM2: 44 tokens, 27 of them the same in every prompt).
- Prefill: 32 sums x 2 answers (64 prompts, each asked twice), one prefill call of the worker's model
  (reefd/worker/openings.py), against the plain left-padded prefill of the same 64 prompts.
- Train: one forward and backward of the trainer's policy (reefd/train/prefix.py) on 16 of those prompts with
  answers of 2-9 tokens, against the plain forward of the same micro-batch. Also checks that both give the same
  log-probs (to 1e-4).
- Drop: what dropping one finished row of 64 costs (the copy the batcher's lazy drop avoids), beside a decode step.
Each figure is the median of --repeats. Prints the ratios and one JSON line.
Run: python bench/shared_openings.py [--model smollm2|tiny] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from learning import model_folder

from reefd.train import prefix
from reefd.train.batch import collate
from reefd.train.spec import LoraSpec, OptimSpec, Rollout, TrainSpec
from reefd.worker import kvcache, openings
from reefd.worker.model import Model


def timed(fn: Callable[[], Any], repeats: int) -> float:
    fn()  # warm
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def prompts(model: Model, n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        chat = [{"role": "user", "content": f"What is {rng.randrange(10)} + {rng.randrange(10)}? "
                                            "Answer with the number only."}]
        ids = model.tokenizer.apply_chat_template(chat, tokenize=True, add_generation_prompt=True)
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return out


def worker_figures(model: Model, repeats: int) -> dict[str, float]:
    import torch

    asked = [p for p in prompts(model, 32) for _ in range(2)]
    plan = openings.plan
    with torch.inference_mode():
        shared = timed(lambda: model.prefill(asked), repeats)
        openings.plan = lambda *_: None
        try:
            plain = timed(lambda: model.prefill(asked), repeats)
        finally:
            openings.plan = plan
        pre = model.prefill(asked)
        cache, mask = model.cache_from(pre.kv), pre.mask
        state = {"cache": model.cache_from(pre.kv), "mask": mask, "positions": mask.sum(1)}
        tokens = pre.last_logits.argmax(-1)

        def decode() -> None:  # one more column each time, as generation goes
            state["mask"] = torch.cat([state["mask"], mask.new_ones((64, 1))], 1)
            _, state["cache"] = model.decode_step(state["cache"], state["mask"], tokens, state["positions"])
            state["positions"] = state["positions"] + 1

        step = timed(decode, repeats)
        drop = timed(lambda: model.cache_from(kvcache.select(kvcache.tensors(cache), mask, list(range(63)))[0]),
                     repeats)
    return {"prefill_plain_s": plain, "prefill_shared_s": shared, "decode_step_s": step, "drop_one_row_s": drop,
            "opening_tokens": len(openings.plan(asked, None).opening)}  # type: ignore[union-attr]


def trainer_figures(model: Model, folder: Path, repeats: int) -> dict[str, float]:
    import torch

    from reefd.train.training import Policy

    rng = random.Random(1)
    rows = []
    for p in prompts(model, 16, seed=1):
        answer = model.encode(rng.choice(["7", "12", "The answer is 9.", "4 + 8 = 12"]))[-9:]
        rows.append(Rollout(p, [*answer, 2], [-1.0] * (len(answer) + 1), float(rng.random() < 0.5)))
    with tempfile.TemporaryDirectory() as tmp:
        policy = Policy(TrainSpec(job="bench", objective="x:Y", settings={}, base_model=folder, init_adapter=None,
                                  output_dir=Path(tmp), samples=rows, lora=LoraSpec(), optim=OptimSpec()))
    batch = collate(rows, list(range(16)), policy.pad_id)
    floor = prefix.MIN_SHARED

    def step() -> torch.Tensor:
        policy.model.zero_grad(set_to_none=True)
        out = policy.forward(batch)
        (out.logp * batch.tokens).sum().backward()
        return out.logp.detach()

    shared_logp = step()
    shared = timed(step, repeats)
    prefix.MIN_SHARED = 10**9
    try:
        plain_logp = step()
        plain = timed(step, repeats)
    finally:
        prefix.MIN_SHARED = floor
    diff = float((shared_logp - plain_logp)[batch.tokens].abs().max())
    if diff > 1e-4:
        raise SystemExit(f"the shared opening changed the log-probs by {diff}")
    return {"train_step_plain_s": plain, "train_step_shared_s": shared, "logp_max_diff": diff}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    if args.model == "smollm2":
        folder = model_folder()
    else:
        from reefd.worker.prepare import prepare

        folder = prepare("tiny", Path(tempfile.mkdtemp()) / "tiny")
    model = Model(folder, device="cpu")
    figures = {**worker_figures(model, args.repeats), **trainer_figures(model, folder, args.repeats)}
    out = {k: round(v, 4) if isinstance(v, float) else v for k, v in figures.items()}
    print(f"prefill of 64 practice prompts ({out['opening_tokens']} tokens shared, each asked twice): "
          f"plain {out['prefill_plain_s']:.3f} s, shared {out['prefill_shared_s']:.3f} s = "
          f"{figures['prefill_plain_s'] / figures['prefill_shared_s']:.2f}x faster")
    print(f"a trainer step of 16 answers: plain {out['train_step_plain_s']:.3f} s, shared "
          f"{out['train_step_shared_s']:.3f} s = {figures['train_step_plain_s'] / figures['train_step_shared_s']:.2f}x "
          f"faster (log-probs {out['logp_max_diff']:.1e} apart)")
    print(f"dropping one finished row of 64: {out['drop_one_row_s'] * 1000:.0f} ms, against "
          f"{out['decode_step_s'] * 1000:.0f} ms for a decode step of the 64")
    print(json.dumps({"bench": "shared_openings", "model": args.model, "repeats": args.repeats, **out}))


if __name__ == "__main__":
    main()
