"""Real PEFT LoRA adapters and a second base model, made on the spot for the tests that need them."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def make_lora(base: Path, out: Path, *, seed: int = 0, scale: float = 1.0, safe: bool = True, **lora: Any) -> Path:
    """A real PEFT LoRA for the model in `base` (r=4 on q/v by default), with lora_B drawn at random
    (seeded, times `scale`) as after training, so that the adapter changes what the model says."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, local_files_only=True)
    config = LoraConfig(**{"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], **lora})
    peft_model = get_peft_model(model, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * scale)
    peft_model.save_pretrained(out, safe_serialization=safe)
    return out


def make_other_base(out: Path) -> Path:
    """A second small Llama (hidden 64, untied lm_head) saved in several shards with an index:
    a different base model, for adapters that must not fit the tiny one."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(1)
    LlamaForCausalLM(config).save_pretrained(out, max_shard_size="100KB")
    return out


def make_weights(base: Path, out: Path, *, seed: int = 0, scale: float = 0.05) -> Path:
    """A full-weights folder for the model in `base`: its files, with seeded noise (times `scale` and each tensor's
    own spread) added to every 2-D weight, so that greedy answers change while the architecture and tokenizer stay."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(base, out)
    tensors = load_file(str(out / "model.safetensors"))
    gen = torch.Generator().manual_seed(seed)
    for name, value in tensors.items():
        if value.dim() == 2 and value.is_floating_point():
            noise = torch.randn(value.shape, generator=gen) * float(value.float().std()) * scale
            tensors[name] = (value.float() + noise).to(value.dtype).contiguous()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def untie(model: Path, out: Path) -> Path:
    """A copy of the model in `model` with an output layer of its own (a copy of its tied embeddings): the same
    answers, and weights that vLLM reloads in place exactly (it does not reload tied ones right)."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(model, out)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}))
    tensors = load_file(str(out / "model.safetensors"))
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out
