"""House rules that check themselves: the daemon never loads torch, the import graph (type-only imports included)
has no circles and follows the table of what each stage may import, the generic trainer imports no recipe, and every
write to the release chain goes through its one commit function. (`make lint` also bans torch, transformers and peft
imports on the daemon side: ruff's TID251.)"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

from tests.conftest import ROOT

TORCH_SIDE = ("reefd.worker", "reefd.train.__main__", "reefd.train.training", "reefd.train.batch",
              "reefd.train.objective", "reefd.train.slime_batch", "reefd.train.fingerprint", "reefd.train.prefix",
              "reefd.train.session", "reefd.train.losses")


def modules() -> dict[str, Path]:
    out = {}
    for top in ("reefd", "recipes"):
        for path in sorted((ROOT / top).rglob("*.py")):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = path
    return out


def imports(path: Path, name: str) -> set[str]:
    """Every module `path` imports, at module level, inside functions or under `if TYPE_CHECKING:` (a circle of
    type-only imports is still a circle for the reader)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            package = name if path.name == "__init__.py" else name.rpartition(".")[0]
            base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1]) if node.level else ""
            mod = ".".join(p for p in (base, node.module or "") if p)
            found |= {mod, *(f"{mod}.{a.name}" for a in node.names)}
    return found


def graph() -> dict[str, set[str]]:
    mods = modules()
    edges: dict[str, set[str]] = defaultdict(set)
    for name, path in mods.items():
        for target in imports(path, name):
            while target and target not in mods:
                target = target.rpartition(".")[0]
            if target and target != name and not name.startswith(target + "."):  # a package's own parents
                edges[name].add(target)
    return edges


def test_the_daemon_loads_no_torch() -> None:
    """Every daemon-side module imported, and the app built: not one torch, transformers, peft or ray module
    loaded."""
    daemon = sorted(m for m in modules() if m.startswith("reefd") and not m.startswith(TORCH_SIDE))
    code = (f"import importlib, sys, tempfile, pathlib\n"
            f"for m in {daemon!r}: importlib.import_module(m)\n"
            "from reefd.app import Settings, build_app\n"
            "build_app(Settings(state_dir=pathlib.Path(tempfile.mkdtemp()), tokens=['t' * 16]))\n"
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'transformers', 'peft', 'ray'}))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"the daemon loaded {out.stdout.strip()} ({len(daemon)} modules imported)"


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """One circle through each strongly connected part of the graph (Tarjan's algorithm), as a path from the part's
    first module back to it, shortest first."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    parts: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            part = {stack.pop()}
            while node not in part:
                part.add(stack.pop())
            if len(part) > 1:
                parts.append(part)

    for node in sorted(edges):
        if node not in index:
            visit(node)
    out = []
    for part in parts:
        start = min(part)
        paths, seen = [[start]], {start}
        while paths:  # breadth first inside the part: the shortest way back to `start`
            path = paths.pop(0)
            nxt = sorted(edges[path[-1]] & part)
            if start in nxt:
                out.append([*path, start])
                break
            paths += [[*path, n] for n in nxt if n not in seen]
            seen.update(nxt)
    return sorted(out, key=lambda c: (len(c), c))


def test_the_import_graph_has_no_circles() -> None:
    edges = graph()
    assert "reefd.loop" in edges and "reefd.grow.runner" in edges["reefd.loop"]  # the graph really was read
    assert "reefd.harness" in edges["reefd.grow.recipes"]  # and its type-only imports with it
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set()}) == [["a", "b", "c", "a"]]
    found = circles(edges)
    assert found == [], "import circles (move the value types or Protocols they share into a contract module " \
        "beside their stage):\n" + "\n".join(" -> ".join(c) for c in found)


# What each stage may import. A stage is a folder of reefd/ (api, serve, observe, …), a top-level module (config,
# loop, app, …), or recipes/ (the shipped plug-ins). An entry is a stage, or one module (`serve.chat`: a contract
# other stages use); a module may always import its own stage, and the packages above a module it may import.
# This is what the code does today, less the wrong-way edges below.
STAGE_IMPORTS: dict[str, set[str]] = {
    "reefd": set(), "schema": set(), "plugins": set(), "ops": set(),
    "harness": {"schema"},
    "cli": {"ops"},  # reefctl: an HTTP client (its token verbs share the token rules)
    "engines": {"schema", "plugins", "serve.chat"},  # the chat turn is the engine contract's request and answer
    "observe": {"ops", "config", "commit.chain_types"},  # retention reads the chain, jobs and registry by Protocol
    "commit": {"schema", "plugins", "ops", "config", "engines", "harness", "observe", "serve"},
    "serve": {"ops", "config", "engines", "harness", "observe", "commit", "grow.recipes"},
    "grow": {"schema", "plugins", "ops", "config", "engines", "harness", "observe", "serve", "commit"},
    "config": {"schema", "plugins", "moved_keys", "engines", "commit", "harness", "serve", "train.spec"},
    "moved_keys": set(),
    "api": {"ops", "config", "engines", "harness", "observe", "serve", "grow", "commit", "tinker"},
    "loop": {"ops", "config", "engines", "observe", "serve", "grow", "commit", "tinker"},
    "app": {"ops", "api", "loop"},
    "__main__": {"ops", "config", "loop", "app", "cli", "tinker.service"},
    # the processes beside reefd reuse its torch-free pieces; reefd never imports them
    "worker": {"engines", "serve.chat", "commit.adapters"},
    "train": {"ops", "plugins", "commit.weights", "worker"},
    # the Tinker API: a trainer session process per model, and the losses the trainer knows (train.loss_table)
    "tinker": {"ops", "engines", "observe", "train.loss_table"},
    # plug-ins import the contracts they implement, and nothing behind them
    "recipes": {"schema", "harness", "engines", "serve.chat", "grow.recipes", "grow.staleness", "grow.untrusted",
                "commit.gates.tasks", "train"},
}

# Wrong-way edges not removed yet (issue 45, point 2), each to go; an entry that no edge needs any more must go too.
KNOWN_EXCEPTIONS: dict[tuple[str, str], str] = {
    ("api", "loop"): "every route module takes its typed AppKeys from loop.py, the wiring; they belong in a small "
                     "module that loop.py and the routes both import",
    ("config", "grow.recipes"): "compose builds the recipe to check its params at load (recipes.build)",
    ("config", "grow.backends"): "the trainer backends' schema and registry, for `recipe.backend:` (json_schema, "
                                 "load)",
    ("config", "grow.practice"): "the `practice:` keys' dataclasses and their load-time check live in "
                                 "grow/practice/settings.py and verifiers.py",
    ("moved_keys", "grow.backends"): "config's moved-keys table asks the trainer backends for theirs (as config.py "
                                     "does for their schema)",
    ("ops", "api.errors"): "ops/auth.py's middleware answers 401/403 in each provider's error shape; it belongs "
                           "beside api/access.py",
}


def stage(module: str) -> str:
    parts = module.split(".")
    return "recipes" if parts[0] == "recipes" else parts[1] if len(parts) > 1 else "reefd"


def _within(module: str, entry: str) -> bool:
    """`module` (reefd/-relative) is `entry` (a stage or a module) or inside it."""
    return module == entry or module.startswith(entry + ".") or stage("reefd." + module) == entry


def _crossing() -> list[tuple[str, str]]:
    """Every import between two stages, as (importer, imported), each reefd/-relative."""
    edges, out = graph(), []
    for name, targets in edges.items():
        for target in targets:
            if target.startswith(("reefd.", "recipes.")) and stage(target) != stage(name):
                out.append((name.removeprefix("reefd."), target.removeprefix("reefd.")))
    return sorted(out)


def _reaches(target: str, entry: str) -> bool:
    """An import of `target` is one of `entry`'s, or of a package above it (`from reefd.grow import recipes`)."""
    return _within(target, entry) or entry.startswith(target + ".")


def _allowed(source: str, target: str) -> bool:
    return any(_reaches(target, e) for e in STAGE_IMPORTS[stage("reefd." + source)])


def test_stages_import_only_what_their_row_allows() -> None:
    crossing = _crossing()
    assert ("grow.runner", "serve.scenarios") in crossing  # the graph really was read
    missing = sorted({stage("reefd." + m) for m in modules()} - set(STAGE_IMPORTS))
    assert missing == [], f"stages with no row in STAGE_IMPORTS (say what they may import): {missing}"
    against = [(s, t) for s, t in crossing if not _allowed(s, t)]
    wrong = [f"{s} -> {t}" for s, t in against
             if not any(_within(s, a) and _reaches(t, b) for a, b in KNOWN_EXCEPTIONS)]
    assert wrong == [], "imports against the stage table (invert them through a contract module, or change " \
        "STAGE_IMPORTS with a reason):\n" + "\n".join(wrong)
    fixed = [f"{a} -> {b}" for a, b in KNOWN_EXCEPTIONS
             if not any(_within(s, a) and _within(t, b) for s, t in against)]
    assert fixed == [], f"known exceptions no import needs any more (drop them): {fixed}"


def test_the_generic_trainer_imports_no_recipe() -> None:
    edges = graph()
    trainer = [m for m in edges if m.startswith("reefd.train")]
    assert "reefd.train.training" in trainer
    assert [f"{m} -> {t}" for m in trainer for t in edges[m] if t.startswith("recipes")] == []


def test_only_the_commit_function_writes_the_chain() -> None:
    """The chain's writing methods are called in commit/policy.py alone (by `commit`); the routes, the runner and
    the reconciler hand it candidates."""
    writes = {"publish", "rollback", "promote", "reject"}
    callers = []
    for name, path in modules().items():
        if name == "reefd.commit.policy" or not name.startswith("reefd"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in writes \
                    and "chain" in ast.unparse(node.func.value):
                callers.append(f"{name}:{node.lineno} {ast.unparse(node.func)}")
    assert callers == []


# Size budgets (files ≤ 500 lines, functions ≤ 60), with the data tables that may be longer and why.
MAX_FILE, MAX_FUNCTION = 500, 60
LONG_TABLES = {
    "reefd/api/openapi.py:_reef_ops": "the OpenAPI operations of Reef's own routes: one table entry per route",
    "reefd/grow/backends/slime.py:slime_args": "slime's train.py arguments: one table entry per flag",
}


def _defs(path: Path) -> Iterator[tuple[str, int]]:
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield node.name, (node.end_lineno or node.lineno) - node.lineno + 1


def test_files_and_functions_stay_within_their_budgets() -> None:
    over = []
    for path in modules().values():
        rel = path.relative_to(ROOT).as_posix()
        if (lines := len(path.read_text().splitlines())) > MAX_FILE:
            over.append(f"{rel}: {lines} lines")
        over += [f"{rel}:{name}: {size} lines" for name, size in _defs(path)
                 if size > MAX_FUNCTION and f"{rel}:{name}" not in LONG_TABLES]
    assert over == [], "over the size budget (split along what the code holds, or name a data table here):\n" + \
        "\n".join(over)
    for entry in LONG_TABLES:  # an allowance that is no longer needed goes
        rel, _, name = entry.partition(":")
        assert dict(_defs(ROOT / rel)).get(name, 0) > MAX_FUNCTION, f"{entry} is within budget: drop its allowance"


def test_daemon_module_names_say_what_they_hold() -> None:
    """No two daemon modules share a name (the trainer, the worker and reefctl are other processes)."""
    seen: dict[str, list[str]] = defaultdict(list)
    for name in modules():
        if name.startswith("reefd.") and not name.startswith(("reefd.worker", "reefd.train", "reefd.cli")):
            seen[name.rpartition(".")[2]].append(name)
    shared = {base: names for base, names in seen.items() if len(names) > 1 and base != "__main__"}
    assert len(seen) > 40 and shared == {}


# What a plug-in can do is declared (a Protocol checked with isinstance, or a declared attribute), never probed.
# getattr/hasattr with these literal names reads something that is no plug-in; the worker and the trainer read HF
# model configs, whose attributes vary by architecture.
NOT_PLUGINS = {"full_key": "omegaconf's ConfigKeyError", "errno": "an OSError",
               "strerror": "an OSError or a URLError's reason", "url": "argparse's namespace (verbs differ in flags)",
               "token": "argparse's namespace", "file": "argparse's namespace"}
KIND_NAMES = {"reefd.engines": {"worker", "sglang", "upstream", "vllm"},
              "reefd.grow.backends": {"local", "ray", "slime"}}


def _daemon_side() -> Iterator[tuple[str, ast.AST]]:
    for name, path in modules().items():
        if not name.startswith(TORCH_SIDE) and not name.startswith("reefd.train"):
            for node in ast.walk(ast.parse(path.read_text())):
                yield name, node


def test_capabilities_are_declared_not_probed() -> None:
    probes = [f"{name}:{node.lineno} {node.func.id}(…, {node.args[1].value!r})" for name, node in _daemon_side()
              if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "hasattr") and len(node.args) >= 2
              and isinstance(node.args[1], ast.Constant) and node.args[1].value not in NOT_PLUGINS]
    assert probes == []


def test_kind_names_are_compared_only_in_their_own_package() -> None:
    compared = []
    for name, node in _daemon_side():
        if isinstance(node, ast.Compare):
            texts = {n.value for n in (node.left, *node.comparators) if isinstance(n, ast.Constant)}
            texts |= {e.value for n in node.comparators if isinstance(n, ast.Tuple | ast.List | ast.Set)
                      for e in n.elts if isinstance(e, ast.Constant)}
            compared += [f"{name}:{node.lineno} {ast.unparse(node)}" for package, kinds in KIND_NAMES.items()
                         if texts & kinds and not name.startswith(package)]
    assert compared == []
