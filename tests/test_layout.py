"""House rules that check themselves: the daemon never loads torch, the import graph has no circles, the
generic trainer imports no recipe, and every write to the release chain goes through its one commit function.
(`make lint` also bans torch, transformers and peft imports on the daemon side: ruff's TID251.)"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

from tests.conftest import ROOT

TORCH_SIDE = ("reefd.worker", "reefd.train.__main__", "reefd.train.training", "reefd.train.batch",
              "reefd.train.objective", "reefd.train.slime_batch")


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
    """The chain's writing methods are called in releases.py alone (by `commit`); the routes, the runner and the
    reconciler hand it candidates."""
    writes = {"publish", "rollback", "promote", "reject"}
    callers = []
    for name, path in modules().items():
        if name == "reefd.commit.chain" or not name.startswith("reefd"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in writes \
                    and "chain" in ast.unparse(node.func.value):
                callers.append(f"{name}:{node.lineno} {ast.unparse(node.func)}")
    assert callers == []
