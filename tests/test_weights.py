"""reefd.commit.weights against copies of the real tiny model, as transformers writes them and as damaged by hand."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from reefd.commit.weights import TOKENIZER_FILES, InvalidWeights, check_weights, weight_files

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
UP_PROJ = "model.layers.1.mlp.up_proj.weight"


@pytest.fixture
def release(tiny_model: Path, tmp_path: Path) -> Path:
    """A private copy of the tiny model, for a test to change."""
    return Path(shutil.copytree(tiny_model, tmp_path / "release"))


def edit_config(folder: Path, **changes: Any) -> None:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps({k: v for k, v in config.items() if v is not None}, indent=2))


def edit_tensors(folder: Path, change: Callable[[dict[str, torch.Tensor]], None]) -> None:
    path = folder / WEIGHTS
    tensors = load_file(path)
    change(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def shard(folder: Path) -> dict[str, str]:
    """Split model.safetensors into two shards and an index, as transformers names them; returns the weight_map."""
    tensors = load_file(folder / WEIGHTS)
    names = sorted(tensors)
    weight_map: dict[str, str] = {}
    for i, part in enumerate((names[: len(names) // 2], names[len(names) // 2 :]), start=1):
        file = f"model-0000{i}-of-00002.safetensors"
        save_file({name: tensors[name] for name in part}, folder / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (folder / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    (folder / WEIGHTS).unlink()
    return weight_map


def refused(folder: Path, base: Path) -> str:
    with pytest.raises(InvalidWeights) as info:
        check_weights(folder, base)
    message = str(info.value)
    assert "\n" not in message
    assert message == f"{info.value.path}: {info.value.problem}"
    return message


def test_daemon_does_not_import_torch() -> None:
    code = "import reefd.commit.weights, sys; assert 'torch' not in sys.modules and 'numpy' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


# ---- folders that pass ------------------------------------------------------------------------


def test_unchanged_copy_passes(release: Path, tiny_model: Path) -> None:
    assert check_weights(release, tiny_model) == []
    assert weight_files(release) == [release / WEIGHTS]


def test_base_checked_against_itself_passes(tiny_model: Path) -> None:
    assert check_weights(tiny_model, tiny_model) == []


@pytest.mark.parametrize(("dtype", "name"), [(torch.float16, "F16"), (torch.bfloat16, "BF16")])
def test_other_float_dtype_passes_with_a_warning(release: Path, tiny_model: Path, dtype: torch.dtype,
                                                 name: str) -> None:
    edit_tensors(release, lambda t: t.update({k: v.to(dtype) for k, v in t.items()}))
    assert check_weights(release, tiny_model) == [f"{WEIGHTS}: stored as {name}, the base model as F32"]


def test_one_tensor_in_another_dtype_is_counted(release: Path, tiny_model: Path) -> None:
    edit_tensors(release, lambda t: t.update({UP_PROJ: t[UP_PROJ].half()}))
    assert check_weights(release, tiny_model) == [f"{WEIGHTS}: 1 tensor stored as F16, the base model's as F32"]


def test_transformers_save_pretrained_sharded_passes(release: Path, tiny_model: Path, tmp_path: Path) -> None:
    """What a trainer writes: save_pretrained's shards and index, with the base's tokenizer files copied."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, local_files_only=True)
    out = tmp_path / "saved"
    model.save_pretrained(out, max_shard_size="1MB")
    for name in TOKENIZER_FILES:
        if (tiny_model / name).is_file():
            shutil.copy(tiny_model / name, out / name)
    assert not (out / WEIGHTS).exists() and len(weight_files(out)) > 1
    assert check_weights(out, tiny_model) == []


def test_hand_sharded_folder_passes_and_loads(release: Path, tiny_model: Path) -> None:
    weight_map = shard(release)
    assert check_weights(release, tiny_model) == []
    assert [p.name for p in weight_files(release)] == sorted(set(weight_map.values()))
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(release, local_files_only=True).state_dict()
    for name, tensor in load_file(tiny_model / WEIGHTS).items():
        assert torch.equal(loaded[name], tensor)


def test_extra_files_are_allowed(release: Path, tiny_model: Path) -> None:
    (release / "README.md").write_text("# a release\n")
    (release / "metrics.json").write_text("{}")
    assert check_weights(release, tiny_model) == []


def test_head_dim_and_kv_heads_left_out_are_derived(release: Path, tiny_model: Path) -> None:
    """Configs that predate these keys mean hidden_size / num_attention_heads and num_attention_heads."""
    edit_config(release, head_dim=None, num_key_value_heads=None)
    assert check_weights(release, tiny_model) == []


# ---- folder and config --------------------------------------------------------------------------


def test_symlink_is_refused(release: Path, tiny_model: Path) -> None:
    os.symlink(release / "config.json", release / "README.md")
    assert refused(release, tiny_model) == (
        f"{release / 'README.md'}: is a symlink; a weights folder holds regular files only"
    )


def test_subfolder_is_refused(release: Path, tiny_model: Path) -> None:
    (release / "checkpoint-1").mkdir()
    assert "checkpoint-1: is not a regular file" in refused(release, tiny_model)


def test_not_a_folder_is_refused(tmp_path: Path, tiny_model: Path) -> None:
    assert refused(tmp_path / "nowhere", tiny_model).endswith("nowhere: not a folder")


def test_config_must_be_a_json_object(release: Path, tiny_model: Path) -> None:
    (release / "config.json").write_text("[]")
    assert refused(release, tiny_model).endswith("config.json: holds a JSON list, not an object")
    (release / "config.json").unlink()
    assert refused(release, tiny_model).endswith("config.json: missing")


@pytest.mark.parametrize(("key", "value", "problem"), [
    ("model_type", "mistral", 'model_type is "mistral", the base model\'s is "llama"'),
    ("architectures", ["MistralForCausalLM"],
     'architectures is ["MistralForCausalLM"], the base model\'s is ["LlamaForCausalLM"]'),
    ("hidden_size", 256, "hidden_size is 256, the base model's is 128"),
    ("vocab_size", 8192, "vocab_size is 8192, the base model's is 4096"),
    ("tie_word_embeddings", False, "tie_word_embeddings is false, the base model's is true"),
    ("tie_word_embeddings", None, "tie_word_embeddings is missing, the base model's is true"),
    ("max_position_embeddings", 2048, "max_position_embeddings is 2048, the base model's is 65536"),
])  # fmt: skip
def test_config_must_match_the_base(release: Path, tiny_model: Path, key: str, value: Any, problem: str) -> None:
    edit_config(release, **{key: value})
    assert refused(release, tiny_model) == f"{release / 'config.json'}: {problem}"


def test_config_key_the_base_lacks_is_refused(release: Path, tiny_model: Path, tmp_path: Path) -> None:
    base = Path(shutil.copytree(tiny_model, tmp_path / "base"))
    edit_config(base, max_position_embeddings=None)
    assert refused(release, base).endswith("max_position_embeddings is 65536, the base model has none")


# ---- tokenizer --------------------------------------------------------------------------------


def test_changed_tokenizer_is_refused(release: Path, tiny_model: Path) -> None:
    with (release / "tokenizer.json").open("a") as f:
        f.write(" ")
    assert refused(release, tiny_model) == (
        f"{release / 'tokenizer.json'}: differs from the base model's (sha256); "
        "a weights release must keep the base model's tokenizer"
    )


@pytest.mark.parametrize("name", ["tokenizer_config.json", "chat_template.jinja"])
def test_missing_tokenizer_file_is_refused(release: Path, tiny_model: Path, name: str) -> None:
    (release / name).unlink()
    assert refused(release, tiny_model).startswith(f"{release / name}: missing; the base model has it")


def test_tokenizer_file_the_base_lacks_is_refused(release: Path, tiny_model: Path) -> None:
    (release / "special_tokens_map.json").write_text("{}")
    assert "special_tokens_map.json: is a tokenizer file the base model does not have" in refused(release, tiny_model)


# ---- weight files -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["pytorch_model.bin", "model.pt", "weights.pth"])
def test_pickled_weights_are_refused(release: Path, tiny_model: Path, name: str) -> None:
    torch.save({}, release / name)
    assert refused(release, tiny_model) == (
        f"{release / name}: only safetensors weights are accepted ({WEIGHTS} or {INDEX})"
    )


def test_missing_weights_are_refused(release: Path, tiny_model: Path) -> None:
    (release / WEIGHTS).unlink()
    assert refused(release, tiny_model) == f"{release / WEIGHTS}: missing (and there is no {INDEX} either)"


def test_truncated_safetensors_is_refused(release: Path, tiny_model: Path) -> None:
    path = release / WEIGHTS
    path.write_bytes(path.read_bytes()[:-100])
    assert f"{path}: file is truncated or half-written" in refused(release, tiny_model)


def test_garbage_header_is_refused(release: Path, tiny_model: Path) -> None:
    data = bytearray((release / WEIGHTS).read_bytes())
    data[8] = ord("!")
    (release / WEIGHTS).write_bytes(bytes(data))
    assert "header is not valid JSON" in refused(release, tiny_model)


def test_index_naming_a_missing_shard_is_refused(release: Path, tiny_model: Path) -> None:
    shard(release)
    second = release / "model-00002-of-00002.safetensors"
    second.unlink()
    assert refused(release, tiny_model) == f"{second}: missing (listed in {INDEX})"


def test_index_naming_the_wrong_shard_is_refused(release: Path, tiny_model: Path) -> None:
    weight_map = shard(release)
    first = sorted(weight_map)[0]
    weight_map[first] = "model-00002-of-00002.safetensors"
    (release / INDEX).write_text(json.dumps({"weight_map": weight_map}))
    assert refused(release, tiny_model) == (
        f"{release / 'model-00001-of-00002.safetensors'}: holds tensor {first!r}, "
        f"but {INDEX} maps it to model-00002-of-00002.safetensors"
    )


def test_index_naming_a_tensor_no_shard_holds_is_refused(release: Path, tiny_model: Path) -> None:
    weight_map = shard(release)
    weight_map["lm_head.weight"] = "model-00001-of-00002.safetensors"
    (release / INDEX).write_text(json.dumps({"weight_map": weight_map}))
    assert refused(release, tiny_model) == (
        f"{release / INDEX}: maps tensor 'lm_head.weight' to model-00001-of-00002.safetensors, which does not hold it"
    )


def test_index_naming_a_file_outside_the_folder_is_refused(release: Path, tiny_model: Path) -> None:
    weight_map = shard(release)
    (release / INDEX).write_text(json.dumps({"weight_map": dict.fromkeys(weight_map, "../tiny/model.safetensors")}))
    assert "weight_map names shard '../tiny/model.safetensors', not a *.safetensors file of this folder" in refused(
        release, tiny_model
    )


def test_safetensors_beside_the_index_is_refused(release: Path, tiny_model: Path) -> None:
    shutil.copy(tiny_model / WEIGHTS, release / "extra.safetensors")
    assert refused(release, tiny_model) == (
        f"{release / 'extra.safetensors'}: is a second weights file beside {WEIGHTS}; "
        "engines differ on whether they load it"
    )
    shard(release)
    assert f"extra.safetensors: is not listed in {INDEX}" in refused(release, tiny_model)


# ---- tensors ----------------------------------------------------------------------------------


def test_missing_tensor_is_refused(release: Path, tiny_model: Path) -> None:
    edit_tensors(release, lambda t: t.pop("model.norm.weight"))
    assert refused(release, tiny_model) == (
        f"{release / WEIGHTS}: tensors differ from the base model's: missing 'model.norm.weight'"
    )


def test_extra_tensor_is_refused(release: Path, tiny_model: Path) -> None:
    """The tiny model ties lm_head to the embeddings: a separate lm_head.weight is not the base's layout."""
    edit_tensors(release, lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"].clone()}))
    assert refused(release, tiny_model).endswith("tensors differ from the base model's: extra 'lm_head.weight'")


def test_many_missing_tensors_are_listed_up_to_five(release: Path, tiny_model: Path) -> None:
    def drop_layer(tensors: dict[str, torch.Tensor]) -> None:
        for name in [n for n in tensors if n.startswith("model.layers.1.")]:
            del tensors[name]
        tensors["model.extra.weight"] = torch.zeros(3)

    edit_tensors(release, drop_layer)
    problem = refused(release, tiny_model).split(": ", 1)[1]
    assert problem.startswith("tensors differ from the base model's: missing 'model.layers.1.input_layernorm.weight', ")
    assert problem.endswith(" and 4 more; extra 'model.extra.weight'")


def test_sharded_missing_tensor_names_the_index(release: Path, tiny_model: Path) -> None:
    weight_map = shard(release)
    shard_file = release / weight_map["model.norm.weight"]
    tensors = load_file(shard_file)
    del tensors["model.norm.weight"], weight_map["model.norm.weight"]
    save_file(tensors, shard_file, metadata={"format": "pt"})
    (release / INDEX).write_text(json.dumps({"weight_map": weight_map}))
    assert refused(release, tiny_model).startswith(f"{release / INDEX}: tensors differ from the base model's: missing")


def test_wrong_shape_is_refused(release: Path, tiny_model: Path) -> None:
    edit_tensors(release, lambda t: t.update({UP_PROJ: torch.zeros(128, 128)}))
    assert refused(release, tiny_model) == (
        f"{release / WEIGHTS}: tensor {UP_PROJ!r} has shape (128, 128), the base model's is (256, 128)"
    )


def test_integer_tensor_is_refused(release: Path, tiny_model: Path) -> None:
    edit_tensors(release, lambda t: t.update({UP_PROJ: t[UP_PROJ].to(torch.int32)}))
    assert refused(release, tiny_model) == (
        f"{release / WEIGHTS}: tensor {UP_PROJ!r} is I32; weights must be one of ('F32', 'F16', 'BF16')"
    )


@pytest.mark.parametrize(("dtype", "value"), [
    (torch.float32, float("nan")), (torch.float32, float("inf")),
    (torch.bfloat16, float("-inf")), (torch.float16, float("nan")),
])  # fmt: skip
def test_non_finite_value_is_refused(release: Path, tiny_model: Path, dtype: torch.dtype, value: float) -> None:
    def poison(tensors: dict[str, torch.Tensor]) -> None:
        tensors.update({k: v.to(dtype) for k, v in tensors.items()})
        tensors[UP_PROJ].view(-1)[4097] = value

    edit_tensors(release, poison)
    assert refused(release, tiny_model) == (
        f"{release / WEIGHTS}: tensor {UP_PROJ!r} holds a non-finite value (NaN or inf) at element 4097"
    )


def test_non_finite_value_in_a_shard_names_the_shard(release: Path, tiny_model: Path) -> None:
    weight_map = shard(release)
    path = release / weight_map[UP_PROJ]
    tensors = load_file(path)
    tensors[UP_PROJ][1, 2] = float("nan")
    save_file(tensors, path, metadata={"format": "pt"})
    assert refused(release, tiny_model) == (
        f"{path}: tensor {UP_PROJ!r} holds a non-finite value (NaN or inf) at element 130"
    )


def test_the_objective_folder_of_a_trained_candidate_is_allowed(release: Path, tiny_model: Path) -> None:
    """A trainer writes its objective's state (a critic) into objective/, which engines never read."""
    (release / "objective").mkdir()
    (release / "objective" / "critic.safetensors").write_bytes(b"\0" * 16)
    assert check_weights(release, tiny_model) == []
    (release / "objective" / "deeper").mkdir()
    assert "deeper: is not a regular file" in refused(release, tiny_model)
