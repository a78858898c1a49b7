"""`recipe.backend: slime`: weight jobs trained by slime (Megatron-LM on Ray) as Ray jobs: the batch as slime's
rollout dump, slime's train.py arguments from the scenario, its last HF checkpoint as a full-weights candidate
(docs/engines.md). Knows slime's arguments and formats; imports neither ray nor torch.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import shlex
import urllib.parse
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from reefd.grow.backends import Event
from reefd.grow.backends.ray_jobs import RayConfig, RayJobs, zip_files

HELPER = Path(__file__).resolve().parents[2] / "train" / "slime_batch.py"
ROLLOUT_FILE = "rollout.pt"
# The recipe objective -> slime's --advantage-estimator (slime/utils/arguments.py). SAO's advantage is
# reward - V(critic): slime's ppo trains a critic beside the actor.
ESTIMATORS = {"recipes.sao.objective:SAOObjective": "ppo", "recipes.sao.objective:GRPOObjective": "grpo"}


class SlimeError(ValueError):
    """The job cannot be expressed as a slime run; str() says what to set."""


@dataclass
class SlimeConfig(RayConfig):
    """slime: the Ray cluster (as for ray), where slime is on its nodes, and how it runs there."""

    kind: ClassVar[str] = "slime"
    model: str = field(default="", metadata={"description": "The Megatron model-shape arguments: slime's "
                                                            "scripts/models/<model>.sh (e.g. qwen3-4B), which defines "
                                                            "MODEL_ARGS."})
    path: str = field(default="/root/slime", metadata={"description": "slime's checkout on the cluster's nodes "
                                                                      "(its Docker image has it at /root/slime)."})
    python: str = field(default="python3", metadata={"description": "The cluster's Python that has slime."})
    megatron_path: str = field(default="/root/Megatron-LM",
                               metadata={"description": "Megatron-LM's checkout, put on PYTHONPATH as slime's "
                                                        "scripts do (empty: none)."})
    actor_num_nodes: int = field(default=1, metadata={"minimum": 1, "maximum": 4096})
    actor_num_gpus_per_node: int = field(default=8, metadata={"minimum": 1, "maximum": 64})
    push: bool = field(default=False,
                       metadata={"description": "slime pushes the weights of every step to an engine reefd launches "
                                                "for the job (outside the router), where the gate then judges them; "
                                                "slime then runs on reefd's machine (a Ray head on localhost)."})
    args: dict[str, Any] = field(default_factory=dict,
                                 metadata={"description": "More slime or Megatron arguments, without their "
                                                          "dashes ({tensor-model-parallel-size: 2}); true is a "
                                                          "bare flag, null drops one reefd would pass."})

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.model:
            raise SlimeError("recipe.backend.model: name slime's model script (scripts/models/<model>.sh), "
                             "e.g. qwen3-4B")
        address = str(self.address)
        host = urllib.parse.urlsplit(address if "//" in address else f"//{address}").hostname or ""
        with contextlib.suppress(ValueError):  # a name, not an IP address
            host = "localhost" if ipaddress.ip_address(host).is_loopback else host
        if self.push and host.lower() != "localhost":
            raise SlimeError("recipe.backend.push: the engine reefd launches for slime to push to listens on "
                             f"127.0.0.1, so slime must run on reefd's machine (a Ray head on localhost, not {host})")


def rollout_sizes(samples: list[dict[str, Any]]) -> tuple[int, int]:
    """(--rollout-batch-size, --n-samples-per-prompt): groups of one size make prompts of that many samples;
    anything else is one sample per prompt (slime then normalises over the whole batch)."""
    per = set(Counter(str(s.get("group")) for s in samples).values())
    k = per.pop() if len(per) == 1 else 1
    return len(samples) // k, k


def ordered(samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The samples with each group's adjacent, groups in order of first appearance."""
    first: dict[str, int] = {}
    for i, s in enumerate(samples):
        first.setdefault(str(s.get("group")), i)
    return sorted(samples, key=lambda s: first[str(s.get("group"))])


def slime_sample(s: dict[str, Any], index: int, group_index: int) -> dict[str, Any]:
    """One rollout as slime's Sample.to_dict() (slime/utils/types.py): the record's tokens, unchanged."""
    completion = list(s["completion_ids"])
    logprobs = s.get("logprobs") or []
    return {"index": index, "group_index": group_index, "tokens": list(s["prompt_ids"]) + completion,
            "response_length": len(completion), "loss_mask": [1] * len(completion), "reward": float(s["reward"]),
            "status": "completed",
            "rollout_log_probs": [float(x) if x is not None else 0.0 for x in logprobs]
            if len(logprobs) == len(completion) else None,
            "metadata": {"reef_receipt": s.get("receipt"), "reef_group": s.get("group")}}


def batch_lines(doc: dict[str, Any]) -> str:
    """The spec's samples as batch.jsonl, groups adjacent."""
    groups: dict[str, int] = {}
    lines = []
    for i, s in enumerate(ordered(doc["samples"])):
        g = groups.setdefault(str(s.get("group")), len(groups))
        lines.append(json.dumps(slime_sample(s, i, g), allow_nan=False))
    return "\n".join(lines) + "\n"


def slime_args(doc: dict[str, Any], settings: SlimeConfig, work: Path) -> list[str]:
    """slime's train.py arguments for the spec `doc` (a reefd.train spec), without MODEL_ARGS."""
    if doc.get("init_adapter"):
        raise SlimeError("slime trains full weights, and the serving release has a LoRA adapter: publish its "
                         "merged weights (reefctl publish --weights) before training with slime")
    objective = doc["objective"]
    estimator = settings.args.get("advantage-estimator") or ESTIMATORS.get(objective)
    if estimator is None:
        raise SlimeError(f"slime has no advantage estimator for the objective {objective}; set "
                         "recipe.backend.args.advantage-estimator (grpo, gspo, cispo, reinforce_plus_plus, "
                         "reinforce_plus_plus_baseline or ppo)")
    samples, optim, settings_ = doc["samples"], doc["optim"], doc.get("settings") or {}
    n = len(samples)
    rollout_batch, per_prompt = rollout_sizes(samples)
    micro = int(optim.get("micro_batch") or n)
    args: dict[str, Any] = {
        "train-backend": "megatron",
        "actor-num-nodes": settings.actor_num_nodes,
        "actor-num-gpus-per-node": settings.actor_num_gpus_per_node,
        # the served weights: slime's tokenizer and HF assets, and the actor's and reference's start
        "hf-checkpoint": doc["base_model"],
        "ref-load": doc["base_model"],
        "save": str(work / "slime" / "megatron"),
        "save-interval": 1,
        "no-save-optim": True,
        "save-hf": str(work / "slime" / "hf" / "rollout_{rollout_id}"),
        # the batch, as slime's own rollout dump: train-only, no engine of slime's, no weight push before the gate
        "load-debug-rollout-data": str(work / "slime" / ROLLOUT_FILE),
        "num-rollout": int(optim.get("epochs") or 1),  # one pass over the batch per rollout step (pushed_version)
        "rollout-batch-size": rollout_batch,
        "n-samples-per-prompt": per_prompt,
        "global-batch-size": micro if n % micro == 0 else n,
        "advantage-estimator": estimator,
        "optimizer": "adam",
        "lr": optim["lr"],
        "lr-decay-style": "constant",
        "weight-decay": optim.get("weight_decay", 0.0),
        "adam-beta1": optim.get("beta1", 0.9),
        "adam-beta2": optim.get("beta2", 0.999),
        "clip-grad": optim.get("max_grad_norm", 1.0),
        "seed": doc.get("seed", 0),
    }
    if settings.push:  # the same batch through slime's forge loader: its engines stay, and weights are pushed
        engines = doc.get("engines") or []
        if not engines:
            raise SlimeError("recipe.backend.push: reefd gave the job no engine to push to")
        args.pop("load-debug-rollout-data")
        args.update({"rollout-function-path": "slime.rollout.forge_load.generate_rollout",
                     "load-forge-rollout-data": str(work / "slime" / ROLLOUT_FILE),
                     "rollout-external-engine-addrs": list(engines),
                     # over the filesystem reefd and the cluster share: the engine needs no NCCL group
                     "update-weight-transport": "disk", "update-weight-disk-dir": str(work / "slime" / "push")})
    if any(s.get("stale") for s in samples):  # kept past max_staleness: slime's truncated importance sampling
        args.update({"use-tis": True, "tis-clip": settings_.get("stale_clip", 2.0)})
    if "eps_low" in settings_:  # SAO's ratio band [1 - eps_low, 1 + eps_high] is slime's PPO clip range
        args["eps-clip"] = settings_["eps_low"]
        args["eps-clip-high"] = settings_.get("eps_high", settings_["eps_low"])
    args.update(settings.args)
    for kept in ("num-rollout", "save-hf", "save", "save-interval"):  # reefd reads the checkpoint back by them
        if args.get(kept) in (None, False):
            raise SlimeError(f"recipe.backend.args: --{kept} cannot be dropped: reefd finds slime's checkpoint by it")
    argv: list[str] = []
    for key, value in args.items():
        if value is None or value is False:
            continue
        argv.append(f"--{key}")
        if value is not True:
            argv.extend(str(v) for v in value) if isinstance(value, list) else argv.append(str(value))
    return argv


class SlimeJobs(RayJobs):
    """Weight jobs as slime runs on a Ray cluster (`Class(work_dir, max_jobs, SlimeConfig)`)."""

    Config = SlimeConfig
    full_weights = True  # a job's candidate is a full HF model folder, whatever the recipe's target

    def __init__(self, work_dir: Path, max_jobs: int, cfg: SlimeConfig) -> None:
        super().__init__(work_dir, max_jobs, cfg)
        self.settings = cfg
        self.pushes = cfg.push  # the runner launches an engine for the job, named in the spec's `engines`
        # the engine slime pushes to lives with reefd: a job that outlives reefd would push to nothing
        self.detachable = not self.pushes

    def pushed_version(self, doc: dict[str, Any]) -> str:
        """The weight_version slime's last push gives the engine: it counts pushes from 1, one before training
        (train.py's first update_weights) and one after each rollout step."""
        return str(int(self.settings.args.get("num-rollout") or doc["optim"].get("epochs") or 1) + 1)

    async def run(self, spec: Path, on_event: Callable[[Event], None], timeout_s: float) -> int:
        try:  # what cannot be a slime run fails here, with the reason, before anything reaches the cluster
            doc = json.loads(await asyncio.to_thread(Path(spec).read_text))
            slime_args(doc, self.settings, Path(spec).parent)
        except SlimeError as exc:
            on_event({"event": "error", "reason": str(exc)})
            return 2
        return await super().run(spec, on_event, timeout_s)

    def package(self, spec: Path) -> bytes:
        """The working_dir: the spec (the job's record of what it trained), batch.jsonl and reef_slime.py."""
        doc = json.loads(Path(spec).read_text())
        return zip_files({"spec.json": Path(spec).read_bytes(), "batch.jsonl": batch_lines(doc).encode(),
                          "reef_slime.py": HELPER.read_bytes()})

    def entrypoint(self, spec: Path) -> str:
        """bash: the rollout file, slime's train.py with the model's MODEL_ARGS, then the checkpoint moved to the
        spec's output folder."""
        doc = json.loads(Path(spec).read_text())
        s, work = self.settings, Path(spec).parent
        q = shlex.quote
        argv = slime_args(doc, s, work)
        args, num_rollout, save_hf = " ".join(q(a) for a in argv), _arg(argv, "--num-rollout"), _arg(argv, "--save-hf")
        py = q(s.python)
        path = f"PYTHONPATH={q(s.megatron_path)}${{PYTHONPATH:+:$PYTHONPATH}} " if s.megatron_path else ""
        script = (
            "set -e\n"
            f"{py} reef_slime.py prepare batch.jsonl {q(str(work / 'slime' / ROLLOUT_FILE))} "
            f"--num-rollout {q(num_rollout)}\n"
            f". {q(s.path + '/scripts/models/' + s.model + '.sh')}\n"
            f'{path}{py} {q(s.path + "/train.py")} "${{MODEL_ARGS[@]}}" {args}\n'
            f"{py} reef_slime.py finish {q(save_hf)} --num-rollout {q(num_rollout)} "
            f"--out {q(str(doc['output_dir']))}\n")
        return f"exec bash -c {q(script)}"


def _arg(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]
