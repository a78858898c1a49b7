"""Moved scenario keys: an old key loads at its new place for one release, with a warning naming both and the file;
`reefd --check` prints the warnings and passes; an old key beside its new one is an error."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest

from reefd import config, moved_keys
from tests.conftest import ROOT, make_scenarios

HEAD = "defaults:\n  - model: tiny\n  - recipe: sao\n  - _self_\nrecipe:\n"
RAY = "http://127.0.0.1:8265"


def test_an_old_ray_address_loads_at_its_new_key(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """`backend: ray` beside `ray_address: X` (before e37b24b) is `backend: {kind: ray, address: X}`."""
    scen = make_scenarios(tmp_path, names=(), extra={"old": HEAD + f"  backend: ray\n  ray_address: {RAY}\n"})
    warnings: list[str] = []
    cfg = config.compose(scen / "old.yaml", warnings)
    assert cfg.recipe.backend == {"kind": "ray", "address": RAY}
    assert warnings == [f"{scen}/old.yaml: recipe.ray_address is the old name of recipe.backend.address (read for "
                        f"one more release): write `recipe.backend: {{kind: ray, address: '{RAY}'}}`"]
    with caplog.at_level(logging.WARNING, logger="reefd.config"):  # without a list, the daemon's log has it
        assert config.compose(scen / "old.yaml").recipe.backend == cfg.recipe.backend
    assert [r.getMessage() for r in caplog.records] == warnings


def test_cluster_and_slime_settings_move_into_the_backend(tmp_path: Path) -> None:
    scen = make_scenarios(tmp_path, names=(), extra={"slime": HEAD + (
        f"  backend: slime\n  ray_address: {RAY}\n  ray_resources: {{num_cpus: 2}}\n"
        "  slime: {model: qwen3-4B, actor_num_gpus_per_node: 4}\n")})
    warnings: list[str] = []
    assert config.compose(scen / "slime.yaml", warnings).recipe.backend == {
        "kind": "slime", "address": RAY, "resources": {"num_cpus": 2}, "model": "qwen3-4B",
        "actor_num_gpus_per_node": 4}
    moved = [w.split(": ", 1)[1].split(" (read")[0] for w in warnings]
    assert moved == [f"{old} is the old name of {new}" for old, new in [
        ("recipe.ray_address", "recipe.backend.address"), ("recipe.ray_resources", "recipe.backend.resources"),
        ("recipe.slime.model", "recipe.backend.model"),
        ("recipe.slime.actor_num_gpus_per_node", "recipe.backend.actor_num_gpus_per_node")]]


def test_an_old_key_its_backend_never_read_is_dropped(tmp_path: Path) -> None:
    """The local backend never read recipe.ray_address (nor ray recipe.slime): it loads, and the warning says so."""
    scen = make_scenarios(tmp_path, names=(), extra={
        "local": HEAD + f"  ray_address: {RAY}\n", "ray": HEAD + f"  backend: ray\n  ray_address: {RAY}\n"
                                                               "  slime: {model: qwen3-4B}\n"})
    warnings: list[str] = []
    assert config.compose(scen / "local.yaml", warnings).recipe.backend == "local"
    assert warnings == [f"{scen}/local.yaml: recipe.ray_address is the old name of recipe.backend.address, which "
                        "this scenario's recipe.backend (unset: the default) does not read, nor did it read the old "
                        "one: delete it"]
    assert config.compose(scen / "ray.yaml").recipe.backend == {"kind": "ray", "address": RAY}


@pytest.mark.parametrize("recipe,old,new", [
    (f"  backend: {{kind: ray, address: {RAY}}}\n  ray_address: {RAY}\n", "recipe.ray_address",
     "recipe.backend.address"),
    (f"  backend: {{kind: slime, address: {RAY}, model: a}}\n  slime: {{model: b}}\n", "recipe.slime.model",
     "recipe.backend.model"),
])
def test_an_old_key_beside_its_new_one_is_an_error(tmp_path: Path, recipe: str, old: str, new: str) -> None:
    scen = make_scenarios(tmp_path, names=(), extra={"both": HEAD + recipe})
    with pytest.raises(config.ConfigError) as exc:
        config.compose(scen / "both.yaml")
    assert str(exc.value) == (f"{scen}/both.yaml: {old} and {new} are both set: {old} is the old name of {new}; "
                              f"keep {new} alone")


def test_a_plain_move_makes_the_new_parent() -> None:
    raw = {"a": {"b": 1, "c": 2}}
    notes = moved_keys.apply(raw, (moved_keys.Moved("a.b", "x.y"),))
    assert raw == {"a": {"c": 2}, "x": {"y": 1}}
    assert notes == ["a.b is the old name of x.y (read for one more release): write `x: {y: 1}`"]


def test_check_prints_the_warnings_and_passes(tmp_path: Path) -> None:
    scen = make_scenarios(tmp_path, extra={"old": HEAD + f"  backend: ray\n  ray_address: {RAY}\n"})
    out = subprocess.run([sys.executable, "-m", "reefd", "--check", "--scenarios", str(scen)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        "old: ok (model tiny, engine worker)",
        f"old: warning: {scen}/old.yaml: recipe.ray_address is the old name of recipe.backend.address (read for one "
        f"more release): write `recipe.backend: {{kind: ray, address: '{RAY}'}}`",
        "tiny: ok (model tiny, engine worker)"]
