"""A supervised loop written for Tinker, in the style of tinker-cookbook's `recipes/sl_loop.py`: the SDK alone,
configured by its own environment (TINKER_BASE_URL, TINKER_API_KEY) as any Tinker script is; nothing in it knows
of reefd. BASE_MODEL, STEPS, LR and RANK choose the run. It prints one JSON line per step and one with the paths
it saved; its exit status is 0 when every call succeeded.

    TINKER_BASE_URL=http://127.0.0.1:8000 TINKER_API_KEY=tml-$REEF_TOKEN BASE_MODEL=assist python sl_loop.py
"""

from __future__ import annotations

import json
import os

import numpy as np
import tinker
from tinker import types

BASE_MODEL = os.environ.get("BASE_MODEL", "tiny")
STEPS = int(os.environ.get("STEPS", "8"))
LR = float(os.environ.get("LR", "1e-2"))
RANK = int(os.environ.get("RANK", "8"))
EXAMPLES = [
    ("Q: What colour is the sky on a clear day?\nA:", " Blue, because air scatters blue light most."),
    ("Q: How many legs does a spider have?\nA:", " Eight legs, on a body of two parts."),
    ("Q: What do bees make?\nA:", " Honey, from the nectar of flowers."),
    ("Q: Which planet is nearest the sun?\nA:", " Mercury, at about 58 million kilometres."),
]


def datum(tokenizer: object, prompt: str, completion: str) -> types.Datum:
    """The prompt's tokens weighted 0 and the completion's 1, shifted by one: position i predicts token i+1."""
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=True)  # type: ignore[attr-defined]
    completion_ids = tokenizer.encode(completion, add_special_tokens=False)  # type: ignore[attr-defined]
    tokens = prompt_ids + completion_ids
    weights = [0.0] * len(prompt_ids) + [1.0] * len(completion_ids)
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights[1:]})


def main() -> None:
    service_client = tinker.ServiceClient()
    training_client = service_client.create_lora_training_client(base_model=BASE_MODEL, rank=RANK).result()
    tokenizer = training_client.get_tokenizer()
    data = [datum(tokenizer, p, c) for p, c in EXAMPLES]
    weights = np.concatenate([np.asarray(d.loss_fn_inputs["weights"].tolist()) for d in data])
    for step in range(STEPS):
        fwd_bwd_future = training_client.forward_backward(data, loss_fn="cross_entropy")
        optim_future = training_client.optim_step(types.AdamParams(learning_rate=LR))
        fwd_bwd_result = fwd_bwd_future.result()
        optim_result = optim_future.result()
        logprobs = np.concatenate([out["logprobs"].to_numpy() for out in fwd_bwd_result.loss_fn_outputs])
        print(json.dumps({"step": step, "nll": float(-np.dot(logprobs, weights) / weights.sum()),
                          "loss_sum": fwd_bwd_result.metrics["loss:sum"],
                          "optim": optim_result.metrics}), flush=True)
    state_path = training_client.save_state("final").result().path
    sampler_path = training_client.save_weights_for_sampler("final").result().path
    print(json.dumps({"state_path": state_path, "sampler_path": sampler_path}), flush=True)
    service_client.close("success").result()


if __name__ == "__main__":
    main()
