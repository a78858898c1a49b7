"""VLLMClient's translation between SGLang's /generate shapes and vLLM's /v1/completions, and the vllm kind's
config rules, without a server (tests/e2e/test_engines.py runs a real vLLM)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from reefd.engines import EngineError, check
from reefd.engines.kind_configs import ModelConfig, VLLMConfig
from reefd.engines.vllm_client import Translation, VLLMClient


def client(text_of: bool = False) -> VLLMClient:
    return VLLMClient(None, "http://127.0.0.1:1", "base", [2],  # type: ignore[arg-type]
                      text_of=(lambda ids: " ".join(map(str, ids))) if text_of else None)


PAYLOAD = {"input_ids": [1, 5, 6], "stream": True, "top_logprobs_num": 2, "lora_path": "r1-abc",
           "sampling_params": {"max_new_tokens": 4, "temperature": 0.5, "top_p": 0.9, "top_k": -1, "stop": ["\n"],
                               "sampling_seed": 7}}


def test_a_generate_payload_becomes_a_completions_request() -> None:
    body = client().completion_body(PAYLOAD)
    assert body["prompt"] == [1, 5, 6] and "add_special_tokens" not in body
    assert (body["model"], body["max_tokens"], body["seed"], body["stop"], body["logprobs"]) == ("r1-abc", 4, 7,
                                                                                                  ["\n"], 2)
    assert body["return_token_ids"] and body["return_tokens_as_token_ids"] and body["stop_token_ids"] == [2]
    assert body["stream_options"] == {"include_usage": True}
    routed = client(text_of=True).completion_body({**PAYLOAD, "lora_path": None})
    assert routed["prompt"] == "1 5 6" and routed["add_special_tokens"] is False and routed["model"] == "base"


@pytest.mark.parametrize("key", ["echo", "prompt_logprobs", "logprob_start_len"])
def test_prompt_logprobs_are_never_asked_of_a_lora_server(key: str) -> None:
    with pytest.raises(EngineError, match="prompt logprobs"):
        client().completion_body({**PAYLOAD, key: 1})


def test_streamed_chunks_become_sglang_incremental_chunks() -> None:
    reading = Translation(top_k=2)
    first = reading.chunk({"choices": [{
        "text": "Hi", "token_ids": [9], "prompt_token_ids": [1, 5, 6], "finish_reason": None,
        "logprobs": {"token_logprobs": [-0.5], "top_logprobs": [
            {"token_id:9": -0.5, "token_id:4": -0.9, "token_id:3": -2.0}]}}]}, last=False)
    assert first["text"] == "Hi" and first["output_ids"] == [9]
    assert first["meta_info"]["output_token_logprobs"] == [[-0.5, 9, None]]
    assert first["meta_info"]["output_top_logprobs"] == [[[-0.5, 9, None], [-0.9, 4, None]]]  # best 2 of 3
    assert "completion_tokens" not in first["meta_info"]  # not cumulative: Generation adds it up
    # vLLM puts the sampled token first even when it is not among the best: sorted, then cut to K
    sampled_low = reading.chunk({"choices": [{"text": "!", "token_ids": [7], "finish_reason": "stop",
                                              "stop_reason": None, "logprobs": {"token_logprobs": [-3.0],
                                              "top_logprobs": [{"token_id:7": -3.0, "token_id:1": -0.1,
                                                                "token_id:2": -0.2}]}}]}, last=False)
    assert [e[1] for e in sampled_low["meta_info"]["output_top_logprobs"][0]] == [1, 2]
    last = reading.chunk({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}}, last=True)
    assert last["output_ids"] == [] and last["meta_info"]["completion_tokens"] == 2
    assert last["meta_info"]["finish_reason"] == {"type": "stop", "matched": None}
    assert last["meta_info"]["prompt_token_ids"] == [1, 5, 6] and last["meta_info"]["prompt_tokens"] == 3


@pytest.mark.parametrize(("reason", "stop", "want"), [
    ("length", None, {"type": "length", "matched": None}), ("stop", "\n", {"type": "stop", "matched": "\n"}),
    ("abort", None, {"type": "abort", "message": "vLLM aborted the request"})])
def test_finish_reasons(reason: str, stop: str | None, want: dict[str, str | None]) -> None:
    chunk = Translation(0).chunk({"choices": [{"text": "", "token_ids": [], "finish_reason": reason,
                                               "stop_reason": stop}]}, last=True)
    assert chunk["meta_info"]["finish_reason"] == want


def test_a_launched_vllm_needs_its_own_python(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("REEF_VLLM_PYTHON", raising=False)
    assert [k for k, _ in VLLMConfig(source="tiny").problems()] == ["model.python"]
    assert VLLMConfig(url="http://127.0.0.1:8000").problems() == []  # attached: its environment is not ours
    assert "not an executable" in VLLMConfig(source="tiny", python=str(tmp_path / "none")).problems()[0][1]
    python = tmp_path / "python"
    python.write_text("#!/bin/sh\n")
    python.chmod(0o755)
    monkeypatch.setenv("REEF_VLLM_PYTHON", str(python))
    assert VLLMConfig(source="tiny").problems() == []
    model = {**ModelConfig().__dict__, "engine": "vllm", "source": "tiny", "max_lora_rank": 16}
    assert check(model) == []


def test_weights_with_tied_embeddings_are_refused_before_any_call(tmp_path: Path) -> None:
    """vLLM 0.32's in-place reload leaves a tied output layer on the old weights: such a swap is refused, naming
    the reason, before the server is paused (the client has no session to reach one)."""
    (tmp_path / "config.json").write_text('{"tie_word_embeddings": true}')
    with pytest.raises(EngineError, match="tied embeddings"):
        asyncio.run(client().update_weights_from_disk(tmp_path, "r1"))
