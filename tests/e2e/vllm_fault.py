"""vLLM's OpenAI server with a test fault, run by vLLM's own Python (tests/e2e/test_engines.py):
`python vllm_fault.py FAULT ARGS...` serves as `python -m vllm.entrypoints.openai.api_server ARGS...` would, except:
- stale-adapters: every adapter after the first is loaded from the first one's folder, and the server says success.
A release proof must refuse such a load; this is the engine-side fault the worker's `--fault` injects for itself."""

import runpy
import sys

from vllm.entrypoints.openai.models import serving

FAULT = sys.argv.pop(1)
_load = serving.OpenAIServingModels.load_lora_adapter
_first: list[str] = []


async def _stale(self, request, base_model_name=None):  # type: ignore[no-untyped-def]
    if _first:
        request.lora_path = _first[0]
    else:
        _first.append(request.lora_path)
    return await _load(self, request, base_model_name)


if FAULT == "stale-adapters":
    serving.OpenAIServingModels.load_lora_adapter = _stale
else:
    raise SystemExit(f"unknown fault {FAULT!r}")
sys.argv[0] = "vllm.entrypoints.openai.api_server"
runpy.run_module("vllm.entrypoints.openai.api_server", run_name="__main__", alter_sys=True)
