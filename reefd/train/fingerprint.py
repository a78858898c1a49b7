"""`python -m reefd.train.fingerprint --model DIR [--adapter DIR] [--tokenizer DIR] --probe JSON`: a release's
fingerprint, computed by a reference that is not the engine that will serve it: transformers (and PEFT for an
adapter) in their own process, float32 on the CPU, greedy, the prompts decoded together (left-padded, each at its
own positions: a decode step reads the weights once for every prompt). Prints one JSON object: each
prompt's token ids, and for each generated token its id, its logprob (log_softmax of the float32 logits), the
runner-up's id and the margin between them (a near-tie lets an engine's rounding pick the runner-up). The probe:
{"texts": [...], "max_tokens": N}. Exit 0, or 2 with one line on stderr. `--serve`: one request per stdin line
({"model", "adapter", "tokenizer", "probe"}), one answer line each ({"fingerprint": ...} or {"error": ...}), so
that torch is imported once. Torch-side: the daemon runs it as a subprocess (reefd/commit/proofs.py).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from reefd.train import quiet_peft
from reefd.worker import kvcache


def load(model_dir: Path, adapter: Path | None) -> Any:
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, attn_implementation="sdpa")
    model = model.float().eval()
    if adapter is not None:
        from peft import PeftModel

        with quiet_peft():
            model = PeftModel.from_pretrained(model, adapter, is_trainable=False).eval()
    return model


@torch.inference_mode()
def greedy(model: Any, prompts: list[list[int]], max_tokens: int) -> list[list[list[Any]]]:
    """The worker's own decode, all prompts in one batch: a prefill that keeps the last position's logits, then one
    token a step on the cache. Per prompt: its tokens, logprobs, runners-up and margins. Padding is masked and each
    prompt counts its positions from its own first token, so a prompt's answer is what it would be alone (to float
    rounding, about 1e-5 of a logprob)."""
    n, width = len(prompts), max(len(p) for p in prompts)
    on_cache = {cache_arg(model): DynamicCache()}  # filled in place, step by step
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0),
                use_cache=True, logits_to_keep=1, **on_cache)
    position = mask.sum(1, keepdim=True)
    rows: list[list[list[Any]]] = [[[], [], [], []] for _ in prompts]  # tokens, logprobs, runners-up, margins
    for step in range(max_tokens):
        top = torch.topk(out.logits[:, -1, :].float().log_softmax(-1), 2, dim=-1)
        for i, row in enumerate(rows):
            for column, value in zip(row, (int(top.indices[i, 0]), float(top.values[i, 0]), int(top.indices[i, 1]),
                                           float(top.values[i, 0] - top.values[i, 1])), strict=True):
                column.append(value)
        if step + 1 == max_tokens:
            break
        mask = torch.cat([mask, torch.ones(n, 1, dtype=mask.dtype)], 1)
        out = model(input_ids=top.indices[:, :1], attention_mask=mask, position_ids=position, use_cache=True,
                    **on_cache)
        position = position + 1
    return rows


def cache_arg(model: Any) -> str:
    """What the model's forward (under its adapter's, when it has one) calls its KV cache."""
    from peft import PeftModel

    return kvcache.cache_arg(model.get_base_model() if isinstance(model, PeftModel) else model)


@functools.lru_cache(maxsize=4)
def _tokenizer(folder: str, stamp: tuple[int, ...]) -> Any:
    """A folder's tokenizer, loaded once per process while its files stay as they were (`stamp`)."""
    return AutoTokenizer.from_pretrained(folder, local_files_only=True)


def tokenizer_of(folder: Path) -> Any:
    stamp = tuple(f.stat().st_mtime_ns for f in sorted(folder.glob("tokenizer*")) if f.is_file())
    return _tokenizer(str(folder), stamp)


def fingerprint(model_dir: Path, adapter: Path | None, texts: list[str], max_tokens: int,
                tokenizer_dir: Path | None = None) -> dict[str, Any]:
    tokenizer = tokenizer_of(tokenizer_dir or model_dir)
    model = load(model_dir, adapter)
    prompts = [list(tokenizer.encode(text, add_special_tokens=False)) for text in texts]
    runs = greedy(model, prompts, max_tokens)
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
