"""Scenario composition: Hydra defaults, structured validation, one-line errors with key paths."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import jsonschema
import pytest

from reefd import config
from tests.conftest import ROOT, make_scenarios


@pytest.mark.parametrize("path", sorted((ROOT / "scenarios").glob("*.yaml")), ids=lambda p: p.stem)
def test_every_shipped_scenario_composes_and_validates(path: Path) -> None:
    cfg = config.compose(path)
    assert cfg.name == path.stem
    jsonschema.validate(dataclasses.asdict(cfg), config.json_schema())


def test_defaults_pick_the_model_group_and_self_overrides(tmp_path: Path) -> None:
    scen = make_scenarios(tmp_path, names=(), extra={
        "x": "defaults:\n  - model: smollm2\n  - _self_\nmodel:\n  max_batch: 3\n"})
    cfg = config.compose(scen / "x.yaml")
    assert (cfg.model.name, cfg.model.source, cfg.model.max_batch) == ("smollm2", "smollm2", 3)


@pytest.mark.parametrize("body,message", [
    ("model:\n  engine: wrker\n",
     "model.engine: 'wrker' is not one of ['worker', 'sglang', 'vllm', 'upstream']"),
    ("model:\n  enigne: worker\n", "model.enigne: unknown key (did you mean 'engine'?)"),
    ("serve:\n  default_max_tokens: 0\n", "serve.default_max_tokens: 0 is less than the minimum of 1"),
    ("model:\n  max_batch: lots\n", "model.max_batch: Value 'lots' of type 'str' could not be converted to Integer"),
    ("descripton: typo\n", "descripton: unknown key (did you mean 'description'?)"),
    ("release:\n  pin: latest\n", "release.pin: 'latest' does not match '^r(0|[1-9][0-9]{0,8})-[0-9a-f]{7}$'"),
    ("release:\n  on_conflict: overwrite\n", "release.on_conflict: 'overwrite' is not one of ['discard', 'rebase']"),
    ("release:\n  pinn: r1-abcdef0\n", "release.pinn: unknown key (did you mean 'pin'?)"),
    ("retention:\n  max_records: 0\n", "retention.max_records: 0 is less than the minimum of 1"),
    ("retention:\n  max_age_days: 0\n", "retention.max_age_days: 0.0 is less than or equal to the minimum of 0"),
    ("retention:\n  max_age: 30\n", "retention.max_age: unknown key (did you mean 'max_age_days'?)"),
])
def test_mistakes_name_file_and_full_key_path(tmp_path: Path, body: str, message: str) -> None:
    scen = make_scenarios(tmp_path, names=(), extra={
        "bad": "defaults:\n  - model: tiny\n  - _self_\n" + body})
    with pytest.raises(config.ConfigError) as exc:
        config.compose(scen / "bad.yaml")
    assert str(exc.value) == f"{scen}/bad.yaml: {message}"
    assert "\n" not in str(exc.value)


def test_missing_group_option_lists_the_available_ones(tmp_path: Path) -> None:
    scen = make_scenarios(tmp_path, names=(), extra={"bad": "defaults:\n  - model: tinyy\n"})
    with pytest.raises(config.ConfigError) as exc:
        config.compose(scen / "bad.yaml")
    text = str(exc.value)
    options = " ".join(sorted(p.stem for p in (scen / "model").glob("*.yaml")))
    assert "model/tinyy" in text and f"Available options in 'model': {options}" in text and "\n" not in text


def test_upstream_needs_a_url(tmp_path: Path) -> None:
    scen = make_scenarios(tmp_path, names=(), extra={
        "up": "defaults:\n  - model: upstream\n  - _self_\nmodel:\n  url: null\n"})
    with pytest.raises(config.ConfigError, match=r"model\.url: an upstream model needs"):
        config.compose(scen / "up.yaml")


def test_retention_keeps_everything_unless_set(tmp_path: Path) -> None:
    scen = make_scenarios(tmp_path, names=("tiny",), extra={
        "kept": "defaults:\n  - model: tiny\n  - _self_\nretention:\n  max_age_days: 7.5\n  max_records: 100000\n"})
    cfg = config.compose(scen / "kept.yaml")
    assert (cfg.retention.max_age_days, cfg.retention.max_records) == (7.5, 100000)
    default = config.compose(scen / "tiny.yaml").retention
    assert (default.max_age_days, default.max_records) == (None, None)


def test_a_users_block_turns_per_user_learning_on(tmp_path: Path) -> None:
    head = "defaults:\n  - model: tiny\n  - _self_\n"
    scen = make_scenarios(tmp_path, names=("tiny",), extra={
        "each": head + "users: {}\n", "few": head + "users:\n  max: 5\n", "typo": head + "users:\n  maxx: 5\n",
        "none": head + "users:\n  max: 0\n"})
    assert config.compose(scen / "tiny.yaml").users is None
    each = config.compose(scen / "each.yaml").users
    assert each is not None and each.max == 1000
    few = config.compose(scen / "few.yaml").users
    assert few is not None and few.max == 5
    with pytest.raises(config.ConfigError, match=r"users\.maxx: unknown key \(did you mean 'max'\?\)"):
        config.compose(scen / "typo.yaml")
    with pytest.raises(config.ConfigError, match=r"users\.max: 0 is less than the minimum of 1"):
        config.compose(scen / "none.yaml")


def test_empty_or_missing_folder_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(config.ConfigError, match="scenarios folder not found"):
        config.load_all(tmp_path / "nope")
    with pytest.raises(config.ConfigError, match="no scenario files"):
        config.load_all(tmp_path)


def test_schema_rejects_unknown_keys_and_documents_fields() -> None:
    schema = config.json_schema()
    assert schema["additionalProperties"] is False
    assert "description" in schema["properties"]["model"]["properties"]["engine"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"modle": {}}, schema)


def test_release_group_follows_the_head_and_a_pin_overrides_it(tmp_path: Path) -> None:
    scen = make_scenarios(tmp_path, names=("tiny",), extra={
        "pinned": "defaults:\n  - model: tiny\n  - release: follow\n  - _self_\nrelease:\n  pin: r3-1a2b3c4\n"})
    assert config.compose(scen / "tiny.yaml").release == config.ReleaseConfig(pin=None, on_conflict="discard")
    assert config.compose(scen / "pinned.yaml").release.pin == "r3-1a2b3c4"


@pytest.mark.parametrize("stem", ["-x", "a..b", "x.lock", "sp ace"])
def test_file_names_that_cannot_name_a_scenario(tmp_path: Path, stem: str) -> None:
    scen = make_scenarios(tmp_path, names=(), extra={stem: "defaults:\n  - model: tiny\n  - _self_\n"})
    with pytest.raises(config.ConfigError, match="is not a usable scenario name"):
        config.compose(scen / f"{stem}.yaml")


def test_replicas_are_checked_at_load(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    head = "defaults:\n  - model: tiny\n  - _self_\n"
    scen = make_scenarios(tmp_path, names=(), extra={
        "ok": head + "model:\n  replicas: 2\n  workers: [http://10.0.0.7:30000]\n",
        "up": "defaults:\n  - model: upstream\n  - _self_\nmodel:\n  url: http://x/v1\n  replicas: 2\n"})
    cfg = config.compose(scen / "ok.yaml")
    assert (cfg.model.replicas, cfg.model.workers) == (2, ["http://10.0.0.7:30000"])
    with pytest.raises(config.ConfigError, match=r"model\.replicas: replicas run behind sglang-router: engine worker"):
        config.compose(scen / "up.yaml")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "sglang_router" else real(name, *a))
    with pytest.raises(config.ConfigError, match=r"model\.replicas: .*not installed: pip install 'reefd\[scale\]'"):
        config.compose(scen / "ok.yaml")


@pytest.mark.parametrize("body,message", [
    ("trigger:\n  cron: every day\n", "trigger.cron: 'every day' is not a crontab expression"),
    ("recipe:\n  name: sao\n  params:\n    lr: -1\n", "recipe.params.lr: -1 is less than or equal to the minimum of 0"),
    ("recipe:\n  name: nope\n", "recipe: unknown recipe 'nope'"),
    ("recipe:\n  name: ttt-discover\n  params:\n    rollouts: 2\n",
     "recipe.params.rollouts: 2 attempts per group; TTT-Discover needs at least 3 (with 2, the leave-one-out"),
    ("gate:\n  kind: holdout\n", "gate.tasks: "),
    ("gate:\n  kind: holdout\n  tasks: missing.jsonl\n", "gate.tasks: "),
    ("harness:\n  prompt: lead\n", "harness.prompt: set harness.dir, the harness folder the prompt is in"),
    ("harness:\n  dir: coder-harness\n  prompt: lead\n",
     "harness.prompt: coder-harness/prompts/lead.md does not exist (prompts: review)"),
    ("harness:\n  prompt: Lead\n", "harness.prompt: 'Lead' does not match"),
    ("users:\n  tasks: gate/all.jsonl\n", "users.tasks: 'gate/all.jsonl' has no {user}, so every user would share"),
    ("users:\n  tasks: gate/{user}.jsonl\n", "users.tasks: the always gate answers no tasks; choose one that does"),
])
def test_grow_settings_are_checked_at_load(tmp_path: Path, body: str, message: str) -> None:
    scen = make_scenarios(tmp_path, names=(), extra={"bad": "defaults:\n  - model: tiny\n  - _self_\n" + body})
    with pytest.raises(config.ConfigError) as exc:
        config.compose(scen / "bad.yaml")
    assert str(exc.value).startswith(f"{scen}/bad.yaml: {message}"), str(exc.value)


def test_each_gate_kind_has_its_group_and_its_own_keys(tmp_path: Path) -> None:
    """A kind is chosen by its group in the defaults list; a key of another kind is refused with a hint."""
    scen = make_scenarios(tmp_path, names=(), extra={
        "floor": "defaults:\n  - model: tiny\n  - gate: floor\n  - _self_\ngate:\n  tasks: t.jsonl\n  floor: 0.5\n",
        "mixed": "defaults:\n  - model: tiny\n  - gate: holdout\n  - _self_\ngate:\n  kind: floor\n  tasks: t.jsonl\n"
                 "  floor: 0.5\n"})
    (scen / "t.jsonl").write_text("".join(f'{{"prompt": "q{i}", "answer": "a{i}"}}\n' for i in range(8)))
    assert config.compose(scen / "floor.yaml").gate == {
        "kind": "floor", "scorer": "exact", "min_tasks": 8, "max_tokens": 16, "temperature": 0.0, "tasks": "t.jsonl",
        "floor": 0.5}
    with pytest.raises(config.ConfigError, match=r"gate: Additional properties are not allowed \('margin' was "
                                                 r"unexpected\): the floor kind has no such key .*`- gate: floor`"):
        config.compose(scen / "mixed.yaml")


def test_the_ray_backend_is_checked_at_load(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    head = "defaults:\n  - model: tiny\n  - recipe: sao\n  - _self_\nrecipe:\n"
    scen = make_scenarios(tmp_path, names=(), extra={
        "ok": head + "  backend: {kind: ray, address: http://127.0.0.1:8265}\n", "nowhere": head + "  backend: ray\n",
        "gpus": head + "  backend: {kind: ray, address: h:1, resources: {num_gpus: one}}\n",
        "typo": head + "  backend: {kind: ray, adress: h:1}\n"})
    monkeypatch.delenv("REEF_RAY_ADDRESS", raising=False)
    assert config.compose(scen / "ok.yaml").recipe.backend == {"kind": "ray", "address": "http://127.0.0.1:8265"}
    with pytest.raises(config.ConfigError, match=r"recipe\.backend\.address: backend ray needs a cluster address"):
        config.compose(scen / "nowhere.yaml")
    with pytest.raises(config.ConfigError, match=r"recipe\.backend\.resources\.num_gpus: 'one' is not a number >= 0"):
        config.compose(scen / "gpus.yaml")
    with pytest.raises(config.ConfigError, match=r"recipe\.backend: Additional properties are not allowed \('adress'"):
        config.compose(scen / "typo.yaml")
    monkeypatch.setenv("REEF_RAY_ADDRESS", "http://10.0.0.9:8265")
    assert config.compose(scen / "nowhere.yaml").recipe.backend == "ray"
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real(name, *a))
    with pytest.raises(config.ConfigError, match=r"recipe\.backend: ray needs Ray.*pip install 'reefd\[ray\]'"):
        config.compose(scen / "ok.yaml")


def test_a_fault_is_checked_at_load(tmp_path: Path) -> None:
    head = "defaults:\n  - model: tiny\n  - recipe: sao\n  - _self_\nrecipe:\n"
    scen = make_scenarios(tmp_path, names=(), extra={"hang": head + "  fault: {kind: hang}\n",
                                                     "boom": head + "  fault: {kind: boom}\n"})
    assert config.compose(scen / "hang.yaml").recipe.fault == {"kind": "hang"}
    with pytest.raises(config.ConfigError, match=r"recipe\.fault\.kind: 'boom' is not one of crash, nan, hang"):
        config.compose(scen / "boom.yaml")


def test_a_worker_scenario_without_the_engine_extra_fails_at_start_in_one_line(tmp_path: Path) -> None:
    """`pip install reefd` without `[engine]`: reefd names the extra to install, exit 2, no traceback from a worker."""
    import subprocess
    import sys

    scenarios = make_scenarios(tmp_path / "s")
    hide = "import sys; sys.modules['torch'] = None; from reefd.__main__ import main; sys.exit(main(sys.argv[1:]))"
    for argv in (["--check"], []):  # checking, and starting for real
        out = subprocess.run([sys.executable, "-c", hide, "--scenarios", str(scenarios), "--state",
                              str(tmp_path / "state"), "--listen", "127.0.0.1:0", *argv],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 2, out.stderr
        lines = out.stderr.strip().splitlines()
        assert lines == [f"{scenarios / 'tiny.yaml'}: model.engine: worker runs the model with torch, not installed "
                         "here: pip install 'reefd[engine]'"], out.stderr


@pytest.mark.parametrize("body,message", [
    ("model:\n  replicas: 100000\n", "model.replicas: 100000 is greater than the maximum of 64"),
    ("model:\n  workers: [" + ", ".join(f"http://10.0.0.{i}:1" for i in range(65)) + "]\n", "model.workers: "),
    ("model:\n  max_batch: 1000000\n", "model.max_batch: 1000000 is greater than the maximum of 1024"),
    ("model:\n  max_queue: 100000000\n", "model.max_queue: 100000000 is greater than the maximum of 100000"),
    ("model:\n  max_new_tokens: 99999999999\n", "model.max_new_tokens: 99999999999 is greater than the maximum"),
    ("serve:\n  default_max_tokens: 99999999999\n", "serve.default_max_tokens: 99999999999 is greater than"),
    ("gate:\n  kind: holdout\n  tasks: t.jsonl\n  samples: 5000\n", "gate.samples: 5000 is greater than the maximum"),
    ("release:\n  canary:\n    share: .nan\n", "release.canary.share: nan is not a finite number"),
    ("release:\n  canary:\n    share: 0.1\n    max_drop: .inf\n",
     "release.canary.max_drop: inf is not a finite number"),
    ("serve:\n  temperature: -.inf\n", "serve.temperature: -inf is not a finite number"),
    ("recipe:\n  name: sao\n  params:\n    lr: .nan\n", "recipe.params.lr: nan is not a finite number"),
    ("recipe:\n  name: sao\n  params:\n    eps_high: 1e300\n", "recipe.params.eps_high: 1e+300 is greater than the "
     "maximum of 1000000000.0"),
])
def test_every_number_has_a_finite_upper_bound(tmp_path: Path, body: str, message: str) -> None:
    """What --check and a reload refuse: counts that would take the host down (an operator's 100000 replicas
    started 112 worker processes before memory ran out), and NaN or infinity where a number is expected."""
    scen = make_scenarios(tmp_path, names=(), extra={"bad": "defaults:\n  - model: tiny\n  - _self_\n" + body})
    (scen / "t.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
    with pytest.raises(config.ConfigError) as exc:
        config.compose(scen / "bad.yaml")
    assert str(exc.value).startswith(f"{scen}/bad.yaml: {message}"), str(exc.value)


def test_every_number_field_states_its_bounds() -> None:
    """A number field left without a maximum gets the schema's ceiling: nothing a scenario sets is unbounded."""
    def numbers(node: object, path: str) -> list[tuple[str, dict]]:
        """Every property schema of a number, through properties and the kinds' branches (anyOf, allOf/then)."""
        if isinstance(node, list):
            return [found for item in node for found in numbers(item, path)]
        if not isinstance(node, dict):
            return []
        found = [(path, node)] if node.get("type") in ("integer", "number") or any(
            isinstance(a, dict) and a.get("type") in ("integer", "number") for a in node.get("anyOf", ())) else []
        for key, sub in node.items():
            if key == "properties":
                found += [f for name, prop in sub.items() for f in numbers(prop, f"{path}.{name}")]
            elif key in ("anyOf", "oneOf"):  # a number's own branches carry no bounds: the property does
                found += numbers([b for b in sub if isinstance(b, dict) and b.get("type", "object") == "object"],
                                 path)
            elif key in ("allOf", "then", "else", "items"):
                found += numbers(sub, path)
        return found

    fields = numbers(config.json_schema(), "")
    assert len(fields) > 30
    unbounded = [path for path, node in fields if "maximum" not in node and "exclusiveMaximum" not in node]
    assert unbounded == []
