"""Plug points by name: a YAML name from a registry table, or a `pkg.mod:Name` dotted path to a user's own.

Engines (`model.engine`), gates (`gate.kind`), trainer backends (`recipe.backend`) and recipes (`recipe.name`)
each keep a table of their shipped names here; their modules hold the Protocol a plug-in implements.
Knows nothing about what the plug-ins do.
"""

from __future__ import annotations

import importlib
import re
from typing import Any

ENGINES = {"worker": "reefd.engines.sglang:WorkerEngine", "sglang": "reefd.engines.sglang:SGLangEngine",
           "vllm": "reefd.engines.vllm:VLLMEngine", "upstream": "reefd.engines.upstream:UpstreamEngine"}
GATES = {"always": "reefd.commit.gates.kinds:Always", "holdout": "reefd.commit.gates.kinds:Holdout",
         "floor": "reefd.commit.gates.kinds:Floor", "paired": "reefd.commit.gates.kinds:Paired"}
BACKENDS = {"local": "reefd.grow.backends.local:LocalTrainers", "ray": "reefd.grow.backends.ray_jobs:RayJobs",
            "slime": "reefd.grow.backends.slime:SlimeJobs"}
RECIPES = {"record": "reefd.grow.recipes:RecordOnly", "sao": "recipes.sao.recipe:SAO",
           "grpo": "recipes.sao.recipe:GRPO",
           "skillclaw": "recipes.skillclaw.recipe:SkillClaw", "openclaw-rl": "recipes.openclaw_rl.recipe:OpenClawRL",
           "ttt-discover": "recipes.ttt_discover.recipe:TTTDiscover", "gepa": "recipes.gepa.recipe:GEPA",
           "composite": "recipes.composite.recipe:Composite"}

DOTTED = r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$"
_DOTTED_RE = re.compile(DOTTED)


class PluginError(ValueError):
    """A name that is neither shipped nor an importable dotted path; str() is one line."""


def is_dotted(name: str) -> bool:
    return bool(_DOTTED_RE.fullmatch(name))


def name_schema(table: dict[str, str], description: str) -> dict[str, Any]:
    """The JSON Schema of a plug-in name: one of the table's names, or a dotted path."""
    return {"anyOf": [{"enum": list(table)}, {"type": "string", "pattern": DOTTED}], "description": description}


def resolve(table: dict[str, str], name: str, what: str) -> Any:
    """The object a shipped name or a `pkg.mod:Name` path names; PluginError (saying `what` it looked for)
    otherwise."""
    path = table.get(name, name)
    if not isinstance(path, str) or not is_dotted(path):
        raise PluginError(f"unknown {what} {name!r}: use one of {', '.join(sorted(table))} or pkg.mod:Class")
    module_name, _, attr = path.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except Exception as exc:  # ImportError, AttributeError, or whatever the module raises while it loads
        raise PluginError(f"{what} {name!r} cannot be imported: {' '.join(str(exc).split())}") from None
    return obj


def missing(protocol: type, cls: Any, instance_attrs: tuple[str, ...] = ()) -> list[str]:
    """The members of the Protocol `protocol` that the class `cls` lacks, apart from `instance_attrs` (set by
    its constructor): a plug-in is checked against its Protocol when it is loaded, not when first used."""
    members = {n for n in vars(protocol) if not n.startswith("_")} | set(protocol.__annotations__)
    return sorted(m for m in members - set(instance_attrs) if not hasattr(cls, m))
