"""House rules that check themselves: the daemon never loads torch, the import graph has no circles, the
generic trainer imports no recipe, and every write to the release chain goes through its one commit function.
(`make lint` also bans torch, transformers and peft imports on the daemon side: ruff's TID251.)"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

from tests.conftest import ROOT

TORCH_SIDE = ("reefd.worker", "reefd.train.__main__", "reefd.train.training", "reefd.train.batch",
              "reefd.train.objective", "reefd.train.slime_batch", "reefd.train.fingerprint", "reefd.train.prefix")


def modules() -> dict[str, Path]:
    out = {}
    for top in ("reefd", "recipes"):
        for path in sorted((ROOT / top).rglob("*.py")):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = path
    return out


def imports(path: Path, name: str) -> set[str]:
    """Every module `path` imports, at module level or inside functions; TYPE_CHECKING-only imports excluded."""
    tree = ast.parse(path.read_text())
    skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for n in ast.walk(node)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
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


def test_the_import_graph_has_no_circles() -> None:
    edges = graph()
    assert "reefd.loop" in edges and "reefd.grow.runner" in edges["reefd.loop"]  # the graph really was read
    seen: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> None:
        seen[node] = 1
        for nxt in sorted(edges.get(node, ())):
            assert seen.get(nxt) != 1, "import circle: " + " -> ".join([*path[path.index(nxt):], nxt])
            if nxt not in seen:
                visit(nxt, [*path, nxt])
        seen[node] = 2

    for node in sorted(edges):
        if node not in seen:
            visit(node, [node])


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
