"""An RL loop written for Tinker, in the style of tinker-cookbook's `recipes/rl_loop.py`: each step saves the
policy's weights for a sampler, samples a group of answers per prompt, scores them, and trains on the group's
advantages with `importance_sampling`, the sampler's logprobs as the old policy's. The SDK alone, configured by its
own environment (TINKER_BASE_URL, TINKER_API_KEY); nothing in it knows of reefd. The reward, which the base model
already earns half of: the share of an answer's tokens in the lower half of the vocabulary (TOKENS_BELOW).
BASE_MODEL, STEPS, LR, RANK and GROUP choose the run. It prints one JSON line per step.
"""

from __future__ import annotations

import json
import os

import tinker
from tinker import types

BASE_MODEL = os.environ.get("BASE_MODEL", "tiny")
STEPS = int(os.environ.get("STEPS", "6"))
LR = float(os.environ.get("LR", "3e-2"))
RANK = int(os.environ.get("RANK", "8"))
GROUP = int(os.environ.get("GROUP", "4"))
TOKENS_BELOW = int(os.environ.get("TOKENS_BELOW", "2048"))
PROMPTS = [[5, 17, 29, 41], [9, 8, 7, 6, 5], [100, 200, 300], [1000, 1001, 1002, 1003]]


def reward(tokens: list[int]) -> float:
    return sum(t < TOKENS_BELOW for t in tokens) / max(1, len(tokens))


def group_data(prompt: list[int], result: types.SampleResponse) -> tuple[list[types.Datum], list[float]]:
    """Each sample as a datum: the prompt's positions weigh nothing, the answer's carry its advantage."""
    rewards = [reward(seq.tokens) for seq in result.sequences]
    mean = sum(rewards) / len(rewards)
    data = []
    for seq, r in zip(result.sequences, rewards, strict=True):
        tokens = prompt + seq.tokens
        assert seq.logprobs is not None
        data.append(types.Datum(
            model_input=types.ModelInput.from_ints(tokens[:-1]),
            loss_fn_inputs={"target_tokens": tokens[1:],
                            "logprobs": [0.0] * (len(prompt) - 1) + list(seq.logprobs),
                            "advantages": [0.0] * (len(prompt) - 1) + [r - mean] * len(seq.tokens)}))
    return data, rewards


def main() -> None:
    service_client = tinker.ServiceClient()
    training_client = service_client.create_lora_training_client(base_model=BASE_MODEL, rank=RANK).result()
    params = types.SamplingParams(max_tokens=8, temperature=1.0)
    for step in range(STEPS):
        sampling_client = training_client.save_weights_and_get_sampling_client().result()
        futures = [sampling_client.sample(prompt=types.ModelInput.from_ints(p), num_samples=GROUP,
                                          sampling_params=params) for p in PROMPTS]
        data, rewards, ids = [], [], []
        for prompt, future in zip(PROMPTS, futures, strict=True):
            result = future.result()
            more, got = group_data(prompt, result)
            data += more
            rewards += got
            ids += [seq.sequence_id for seq in result.sequences]
        fwd_bwd_future = training_client.forward_backward(data, loss_fn="importance_sampling")
        optim_future = training_client.optim_step(types.AdamParams(learning_rate=LR))
        fwd_bwd_future.result()
        optim_future.result()
        print(json.dumps({"step": step, "reward": sum(rewards) / len(rewards), "sequence_ids": ids}), flush=True)
    service_client.close("success").result()


if __name__ == "__main__":
    main()
