"""reefd.commit.adapters against real PEFT LoRA folders, real HF model folders and hand-made safetensors files."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from reefd.commit.adapters import InvalidAdapter, base_linear_shapes, check_adapter, read_safetensors_header
from tests.loras import make_lora, make_other_base

# peft 0.21 still reads transformers' deprecated `is_gradient_checkpointing` (a FutureWarning)
pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")
Q_PROJ = "model.layers.0.self_attn.q_proj"
Q_A = f"base_model.model.{Q_PROJ}.lora_A.weight"
Q_B = f"base_model.model.{Q_PROJ}.lora_B.weight"


def torch_linears(model: Any) -> dict[str, tuple[int, int]]:
    return {name: (m.out_features, m.in_features) for name, m in model.named_modules() if type(m) is torch.nn.Linear}


@pytest.fixture(scope="module")
def other_base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_other_base(tmp_path_factory.mktemp("models") / "other")


@pytest.fixture(scope="module")
def loras(tiny_model: Path, other_base: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("loras")
    return {
        "plain": make_lora(tiny_model, root / "plain"),
        "regex": make_lora(tiny_model, root / "regex", target_modules=r".*\.(q_proj|v_proj)"),
        "ranked": make_lora(tiny_model, root / "ranked", rank_pattern={"q_proj": 8}),
        "bin": make_lora(tiny_model, root / "bin", safe=False),
        "other": make_lora(other_base, root / "other"),
    }


@pytest.fixture
def lora(loras: dict[str, Path], tmp_path: Path) -> Path:
    """A private copy of the plain adapter, for a test to damage."""
    return Path(shutil.copytree(loras["plain"], tmp_path / "adapter"))


def edit_config(adapter: Path, **changes: Any) -> None:
    path = adapter / "adapter_config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def edit_tensors(adapter: Path, change: Callable[[dict[str, torch.Tensor]], None]) -> None:
    path = adapter / "adapter_model.safetensors"
    tensors = load_file(path)
    change(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def refused(adapter: Path, base: Path) -> str:
    with pytest.raises(InvalidAdapter) as info:
        check_adapter(adapter, base)
    message = str(info.value)
    assert "\n" not in message
    return message


# ---- base models ------------------------------------------------------------------------------


def test_base_linear_shapes_agree_with_torch(tiny_model: Path, other_base: Path) -> None:
    """The Linear layers read from headers are exactly torch's, tied lm_head and shards included."""
    from transformers import AutoModelForCausalLM

    assert (other_base / "model.safetensors.index.json").is_file()
    for base in (tiny_model, other_base):
        model = AutoModelForCausalLM.from_pretrained(base, local_files_only=True)
        assert base_linear_shapes(base) == torch_linears(model)
    assert base_linear_shapes(tiny_model)[Q_PROJ] == (128, 128)
    assert base_linear_shapes(tiny_model)["lm_head"] == (4096, 128)  # tied: absent from the weights


def test_daemon_does_not_import_torch() -> None:
    code = "import reefd.commit.adapters, sys; assert 'torch' not in sys.modules and 'numpy' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


# ---- adapters that pass -----------------------------------------------------------------------


@pytest.mark.parametrize("name", ["plain", "regex", "ranked"])
def test_peft_adapters_pass(loras: dict[str, Path], tiny_model: Path, name: str) -> None:
    assert check_adapter(loras[name], tiny_model) == []


def test_adapter_for_its_own_sharded_base_passes(loras: dict[str, Path], other_base: Path) -> None:
    assert check_adapter(loras["other"], other_base) == []


def test_other_base_name_is_a_warning(lora: Path, tiny_model: Path) -> None:
    edit_config(lora, base_model_name_or_path="org/other-model")
    assert check_adapter(lora, tiny_model) == [
        f"adapter was trained on 'org/other-model', the base model is {str(tiny_model)!r}"
    ]


def test_extra_regular_files_are_ignored(lora: Path, tiny_model: Path) -> None:
    (lora / "training_args.json").write_text("{}")
    assert check_adapter(lora, tiny_model) == []


# ---- adapters that are refused ----------------------------------------------------------------


def test_adapter_for_another_base_model(loras: dict[str, Path], tiny_model: Path) -> None:
    message = refused(loras["other"], tiny_model)
    assert message == (
        f"{loras['other'] / 'adapter_model.safetensors'}: tensor {Q_A!r} has shape (4, 64), "
        "the base model tiny (llama) needs (4, 128) (rank 4)"
    )


def test_rank_pattern_is_honoured(loras: dict[str, Path], tiny_model: Path, tmp_path: Path) -> None:
    ranked = Path(shutil.copytree(loras["ranked"], tmp_path / "ranked"))
    edit_config(ranked, rank_pattern={})
    assert f"tensor {Q_A!r} has shape (8, 128), the base model tiny (llama) needs (4, 128)" in refused(
        ranked, tiny_model
    )


def test_target_module_missing_from_base(lora: Path, tiny_model: Path) -> None:
    edit_config(lora, target_modules=["q_proj", "nope_proj"])
    assert refused(lora, tiny_model) == (
        f"{lora / 'adapter_config.json'}: target module 'nope_proj' matches no module of the base model tiny (llama)"
    )


def test_target_module_not_linear(lora: Path, tiny_model: Path) -> None:
    edit_config(lora, target_modules=["q_proj", "mlp"])
    assert "target module 'mlp' matches 'model.layers.0.mlp', not a Linear layer" in refused(lora, tiny_model)


def test_truncated_weights(lora: Path, tiny_model: Path) -> None:
    file = lora / "adapter_model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])
    assert f"{file}: file is truncated or half-written: it is {len(data) // 2} bytes" in refused(lora, tiny_model)
    file.write_bytes(data[:20])
    assert f"{file}: file is truncated or not safetensors: header length" in refused(lora, tiny_model)


def test_corrupt_header_bytes(lora: Path, tiny_model: Path) -> None:
    file = lora / "adapter_model.safetensors"
    data = bytearray(file.read_bytes())
    data[8:24] = b"\xff" * 16
    file.write_bytes(bytes(data))
    assert refused(lora, tiny_model).startswith(f"{file}: header is not valid JSON (")


def test_missing_config(lora: Path, tiny_model: Path) -> None:
    (lora / "adapter_config.json").unlink()
    assert refused(lora, tiny_model) == f"{lora / 'adapter_config.json'}: missing"


@pytest.mark.parametrize(
    ("changes", "problem"),
    [
        ({"peft_type": "IA3"}, "peft_type is 'IA3'; only LORA adapters are accepted"),
        ({"use_dora": True}, "use_dora is set; DoRA adapters are not supported"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save is set (['lm_head']); it is not supported"),
        ({"r": 0}, "r is 0; the LoRA rank must be an integer >= 1"),
        ({"r": "4"}, "r is '4'; the LoRA rank must be an integer >= 1"),
        ({"rank_pattern": {"q_proj": 2.5}}, "rank_pattern['q_proj'] is 2.5; the LoRA rank must be an integer >= 1"),
        ({"target_modules": 5}, "target_modules 5 is neither a regex nor a list of module names"),
    ],
)
def test_bad_config(lora: Path, tiny_model: Path, changes: dict[str, Any], problem: str) -> None:
    edit_config(lora, **changes)
    assert refused(lora, tiny_model) == f"{lora / 'adapter_config.json'}: {problem}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf"), "max", "-max"])
def test_non_finite_values(lora: Path, tiny_model: Path, dtype: torch.dtype, value: float | str) -> None:
    """Each float dtype: NaN and ±inf are found at their element; the largest finite values pass."""
    finite = isinstance(value, str)
    number = float(value.replace("max", str(torch.finfo(dtype).max))) if isinstance(value, str) else value

    def change(tensors: dict[str, torch.Tensor]) -> None:
        for key, tensor in tensors.items():
            tensors[key] = tensor.to(dtype)
        tensors[Q_B].view(-1)[37] = number

    edit_tensors(lora, change)
    if finite:
        assert check_adapter(lora, tiny_model) == []
    else:
        assert refused(lora, tiny_model).endswith(f"tensor {Q_B!r} holds a non-finite value (NaN or inf) at element 37")


def test_lora_a_without_lora_b(lora: Path, tiny_model: Path) -> None:
    edit_tensors(lora, lambda tensors: tensors.pop(Q_B))
    assert refused(lora, tiny_model) == f"{lora / 'adapter_model.safetensors'}: {Q_PROJ!r} has lora_A but no lora_B"


@pytest.mark.parametrize(
    ("key", "problem"),
    [
        (f"base_model.model.{Q_PROJ}.lora_A.default.weight", "unexpected tensor"),
        ("base_model.model.model.layers.0.self_attn.k_proj.lora_A.weight", "is not in target_modules"),
        ("base_model.model.model.norm.lora_A.weight", "'model.norm' is not a Linear layer"),
    ],
)
def test_unexpected_tensors(lora: Path, tiny_model: Path, key: str, problem: str) -> None:
    edit_tensors(lora, lambda tensors: tensors.update({key: torch.zeros(4, 128)}))
    assert problem in refused(lora, tiny_model)


def test_no_tensors(lora: Path, tiny_model: Path) -> None:
    edit_tensors(lora, lambda tensors: tensors.clear())
    assert refused(lora, tiny_model) == f"{lora / 'adapter_model.safetensors'}: holds no tensors"


def test_symlink_in_folder(lora: Path, tiny_model: Path) -> None:
    os.symlink(tiny_model / "config.json", lora / "notes.json")
    assert refused(lora, tiny_model) == (
        f"{lora / 'notes.json'}: is a symlink; an adapter folder holds regular files only"
    )


def test_bin_only(loras: dict[str, Path], tiny_model: Path) -> None:
    assert sorted(p.name for p in loras["bin"].iterdir()) == ["README.md", "adapter_config.json", "adapter_model.bin"]
    assert refused(loras["bin"], tiny_model) == (
        f"{loras['bin'] / 'adapter_model.bin'}: only safetensors adapters are accepted (adapter_model.safetensors)"
    )


# ---- safetensors headers ----------------------------------------------------------------------


def test_header_matches_safetensors(lora: Path) -> None:
    file = lora / "adapter_model.safetensors"
    header = read_safetensors_header(file)
    with safe_open(file, "pt") as f:
        assert sorted(header) == sorted(f.keys())
        for key, info in header.items():
            assert list(info.shape) == f.get_slice(key).get_shape()
            assert info.dtype == f.get_slice(key).get_dtype()
    assert header[Q_A].shape == (4, 128) and header[Q_A].end - header[Q_A].begin == 4 * 128 * 4


def write_raw(path: Path, header: bytes, data: bytes = b"", length: int | None = None) -> Path:
    path.write_bytes(struct.pack("<Q", len(header) if length is None else length) + header + data)
    return path


def entry(dtype: str, shape: list[int], begin: int, end: int) -> dict[str, Any]:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


@pytest.mark.parametrize(
    ("header", "data", "length", "problem"),
    [
        (b"", b"", 0, "header is not valid JSON"),
        (b"[1, 2]", b"", None, "header is a JSON list, not an object"),
        (b'{"a": 1, "a": 2}', b"", None, "header is not valid JSON (duplicate key 'a')"),
        (b"{}", b"", 2**40, f"header length {2**40} is absurd"),
        (b"{}", b"", 64, "file is truncated or not safetensors: header length 64 exceeds the file's 10 bytes"),
        ({"t": entry("F33", [2], 0, 8)}, bytes(8), None, "tensor 't': unknown dtype 'F33'"),
        ({"t": entry("F32", [-2], 0, 8)}, bytes(8), None, "tensor 't': shape [-2] is not a list of non-negative"),
        ({"t": {"dtype": "F32", "shape": [2]}}, bytes(8), None, "tensor 't': data_offsets None is not [begin, end]"),
        ({"t": entry("F32", [3], 0, 8)}, bytes(8), None, "tensor 't': holds 8 bytes, but F32 (3,) needs 12"),
        ({"t": entry("BF16", [2, 2], 0, 8), "u": entry("I8", [4], 4, 8)}, bytes(8), None, "'u' begins at byte 4"),
        ({"t": entry("F16", [2], 4, 8)}, bytes(8), None, "tensor 't' begins at byte 4 and leaves a gap before it"),
        ({"t": entry("F64", [1], 0, 8)}, bytes(12), None, "file has 4 trailing bytes after the tensors"),
        ({"t": entry("F64", [2], 0, 16)}, bytes(8), None, "file is truncated or half-written"),
        ({"__metadata__": [1]}, b"", None, "the header's __metadata__ is not a JSON object"),
    ],
)
def test_bad_headers(
    tmp_path: Path, header: bytes | dict[str, Any], data: bytes, length: int | None, problem: str
) -> None:
    raw = header if isinstance(header, bytes) else json.dumps(header, separators=(",", ":")).encode()
    path = write_raw(tmp_path / "x.safetensors", raw, data, length)
    with pytest.raises(InvalidAdapter) as info:
        read_safetensors_header(path)
    assert str(info.value).startswith(f"{path}: ") and problem in str(info.value)


def test_too_short(tmp_path: Path) -> None:
    path = tmp_path / "x.safetensors"
    path.write_bytes(b"\x01\x02")
    with pytest.raises(InvalidAdapter, match="file is 2 bytes, too short for a safetensors header"):
        read_safetensors_header(path)
