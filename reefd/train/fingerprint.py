"""`python -m reefd.train.fingerprint --model DIR [--adapter DIR] [--tokenizer DIR] --probe JSON`: a release's
fingerprint, computed by a reference that is not the engine that will serve it: transformers (and PEFT for an
adapter) in their own process, float32 on the CPU, one prompt at a time, greedy. Prints one JSON object: each
prompt's token ids, and for each generated token its id, its logprob (log_softmax of the float32 logits), the
runner-up's id and the margin between them (a near-tie lets an engine's rounding pick the runner-up). The probe:
{"texts": [...], "max_tokens": N}. Exit 0, or 2 with one line on stderr. `--serve`: one request per stdin line
({"model", "adapter", "tokenizer", "probe"}), one answer line each ({"fingerprint": ...} or {"error": ...}), so
that torch is imported once. Torch-side: the daemon runs it as a subprocess (reefd/commit/proofs.py).
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache


def load(model_dir: Path, adapter: Path | None) -> Any:
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, attn_implementation="sdpa")
    model = model.float().eval()
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter, is_trainable=False).eval()
    return model


@torch.inference_mode()
def greedy(model: Any, prompt: list[int], max_tokens: int) -> list[list[Any]]:
    """The worker's own decode, one row: a prefill that keeps the last position's logits, then one token a step
    on the cache."""
    ids = torch.tensor([prompt])
    cache = DynamicCache()
    out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    rows: list[list[Any]] = [[], [], [], []]  # tokens, logprobs, runners-up, margins
    position = len(prompt)
    for _ in range(max_tokens):
        lp = out.logits[:, -1, :].float().log_softmax(-1)[0]
        top = torch.topk(lp, 2)
        token = int(top.indices[0])
        for row, value in zip(rows, (token, float(top.values[0]), int(top.indices[1]),
                                     float(top.values[0] - top.values[1])), strict=True):
            row.append(value)
        out = model(input_ids=torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True,
                    position_ids=torch.tensor([[position]]))
        position += 1
    return rows


def fingerprint(model_dir: Path, adapter: Path | None, texts: list[str], max_tokens: int,
                tokenizer_dir: Path | None = None) -> dict[str, Any]:
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir or model_dir, local_files_only=True)
    model = load(model_dir, adapter)
    prompts = [list(tokenizer.encode(text, add_special_tokens=False)) for text in texts]
    runs = [greedy(model, prompt, max_tokens) for prompt in prompts]
    return {"prompts": prompts, **{key: [run[i] for run in runs]
                                   for i, key in enumerate(("tokens", "logprobs", "second", "margins"))}}


def serve() -> int:
    for line in sys.stdin:
        try:
            req = json.loads(line)
            probe = req["probe"]
            doc: dict[str, Any] = {"fingerprint": fingerprint(
                Path(req["model"]), Path(req["adapter"]) if req.get("adapter") else None, list(probe["texts"]),
                int(probe["max_tokens"]), Path(req["tokenizer"]) if req.get("tokenizer") else None)}
        except Exception as exc:
            doc = {"error": " ".join(str(exc).split())[:500] or type(exc).__name__}
        sys.stdout.write(json.dumps(doc) + "\n")
        sys.stdout.flush()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m reefd.train.fingerprint", description=__doc__)
    parser.add_argument("--serve", action="store_true", help="answer requests read from stdin, one per line")
    parser.add_argument("--model", type=Path)
    parser.add_argument("--adapter", type=Path)
    parser.add_argument("--tokenizer", type=Path, help="the tokenizer's folder (default: the model's)")
    parser.add_argument("--probe", help='{"texts": [...], "max_tokens": N}')
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore")  # transformers' deprecation notes are not this tool's answer
    torch.set_num_threads(1)
    if args.serve:
        return serve()
    if args.model is None or args.probe is None:
        parser.error("--model and --probe are required (or --serve)")
    try:
        probe = json.loads(args.probe)
        doc = fingerprint(args.model, args.adapter, list(probe["texts"]), int(probe["max_tokens"]), args.tokenizer)
    except Exception as exc:
        sys.stderr.write(" ".join(str(exc).split())[:500] or type(exc).__name__)
        return 2
    sys.stdout.write(json.dumps(doc) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
