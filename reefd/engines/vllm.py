"""`engine: vllm`: vLLM's OpenAI server, launched by reefd from vLLM's own Python environment (or attached by url),
one process or several behind sglang-router. Everything above the HTTP contract is SGLangEngine's (generation,
all-or-none adapters with their proof, held and rolling weight swaps, trials, restarts and repair); VLLMClient
speaks vLLM's routes for it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from pathlib import Path
from typing import ClassVar

from reefd.engines import EngineConfig, EngineError, SwapLimits
from reefd.engines.kind_configs import VLLMConfig
from reefd.engines.sglang import SGLangEngine
from reefd.engines.sglang_client import SGLangClient
from reefd.engines.vllm_client import TIED_EMBEDDINGS, VLLMClient

log = logging.getLogger("reefd.engine")

DEV_ROUTES = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true"}
"""What reefd needs of a vLLM server beyond generation: runtime LoRA loading, and the dev-mode routes of a weights
swap (/pause, /collective_rpc, /update_weight_version, /reset_prefix_cache, /resume). They control the whole
server: a vLLM server serving Reef listens on loopback or a private network only."""


def eos_ids(model_dir: Path) -> list[int]:
    """The ids that end an answer, as the worker reads them: config.json's and generation_config.json's
    `eos_token_id` (one or a list)."""
    found: list[int] = []
    for name in ("generation_config.json", "config.json"):
        with contextlib.suppress(OSError, ValueError):
            value = json.loads((model_dir / name).read_text()).get("eos_token_id")
            found += [int(v) for v in (value if isinstance(value, list) else [value]) if v is not None]
    return sorted(set(found))


class VLLMEngine(SGLangEngine):
    """An SGLangEngine whose processes are vLLM servers."""

    Config: ClassVar[type[EngineConfig]] = VLLMConfig
    swap_limits = SwapLimits(tied_embeddings=TIED_EMBEDDINGS)  # its in-place reload_weights gets them wrong

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.served = self.cfg.name or "base"  # the name vLLM serves the base weights as
        self.stop_ids: list[int] = []

    def _connect(self, url: str, router: bool = False) -> SGLangClient:
        text_of = None
        if router and self.template is not None:  # sglang-router takes prompts only as text
            tokenizer = self.template.tokenizer
            text_of = lambda ids: tokenizer.decode(ids, skip_special_tokens=False)  # noqa: E731
        return VLLMClient(self.session, url, self.served, self.stop_ids, text_of)

    def _load_template(self, model_dir: Path) -> None:
        super()._load_template(model_dir)
        self.stop_ids = eos_ids(model_dir)

    async def _attach(self, url: str) -> None:
        client = VLLMClient(self.session, url, self.served, [])
        while True:  # the name it serves the base weights as, once it answers
            with contextlib.suppress(EngineError, OSError, ValueError, TimeoutError):
                self.served, root = await client.base_model()
                if self.model_dir is None and root.is_dir():
                    self.model_dir = root
                break
            await asyncio.sleep(2)
        await super()._attach(url)

    def _env(self) -> dict[str, str]:
        return launch_env(self.cfg)

    def _argv(self, port: int) -> list[str]:
        assert self.model_dir is not None
        return launch_argv(self.cfg, self.model_dir, port, self.served, self.context_length)


def launch_env(cfg: VLLMConfig) -> dict[str, str]:
    """What a launched vLLM server gets beside reefd's environment."""
    env = {**DEV_ROUTES, "VLLM_CPU_KVCACHE_SPACE": f"{cfg.kv_cache_gib:g}", "VLLM_NO_USAGE_STATS": "1",
           "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1"}
    if cfg.replicas > 1:  # replicas on one machine: none pins the cores the others use
        env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
    return env


def launch_argv(cfg: VLLMConfig, model_dir: Path, port: int, served: str, context_length: int | None) -> list[str]:
    """vLLM's OpenAI server on loopback, from the Python of its own environment, with what reefd uses: adapters
    loaded at run time (several in one batch), the model folder's sampling defaults ignored (reefd sends its
    own), and the release's dtype."""
    python = cfg.launcher()
    assert python is not None  # VLLMConfig.problems
    argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
            "--host", "127.0.0.1", "--port", str(port), "--served-model-name", served,
            "--generation-config", "vllm", "--dtype", cfg.dtype, "--max-num-seqs", str(cfg.max_batch),
            "--enable-lora", "--max-loras", str(cfg.max_loras), "--max-lora-rank", str(cfg.max_lora_rank),
            "--max-cpu-loras", str(2 * cfg.max_loras), "--disable-uvicorn-access-log"]
    if context_length is not None:
        argv += ["--max-model-len", str(context_length)]
    if cfg.enforce_eager:
        argv.append("--enforce-eager")
    return argv + list(cfg.launch_args)
