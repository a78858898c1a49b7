"""`backend: slime`, its contract without a cluster: the train.py arguments reefd builds from a scenario, checked
by the stand-in's copy of slime's argument table and validation (tests/fixtures/slime/train.py), and the batch
export, read back as slime reads its rollout dumps. The end-to-end run on a Ray head is tests/e2e/test_slime.py."""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import io
import json
import shlex
import subprocess
import zipfile
from pathlib import Path
from typing import Any

import pytest

from reefd import config
from reefd.grow.backends.slime import SlimeConfig, SlimeError, SlimeJobs, batch_lines, slime_args
from reefd.train import slime_batch
from tests.conftest import make_scenarios

pytestmark = pytest.mark.contract

STANDIN = Path(__file__).parent / "fixtures" / "slime"
SAO, GRPO = "recipes.sao.objective:SAOObjective", "recipes.sao.objective:GRPOObjective"


def standin() -> Any:
    spec = importlib.util.spec_from_file_location("slime_standin", STANDIN / "train.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def model_args() -> list[str]:
    """MODEL_ARGS as bash expands them from the model script, as the job's entrypoint does."""
    out = subprocess.run(["bash", "-c", f'. {STANDIN}/scripts/models/tiny.sh; printf "%s\\n" "${{MODEL_ARGS[@]}}"'],
                         capture_output=True, text=True, check=True)
    return out.stdout.split()


def spec(tiny_model: Path, tmp_path: Path, objective: str = SAO, groups: tuple[str, ...] = ("a", "b", "c", "d"),
         **optim: Any) -> dict[str, Any]:
    samples = [{"receipt": f"r{i}", "prompt_ids": [11, 12, 13], "completion_ids": [40 + i, 50 + i],
                "logprobs": [-1.5, None], "reward": float(i % 2), "group": g, "reports": [f"p{i}"]}
               for i, g in enumerate(groups)]
    return {"job": "j-1", "objective": objective, "settings": {"eps_low": 0.3, "eps_high": 5.0} if objective == SAO
            else {}, "seed": 3, "base_model": str(tiny_model), "init_adapter": None,
            "output_dir": str(tmp_path / "candidate"), "samples": samples, "target": "lora",
            "optim": {"lr": 5e-4, "weight_decay": 0.0, "epochs": 2, "micro_batch": 2, "max_grad_norm": 1.0, **optim}}


def slime_cfg(keys: dict[str, Any], address: str = "http://127.0.0.1:1") -> SlimeConfig:
    """`recipe.backend: {kind: slime, ...keys}` as its config."""
    return SlimeConfig(address=address, **keys)


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    mod = standin()
    args = mod.build_parser().parse_args(argv + model_args())
    return args, mod.validate(args)


def test_sao_maps_to_slime_arguments_that_slime_accepts(tiny_model: Path, tmp_path: Path) -> None:
    settings = slime_cfg({"model": "tiny", "actor_num_gpus_per_node": 2})
    argv = slime_args(spec(tiny_model, tmp_path), settings, tmp_path)
    args, problems = parse(argv)
    assert problems == []
    assert (args.train_backend, args.advantage_estimator) == ("megatron", "ppo")  # SAO: reward - V(critic)
    assert (args.actor_num_nodes, args.actor_num_gpus_per_node) == (1, 2)
    assert args.hf_checkpoint == args.ref_load == str(tiny_model) and args.load is None  # slime loads HF dirs
    assert (args.rollout_batch_size, args.n_samples_per_prompt, args.global_batch_size) == (4, 1, 2)
    assert args.num_rollout == 2  # one rollout step per pass over the batch
    assert args.save_hf == str(tmp_path / "slime" / "hf" / "rollout_{rollout_id}") and args.save_interval == 1
    assert args.load_debug_rollout_data == str(tmp_path / "slime" / "rollout.pt") and args.debug_train_only
    assert args.rollout_external_engine_addrs is None  # train-only: no engine, no push before the gate
    assert (args.lr, args.clip_grad, args.seed, args.eps_clip, args.eps_clip_high) == (5e-4, 1.0, 3, 0.3, 5.0)
    assert (args.optimizer, args.lr_decay_style) == ("adam", "constant")


def test_stale_samples_turn_on_slimes_truncated_importance_sampling(tiny_model: Path, tmp_path: Path) -> None:
    settings = slime_cfg({"model": "tiny"})
    doc = spec(tiny_model, tmp_path)
    args, problems = parse(slime_args(doc, settings, tmp_path))
    assert problems == [] and not args.use_tis  # every sample fresh
    doc["samples"][1]["stale"] = True
    doc["settings"]["stale_clip"] = 1.5
    args, problems = parse(slime_args(doc, settings, tmp_path))
    assert problems == [] and args.use_tis and args.tis_clip == 1.5


def test_groups_become_prompts_of_n_samples(tiny_model: Path, tmp_path: Path) -> None:
    settings = slime_cfg({"model": "tiny"})
    doc = spec(tiny_model, tmp_path, GRPO, groups=("x", "y", "x", "y"))
    args, problems = parse(slime_args(doc, settings, tmp_path))
    assert problems == [] and args.advantage_estimator == "grpo"
    assert (args.rollout_batch_size, args.n_samples_per_prompt) == (2, 2)
    # the batch: each group's samples adjacent, as slime's (-1, n_samples_per_prompt) reshape needs
    lines = [json.loads(line) for line in batch_lines(doc).splitlines()]
    assert [s["metadata"]["reef_receipt"] for s in lines] == ["r0", "r2", "r1", "r3"]
    assert [s["group_index"] for s in lines] == [0, 0, 1, 1]
    first = lines[0]
    assert first["tokens"] == [11, 12, 13, 40, 50] and first["response_length"] == 2
    assert first["loss_mask"] == [1, 1] and first["reward"] == 0.0 and first["status"] == "completed"
    assert first["rollout_log_probs"] == [-1.5, 0.0]
    # uneven groups: one sample per prompt, normalised over the whole batch
    uneven = spec(tiny_model, tmp_path, GRPO, groups=("x", "x", "x", "y"))
    args, problems = parse(slime_args(uneven, settings, tmp_path))
    assert problems == [] and (args.rollout_batch_size, args.n_samples_per_prompt) == (4, 1)


def test_the_batch_file_is_what_slime_loads(tiny_model: Path, tmp_path: Path) -> None:
    doc = spec(tiny_model, tmp_path, GRPO, groups=("x", "y", "x", "y"))
    (tmp_path / "batch.jsonl").write_text(batch_lines(doc))
    assert slime_batch.main(["prepare", str(tmp_path / "batch.jsonl"), str(tmp_path / "rollout.pt"),
                             "--num-rollout", "1"]) == 0
    import torch

    samples = torch.load(tmp_path / "rollout.pt", weights_only=False)["samples"]  # rollout_data_utils.py:124-137
    args, _ = parse(slime_args(doc, slime_cfg({"model": "tiny"}), tmp_path))
    assert standin().check_samples(samples, args) == []
    broken = [dict(samples[0], loss_mask=[1]), *samples[1:]]
    assert standin().check_samples(broken, args) == ["sample 0: loss_mask length 1 != response_length 2"]


def test_push_sends_the_batch_through_the_forge_loader_to_reefds_engine(tiny_model: Path, tmp_path: Path) -> None:
    settings = slime_cfg({"model": "tiny", "push": True})
    doc = spec(tiny_model, tmp_path)
    with pytest.raises(SlimeError, match="reefd gave the job no engine to push to"):
        slime_args(doc, settings, tmp_path)
    args, problems = parse(slime_args({**doc, "engines": ["127.0.0.1:30001"]}, settings, tmp_path))
    assert problems == [] and not args.debug_train_only and args.load_debug_rollout_data is None
    assert args.rollout_function_path == "slime.rollout.forge_load.generate_rollout"
    assert args.load_forge_rollout_data == str(tmp_path / "slime" / "rollout.pt")
    assert args.rollout_external_engine_addrs == ["127.0.0.1:30001"] and args.sglang_router_ip is None
    assert (args.update_weight_transport, args.update_weight_disk_dir) == ("disk", str(tmp_path / "slime" / "push"))
    jobs = SlimeJobs(tmp_path, 1, slime_cfg({"model": "tiny", "push": True}))
    assert jobs.pushed_version(doc) == "3"  # one push before training, one per rollout step (2)
    assert jobs.detachable is False  # its engine lives with reefd: the job does not outlive it


def test_scenario_args_win_and_null_drops_one(tiny_model: Path, tmp_path: Path) -> None:
    settings = slime_cfg({"model": "tiny", "args": {"tensor-model-parallel-size": 2, "colocate": True,
                                                              "eps-clip-high": None, "lr": 1e-6}})
    args, problems = parse(slime_args(spec(tiny_model, tmp_path), settings, tmp_path))
    assert problems == [] and args.tensor_model_parallel_size == 2 and args.colocate
    assert args.eps_clip_high is None and args.lr == 1e-6
    drop = slime_cfg({"model": "tiny", "args": {"save-hf": None}})
    with pytest.raises(SlimeError, match="--save-hf cannot be dropped: reefd finds slime's checkpoint by it"):
        slime_args(spec(tiny_model, tmp_path), drop, tmp_path)


def test_the_stand_in_fails_what_slime_would(tiny_model: Path, tmp_path: Path) -> None:
    """The contract can fail: slime's own checks, as the stand-in runs them."""
    settings = slime_cfg({"model": "tiny", "args": {"save-hf": str(tmp_path / "hf"),
                                                              "advantage-estimator": "reinforce_plus_plus"}})
    _, problems = parse(slime_args(spec(tiny_model, tmp_path), settings, tmp_path))
    assert problems == ["reinforce_plus_plus needs --normalize-advantages",
                        "--save-hf has no {rollout_id}: every save overwrites the last"]
    with pytest.raises(SystemExit):  # an argument slime does not define
        standin().build_parser().parse_args(["--rollout-batch-size", "4", "--rollout-batchsize", "4"])
    wrong = [a if a != "128" else "256" for a in model_args()]  # --hidden-size against config.json
    mod = standin()
    args = mod.build_parser().parse_args(slime_args(spec(tiny_model, tmp_path), slime_cfg(
        {"model": "tiny"}), tmp_path) + wrong)
    assert mod.validate(args) == ["hidden_size in hf config 128 is not equal to hidden_size 256, please check "
                                  "the config."]


def test_settings_and_objectives_without_a_slime_counterpart(tiny_model: Path, tmp_path: Path) -> None:
    with pytest.raises(SlimeError, match=r"recipe\.backend\.model: name slime's model script"):
        SlimeConfig(address="http://127.0.0.1:1")
    with pytest.raises(SlimeError, match="slime has no advantage estimator for the objective x:Y"):
        slime_args(spec(tiny_model, tmp_path, "x:Y"), slime_cfg({"model": "tiny"}), tmp_path)


def test_a_job_slime_cannot_run_fails_before_reaching_the_cluster(tiny_model: Path, tmp_path: Path) -> None:
    (tmp_path / "spec.json").write_text(json.dumps(spec(tiny_model, tmp_path, "x:Y")))
    jobs = SlimeJobs(tmp_path, 1, slime_cfg({"model": "tiny"}, "http://127.0.0.1:9"))  # nothing listens there
    events: list[dict[str, Any]] = []
    assert asyncio.run(jobs.run(tmp_path / "spec.json", events.append, 10)) == 2
    assert events == [{"event": "error", "reason": "slime has no advantage estimator for the objective x:Y; set "
                       "recipe.backend.args.advantage-estimator (grpo, gspo, cispo, reinforce_plus_plus, "
                       "reinforce_plus_plus_baseline or ppo)"}]


def test_the_entrypoint_runs_prepare_train_finish(tiny_model: Path, tmp_path: Path) -> None:
    doc = spec(tiny_model, tmp_path)
    (tmp_path / "spec.json").write_text(json.dumps(doc))
    jobs = SlimeJobs(tmp_path, 1, slime_cfg({"model": "tiny", "path": "/opt/slime", "python": "/usr/bin/python3"}))
    cmd = jobs.entrypoint(tmp_path / "spec.json")
    assert cmd.startswith("exec bash -c ")
    lines = shlex.split(cmd)[3].strip().splitlines()
    assert lines[0] == "set -e"
    assert lines[1] == f"/usr/bin/python3 reef_slime.py prepare batch.jsonl {tmp_path}/slime/rollout.pt --num-rollout 2"
    assert lines[2] == ". /opt/slime/scripts/models/tiny.sh"
    # the model script's arguments first: the scenario's (reefd's, then recipe.backend.args) come last and win
    assert lines[3].startswith("PYTHONPATH=/root/Megatron-LM${PYTHONPATH:+:$PYTHONPATH} /usr/bin/python3 "
                               '/opt/slime/train.py "${MODEL_ARGS[@]}" --train-backend megatron ')
    assert shlex.split(lines[4]) == ["/usr/bin/python3", "reef_slime.py", "finish",
                                     f"{tmp_path}/slime/hf/rollout_{{rollout_id}}", "--num-rollout", "2",
                                     "--out", f"{tmp_path}/candidate"]
    with zipfile.ZipFile(io.BytesIO(jobs.package(tmp_path / "spec.json"))) as z:
        assert sorted(z.namelist()) == ["batch.jsonl", "reef_slime.py", "spec.json"]
    assert jobs.package(tmp_path / "spec.json") == jobs.package(tmp_path / "spec.json")  # content-addressed


def test_a_scenario_asking_for_slime_is_checked_at_load(tmp_path: Path) -> None:
    head = "defaults:\n  - model: tiny\n  - recipe: sao\n  - _self_\nrecipe:\n  backend:\n    kind: slime\n" \
           "    address: http://127.0.0.1:8265\n"
    scen = make_scenarios(tmp_path / "s", names=(), extra={
        "bad": head + "    path: /opt/slime\n", "good": head + "    model: qwen3-4B\n",
        "gpus": head + "    model: qwen3-4B\n    resources: {num_gpus: one}\n",
        "typo": head + "    model: qwen3-4B\n    gpus: 8\n",
        "push": head.replace("127.0.0.1", "gpu-head") + "    model: qwen3-4B\n    push: true\n"})
    with pytest.raises(config.ConfigError, match=r"recipe\.backend\.model: name slime's model script"):
        config.compose(scen / "bad.yaml")
    with pytest.raises(config.ConfigError, match=r"recipe\.backend\.resources\.num_gpus: 'one' is not a number >= 0"):
        config.compose(scen / "gpus.yaml")
    with pytest.raises(config.ConfigError, match=r"recipe\.backend: Additional properties are not allowed \('gpus'"):
        config.compose(scen / "typo.yaml")
    assert config.compose(scen / "good.yaml").recipe.backend == {"kind": "slime", "address": "http://127.0.0.1:8265",
                                                                 "model": "qwen3-4B"}
    with pytest.raises(config.ConfigError, match=r"recipe\.backend\.push: .* slime must run on reefd's machine \(a "
                                                 r"Ray head on localhost, not gpu-head\)"):
        config.compose(scen / "push.yaml")
