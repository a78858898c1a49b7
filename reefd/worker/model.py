"""The model on its device: load an HF folder, prefill left-padded prompts, decode one step.

Owns tensors, devices, the tokenizer and the EOS set. Knows nothing about requests,
sampling or scheduling; every call here runs on the batcher thread.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache
from transformers.utils import logging as hf_logging

from reefd.worker import kvcache, openings
from reefd.worker.lora import RowLoRA
from reefd.worker.params import BadRequest

log = logging.getLogger("reefd.worker")


@dataclass
class Prefill:
    """The result of one prefill: cache rows, their mask, the next-token logits per row."""

    kv: kvcache.KV
    mask: torch.Tensor  # (rows, columns) 1 for real tokens
    last_logits: torch.Tensor  # (rows, vocab)
    all_logits: torch.Tensor | None  # (rows, last `keep` columns, vocab) when input logprobs were asked


class Model:
    """A causal LM and its tokenizer, in float32 on CUDA when present, else CPU.

    Attention is PyTorch SDPA: a prompt without padding runs causal attention with no mask
    tensor at all, so a 40k-token prefill needs memory linear in its length.
    """

    def __init__(self, path: Path, device: str | None = None, context_length: int | None = None) -> None:
        hf_logging.disable_progress_bar()
        self.path = Path(path)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.tokenizer: Any = AutoTokenizer.from_pretrained(self.path, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(self.path, local_files_only=True, attn_implementation="sdpa")
        self.model: Any = model.float().to(self.device).eval()
        self.config = self.model.config
        if self.device.type == "cpu":
            _use_weight_major_linears(self.model)
        self.vocab_size = int(self.model.get_output_embeddings().weight.shape[0])
        # The model's own length, unless the operator sets a shorter one (SGLang's --context-length).
        model_length = int(getattr(self.config, "max_position_embeddings", 0) or 4096)
        if context_length is not None and not 2 <= context_length <= model_length:
            raise ValueError(f"context length {context_length} is outside [2, {model_length}] for {self.path}")
        self.context_length = context_length or model_length
        self.eos_ids = self._eos_ids()
        self.adapters: dict[str, str] = {}  # LoRA adapter name -> the folder it came from
        self.lora = RowLoRA(self.model, self.device)  # their factors, each row of a batch reading its own
        self.weight_version: str | None = None
        self.fault: str | None = None  # tests only (params.FAULTS): loads that say success and serve otherwise
        self.fault_file: Path | None = None  # tests only: names the fault of each adapter, read at its first load
        self.faulted: dict[str, str] = {}  # with fault_file: adapter name -> the fault of its first load
        self.shifted: set[str] = set()  # adapters loaded under shift-logprobs: their answers' logprobs are off
        self._cache_arg = kvcache.cache_arg(self.model)
        pad = self.tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else min(self.eos_ids, default=0))
        log.info("loaded %s on %s (vocab %d, context %d, attention %s, eos %s)", self.path, self.device,
                 self.vocab_size, self.context_length, self.config._attn_implementation, sorted(self.eos_ids))

    def _eos_ids(self) -> set[int]:
        ids: set[int] = set()
        for source in (self.tokenizer.eos_token_id, getattr(self.model.generation_config, "eos_token_id", None),
                       getattr(self.config, "eos_token_id", None)):
            if isinstance(source, int):
                ids.add(source)
            elif isinstance(source, (list, tuple)):
                ids.update(int(i) for i in source)
        return ids

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=True))

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=True))

    def _forward(self, adapters: Sequence[str | None] | None, **kwargs: Any) -> Any:
        """One model call; `adapters` names each row's LoRA adapter (None: the base model). Rows on different
        adapters, and base rows beside them, share the forward: each row reads its own adapter's factors
        (reefd/worker/lora.py)."""
        rows = int(kwargs["input_ids"].shape[0])
        names = list(adapters) if adapters is not None and len(adapters) == rows else [None] * rows
        with self.lora.rows(names):
            return self.model(**kwargs)

    def prefill(self, prompts: Sequence[Sequence[int]], keep: int = 1,
                adapters: Sequence[str | None] | None = None) -> Prefill:
        """Run left-padded prompts through the model (position ids = cumsum(mask) - 1).

        `keep` > 1 also returns the logits of the last `keep` columns (for prompt logprobs).
        Without padding no attention mask is passed: SDPA's causal kernel then materialises
        nothing quadratic in the prompt length (a padded batch costs a (rows, 1, q, k) mask).
        Prompts that open alike, or repeat, run what they share once (reefd/worker/openings.py).
        """
        shared = openings.plan(prompts, adapters) if keep == 1 else None
        if shared is not None:
            return self._prefill_shared(shared, adapters)
        ids, mask = self._left_padded(prompts)
        positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
        padded = any(len(p) < ids.shape[1] for p in prompts)
        out = self._forward(adapters, input_ids=ids, attention_mask=mask if padded else None, position_ids=positions,
                            use_cache=True, logits_to_keep=max(1, keep), **self._cache_kwarg(self._new_cache()))
        logits = out.logits
        return Prefill(kvcache.tensors(kvcache.returned(out)), mask, logits[:, -1], logits if keep > 1 else None)

    def _prefill_shared(self, plan: openings.Plan, adapters: Sequence[str | None] | None) -> Prefill:
        """The opening at batch 1, its keys and values expanded to each distinct rest, the rests left-padded after
        it ([opening | padding | rest]: the mask and the positions skip the padding), then a copy of each rest's
        cache rows for every prompt that asked it."""
        n, width = len(plan.rests), len(plan.opening)
        one = None if adapters is None else [adapters[0]]
        cache = self._new_cache()
        if plan.opening:
            head = self._forward(one, input_ids=torch.tensor([plan.opening], device=self.device), use_cache=True,
                                 logits_to_keep=1, **self._cache_kwarg(self._new_cache()))
            cache = self.cache_from([(k.expand(n, -1, -1, -1), v.expand(n, -1, -1, -1))
                                     for k, v in kvcache.tensors(kvcache.returned(head))])
        ids, rest_mask = self._left_padded(plan.rests)
        mask = torch.cat([rest_mask.new_ones((n, width)), rest_mask], dim=1)
        positions = (mask.cumsum(dim=1) - 1).clamp(min=0)[:, width:]
        out = self._forward(None if one is None else one * n, input_ids=ids, attention_mask=mask,
                            position_ids=positions, use_cache=True, logits_to_keep=1, **self._cache_kwarg(cache))
        index = torch.tensor(plan.rows, device=self.device)
        kv = [(k.index_select(0, index), v.index_select(0, index)) for k, v in kvcache.tensors(kvcache.returned(out))]
        return Prefill(kv, mask.index_select(0, index), out.logits[:, -1].index_select(0, index), None)

    def _left_padded(self, prompts: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids and attention mask of `prompts`, left-padded to the longest, on the model's device."""
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            ids[row, width - len(prompt) :] = torch.tensor(list(prompt), dtype=torch.long)
            mask[row, width - len(prompt) :] = 1
        return ids.to(self.device), mask.to(self.device)

    def decode_step(self, cache: DynamicCache, mask: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
                    adapters: Sequence[str | None] | None = None) -> tuple[torch.Tensor, DynamicCache]:
        """Feed one token per row; `mask` already includes the new column."""
        out = self._forward(adapters, input_ids=tokens[:, None], attention_mask=mask, position_ids=positions[:, None],
                            use_cache=True, **self._cache_kwarg(cache))
        return out.logits[:, -1], kvcache.returned(out)

    # ---- LoRA adapters and weight reload (batcher thread, between steps) ----------------
    def check_adapter(self, path: Path) -> list[str]:
        """Refuse (BadRequest) a folder that is not a LoRA adapter this base model can take.

        The same rules reefd applies before it publishes an adapter (reefd.commit.adapters): a LoRA
        config whose targets are Linear layers of the model, intact safetensors with lora_A/lora_B
        shapes that fit them, finite values. Returns warnings.
        """
        from reefd.commit.adapters import InvalidAdapter
        from reefd.commit.adapters import check_adapter as check

        try:
            return check(Path(path), self.path)
        except InvalidAdapter as exc:
            raise BadRequest(str(exc)) from None

    def load_adapter(self, name: str, path: Path) -> list[str]:
        """Validate, then load a PEFT LoRA folder under `name`; on any failure nothing changes."""
        if not name:
            raise BadRequest(f"{name!r} is not a usable adapter name")
        if name in self.adapters:
            raise BadRequest(f"an adapter named {name!r} is already loaded (unload it first)")
        notes = self.check_adapter(path)
        try:
            self.lora.load(name, Path(path))
        except Exception as exc:
            raise BadRequest(f"cannot load adapter {name!r} from {path}: {exc}") from None
        fault = self._fault_of(name)
        if fault == "shift-logprobs":
            self.shifted.add(name)
        elif fault is not None:
            self.lora.misload(name, fault, next(reversed(self.adapters), None))
        self.adapters[name] = str(path)
        for note in notes:
            log.warning("adapter %s: %s", name, note)
        log.info("loaded LoRA adapter %s from %s", name, path)
        return notes

    def _fault_of(self, name: str) -> str | None:
        """The test fault a load of adapter `name` takes: `fault`, or what `fault_file` named at the adapter's first
        load (none while it is empty or missing), so that a test switches faults between loads and reefd's later
        tries of the same release fail as its first did."""
        if self.fault is not None or self.fault_file is None:
            return self.fault
        if name not in self.faulted:
            try:
                self.faulted[name] = self.fault_file.read_text().strip()
            except FileNotFoundError:
                self.faulted[name] = ""
        return self.faulted[name] or None

    def unload_adapter(self, name: str) -> None:
        if name not in self.adapters:
            raise BadRequest(f"no adapter named {name!r} is loaded")
        self.lora.unload(name)
        del self.adapters[name]
        self.shifted.discard(name)
        log.info("unloaded LoRA adapter %s", name)

    def read_weights(self, path: Path) -> dict[str, torch.Tensor]:
        """Load an HF folder's parameters (off the batcher thread); refuses another architecture."""
        from transformers import AutoConfig

        path = Path(path)
        try:
            config = AutoConfig.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError) as exc:
            raise BadRequest(f"cannot read a model config at {path}: {exc}") from None
        theirs, ours = ((c.model_type, getattr(c, "architectures", None)) for c in (config, self.config))
        if theirs != ours:
            raise BadRequest(f"{path} holds a {theirs[0]} {theirs[1]}, the worker serves a {ours[0]} {ours[1]}")
        try:
            model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError, RuntimeError) as exc:
            raise BadRequest(f"cannot load weights from {path}: {exc}") from None
        return {name: p.detach().float() for name, p in model.named_parameters()}

    def apply_weights(self, weights: dict[str, torch.Tensor], path: Path | None, version: str | None = None,
                      partial: bool = False) -> None:
        """Copy weights into the running model (batcher thread); all checked before any copy. `path` None: they
        came over a weight update group, and `partial`: only the parameters named change."""
        params = dict(self.model.named_parameters())
        source = path or "the broadcast"
        if (set(weights) - set(params)) if partial else set(weights) != set(params):
            diff = sorted(set(weights) ^ set(params) if not partial else set(weights) - set(params))[:5]
            raise BadRequest(f"{source}: the parameters differ from the served model's (e.g. {diff})")
        for name, tensor in weights.items():
            if tuple(tensor.shape) != tuple(params[name].shape):
                raise BadRequest(f"{source}: {name} has shape {tuple(tensor.shape)}, not "
                                 f"{tuple(params[name].shape)}")
        with torch.no_grad():
            for name, tensor in weights.items():
                if self.fault != "ignore-weights":
                    params[name].copy_(tensor.to(params[name].device))
        if path is not None:
            self.path = Path(path)
        self.weight_version = version
        log.info("weights updated from %s (version %s, %d tensors)", source, version, len(weights))

    def cache_from(self, kv: kvcache.KV) -> DynamicCache:
        return kvcache.build(kv, self.config)

    def _new_cache(self) -> DynamicCache:
        return kvcache.build([], self.config)

    def _cache_kwarg(self, cache: DynamicCache) -> dict[str, DynamicCache]:
        return {self._cache_arg: cache}


def _use_weight_major_linears(model: torch.nn.Module) -> None:
    """On CPU, compute each Linear of 2..8 rows as (W @ x.T).T: same math, same parameters.

    With few rows, MKL's plain `x @ W.T` is the slow path on this class of CPU (measured on
    SmolLM2-135M, 8 rows: LM head 11.3 ms -> 5.7 ms, the 210 layer matmuls 33 -> 26 ms), and
    the matmuls are ~80% of a batched decode step. One row and prefill shapes are unchanged.
    """
    for module in model.modules():
        if type(module) is torch.nn.Linear:
            module.forward = _weight_major_forward(module)


def _weight_major_forward(linear: torch.nn.Linear) -> Any:
    def forward(x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        if not 2 <= flat.shape[0] <= 8:
            return torch.nn.functional.linear(x, linear.weight, linear.bias)
        out = (linear.weight @ flat.T).T
        if linear.bias is not None:
            out = out + linear.bias
        return out.contiguous().reshape(*x.shape[:-1], -1)

    return forward
