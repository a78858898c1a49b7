"""vLLM's OpenAI server with test faults, run by vLLM's own Python (tests/e2e/test_engines.py):
`python vllm_fault.py FAULT_FILE ARGS...` serves as `python -m vllm.entrypoints.openai.api_server ARGS...` would,
except that an adapter's loads take the fault FAULT_FILE names at its first load (none while the file is empty or
missing), and the server still says success:
- stale-adapters: the adapter is loaded from the first adapter's folder;
- scaled-layer: from a copy of its folder whose first decoder layer's lora_B tensors are 1.1 times theirs;
- shift-logprobs: every logprob of its non-streamed completions (what the release proof asks) is reported
  SHIFT_NATS off, until it is unloaded.
A release proof must refuse each: these are the engine-side faults the worker's `--fault-file` injects for itself."""

import os
import runpy
import shutil
import sys
from pathlib import Path

from vllm.entrypoints.openai.completion import serving as completion
from vllm.entrypoints.openai.models import serving

FAULT_FILE = Path(sys.argv.pop(1))
SHIFT_NATS = -0.055  # just past the release proof's default tolerance (0.05 nats), as the worker's fault
_load = serving.OpenAIServingModels.load_lora_adapter
_unload = serving.OpenAIServingModels.unload_lora_adapter
_respond = completion.OpenAIServingCompletion.request_output_to_completion_response
_first: list[str] = []
_faulted: dict[str, str] = {}  # adapter name -> the fault of its first load: reefd's retries of it fail the same way
_shifted: set[str] = set()


def fault_now() -> str:
    try:
        return FAULT_FILE.read_text().strip()
    except FileNotFoundError:
        return ""


def scaled(folder: str, name: str) -> str:
    """A copy of the adapter in `folder` with its first decoder layer's LoRA 1.1 times as strong, in a folder of
    this process's own: replicas load at once, and one writing the copy another has mapped would crash it."""
    from safetensors.torch import load_file, save_file

    out = FAULT_FILE.parent / f"scaled-{name}-{os.getpid()}"
    shutil.copytree(folder, out, dirs_exist_ok=True)
    tensors = load_file(str(out / "adapter_model.safetensors"))
    save_file({k: v * 1.1 if ".layers.0." in k and "lora_B" in k else v for k, v in tensors.items()},
              str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    return str(out)


async def _faulty_load(self, request, base_model_name=None):  # type: ignore[no-untyped-def]
    fault = _faulted.setdefault(request.lora_name, fault_now())
    if not _first:
        _first.append(request.lora_path)
    if fault == "stale-adapters":
        request.lora_path = _first[0]
    elif fault == "scaled-layer":
        request.lora_path = scaled(request.lora_path, request.lora_name)
    elif fault == "shift-logprobs":
        _shifted.add(request.lora_name)
    return await _load(self, request, base_model_name)


async def _unloaded(self, request):  # type: ignore[no-untyped-def]
    _shifted.discard(request.lora_name)
    return await _unload(self, request)


def _shifted_response(self, final_res_batch, request, *args, **kwargs):  # type: ignore[no-untyped-def]
    response = _respond(self, final_res_batch, request, *args, **kwargs)
    if request.model in _shifted:
        for choice in response.choices:
            if choice.logprobs is not None:
                lps = choice.logprobs
                lps.token_logprobs = [None if v is None else v + SHIFT_NATS for v in lps.token_logprobs]
                lps.top_logprobs = [None if row is None else {k: v + SHIFT_NATS for k, v in row.items()}
                                    for row in lps.top_logprobs]
    return response


serving.OpenAIServingModels.load_lora_adapter = _faulty_load
serving.OpenAIServingModels.unload_lora_adapter = _unloaded
completion.OpenAIServingCompletion.request_output_to_completion_response = _shifted_response
sys.argv[0] = "vllm.entrypoints.openai.api_server"
runpy.run_module("vllm.entrypoints.openai.api_server", run_name="__main__", alter_sys=True)
