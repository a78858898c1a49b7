"""Records leave the daemon and the daemon lets them go: `reefctl export` as JSON lines, as a Parquet file that
`datasets` loads and as Tinker datums the SDK takes, and `retention:` deleting what no release learned from, on the
real daemon and the tiny model: one reefd for the module, a scenario per test."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import Daemon, shared_daemon
from tests.e2e.test_grow import client, learn_yaml, turn, wait_job
from tests.e2e.test_reefctl import reefctl


@pytest.fixture(scope="module")
def exportd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    yield from shared_daemon(tmp_path_factory.mktemp("export"))


def exported(d: Daemon, name: str, *args: str) -> list[dict[str, object]]:
    out = reefctl(d, "export", name, *args)
    assert out.returncode == 0 and out.stderr == "", out.stderr
    return [json.loads(line) for line in out.stdout.splitlines()]


def test_export_jsonl_and_parquet_that_datasets_loads(exportd: Daemon, own_scenario: Callable[..., str],
                                                      tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    d = exportd
    name = own_scenario(d, learn_yaml(trigger="manual"), prefix="learn")
    c = client(d, name)
    served = [turn(d, c, f"question {i}", score=None, name=name) for i in range(3)]
    receipts = [r for r, _, _ in served]
    for receipt, score in ((receipts[0], 0.25), (receipts[2], 1.0)):
        code, body, _ = d.post("/reef/report", {"score": score, "feedback": "noted", "references": [receipt]},
                               headers={"x-reef-scenario": name})
        assert code == 200, body

    lines = exported(d, name)
    assert [r["id"] for r in lines] == receipts
    assert [[rep["score"] for rep in r["reports"]] for r in lines] == [[0.25], [], [1.0]]  # type: ignore[union-attr]
    assert lines[1] == json.loads(d.get(f"/reef/records/{receipts[1]}")[1])  # each as `get record` shows it
    assert [r["id"] for r in exported(d, name, "--reported-only")] == [receipts[0], receipts[2]]
    assert [r["id"] for r in exported(d, name, "--since", receipts[0])] == receipts[1:]  # after that receipt
    assert [r["id"] for r in exported(d, name, "--since", "1h")] == receipts
    assert [r["id"] for r in exported(d, name, "--since", "2025-01-31T00:00:00Z", "--reported-only")] == \
        [receipts[0], receipts[2]]
    bad = reefctl(d, "export", name, "--since", "last tuesday")
    assert bad.returncode == 1 and "since:" in bad.stderr and bad.stdout == ""
    unknown = reefctl(d, "export", "nope", "-o", str(tmp_path / "nope.jsonl"))
    assert unknown.returncode == 1 and "unknown scenario" in unknown.stderr
    assert not (tmp_path / "nope.jsonl").exists() and not (tmp_path / "nope.jsonl.part").exists()

    target = tmp_path / f"{name}.parquet"
    out = reefctl(d, "export", name, "--format", "parquet", "-o", str(target))
    assert out.returncode == 0 and f"exported 3 records of {name} to {target}" in out.stderr, out.stderr
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    import datasets

    ds = datasets.load_dataset("parquet", data_files=str(target), split="train", cache_dir=str(tmp_path / "hf"))
    assert ds.num_rows == 3
    assert ds["receipt"] == receipts and ds["scenario"] == [name] * 3
    assert ds["score"] == [0.25, None, 1.0] and ds["feedback"] == ["noted", None, "noted"]
    assert ds["completion"] == [text for _, _, text in served]
    assert [json.loads(p)[-1]["content"] for p in ds["prompt"]] == [f"question {i}" for i in range(3)]
    assert ds["completion_token_ids"] == [r["completion_token_ids"] for r in lines]
    assert ds["release"] == [release for _, release, _ in served]



def sdk_datum(line: dict[str, Any]) -> Any:
    """A `--format datums` line as the SDK's own `Datum`, as docs/tinker.md makes it, checked by the SDK's strict
    model of the same JSON (extra keys forbidden) on the way."""
    from tinker import types
    from tinker.types._pydantic_types.datum import Datum as StrictDatum

    StrictDatum.model_validate(line["datum"])
    d = line["datum"]
    return types.Datum(model_input=types.ModelInput.model_validate(d["model_input"]),
                       loss_fn_inputs={k: types.TensorData(**v) for k, v in d["loss_fn_inputs"].items()})


def test_export_datums_that_the_tinker_sdk_takes(exportd: Daemon, own_scenario: Callable[..., str],
                                                 tmp_path: Path) -> None:
    """Each served record as a shifted next-token datum, token-exact: the prompt's targets weigh 0, the completion's
    1, with the record's logprobs and (for the scored one) the newest report's score as its advantage."""
    d = exportd
    name = own_scenario(d, learn_yaml(trigger="manual"), prefix="learn")
    c = client(d, name)
    receipts = [turn(d, c, f"datum {i}", score=None, name=name)[0] for i in range(2)]
    for score in (0.25, 0.75):  # the newer report is the one taken
        code, body, _ = d.post("/reef/report", {"score": score, "references": [receipts[0]]},
                               headers={"x-reef-scenario": name})
        assert code == 200, body
    records = {r["id"]: r for r in exported(d, name)}
    out = reefctl(d, "export", name, "--format", "datums")
    assert out.returncode == 0 and out.stderr == "", out.stderr  # nothing skipped: every served turn has its ids
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    assert [line["receipt"] for line in lines] == receipts and [line["score"] for line in lines] == [0.75, None]
    for line in lines:
        datum, rec = sdk_datum(line), records[line["receipt"]]
        prompt, completion = rec["prompt_token_ids"], rec["completion_token_ids"]
        assert prompt and completion and line["scenario"] == name and line["release"] == rec["release"]
        inputs = line["datum"]["loss_fn_inputs"]
        targets = datum.loss_fn_inputs["target_tokens"].tolist()
        assert datum.model_input.to_ints() + targets[-1:] == prompt + completion
        assert targets == (prompt + completion)[1:]
        assert inputs["weights"]["data"] == [0.0] * (len(prompt) - 1) + [1.0] * len(completion)
        assert inputs["logprobs"]["data"] == [0.0] * (len(prompt) - 1) + rec["completion_logprobs"]
        assert datum.loss_fn_inputs["logprobs"].tolist()[len(prompt) - 1:] == \
            pytest.approx(rec["completion_logprobs"], abs=1e-6)  # float32 in the SDK
    first = records[receipts[0]]
    assert lines[0]["datum"]["loss_fn_inputs"]["advantages"]["data"] == \
        [0.0] * (len(first["prompt_token_ids"]) - 1) + [0.75] * len(first["completion_token_ids"])
    assert "advantages" not in lines[1]["datum"]["loss_fn_inputs"]

    def receipts_of(*args: str) -> list[str]:
        got = reefctl(d, "export", name, "--format", "datums", *args)
        assert got.returncode == 0, got.stderr
        return [json.loads(line)["receipt"] for line in got.stdout.splitlines()]

    assert receipts_of("--reported-only") == receipts[:1] and receipts_of("--since", receipts[0]) == receipts[1:]
    assert receipts_of("--practice", "only") == []
    target = tmp_path / "datums.jsonl"
    written = reefctl(d, "export", name, "--format", "datums", "-o", str(target))
    assert written.returncode == 0 and written.stderr == f"exported 2 datums of {name} to {target}\n"
    assert target.read_text() == out.stdout


def test_retention_deletes_beyond_max_records_but_keeps_what_a_release_learned_from(
        exportd: Daemon, own_scenario: Callable[..., str]) -> None:
    """max_records 4: four records (within the bound, so no sweep can take one before the job does) train a
    published release, then six more arrive; the two oldest of those go (shortly after the writes, with no
    operator), the release's four stay without counting against the bound, and `reefctl status` counts eight. A
    deleted receipt is a 404 to read and to report on."""
    d = exportd
    name = own_scenario(d, learn_yaml(trigger="manual", extra="retention:\n  max_records: 4\n"), prefix="learn")
    c = client(d, name)
    learned = [turn(d, c, f"task {i}", score=float(i % 2), name=name)[0] for i in range(4)]
    out = reefctl(d, "train", name, "--follow")
    assert out.returncode == 0, out.stdout + out.stderr
    job = wait_job(d, name=name)
    assert job["state"] == "published" and job["receipts"] == learned
    explained = reefctl(d, "explain", job["release"], "--depth", "all", "-o", "json")
    assert explained.returncode == 0, explained.stderr
    chain = json.loads(explained.stdout)["releases"]
    assert [r["kind"] for r in chain] == ["adapter", "base"] and chain[1]["parent"] is None
    head = chain[0]
    assert (head["id"], head["recipe"], head["job"]["id"]) == (job["release"], "sao", job["id"])
    assert head["gate"] is not None and [r["receipt"] for r in head["learned_from"]] == learned
    params = head["params"]  # kept in the release: the job's parameters, whatever reefd still knows of the job
    assert (params["recipe"], params["backend"], params["target"]) == ("sao", "local", "lora")
    assert params["objective"] == "recipes.sao.objective:SAOObjective" and isinstance(params["settings"], dict)
    assert head["metrics"] == job["metrics"] and head["harness_diff"] is None
    assert [[x["score"] for x in r["reports"]] for r in head["learned_from"]] == [[float(i % 2)] for i in range(4)]
    shown = reefctl(d, "explain", job["release"]).stdout
    assert f"release/{job['release']}" in shown and "Learned from 4 records" in shown and learned[0] in shown
    assert "  Params:\n    recipe: sao\n" in shown and "    backend: local\n" in shown
    later = [turn(d, c, f"later {i}", score=None, name=name)[0] for i in range(6)]

    deadline = time.monotonic() + 60
    while (count := records_of(d, name)) > 8 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert count == 8, d.logs()
    assert [r["id"] for r in exported(d, name)] == [*learned, *later[2:]]
    assert [r["id"] for r in exported(d, name, "--reported-only")] == learned  # their reports stayed with them
    status = reefctl(d, "status").stdout.splitlines()
    header, row = status[0].split(), next(line.split() for line in status[1:] if line.split()[:1] == [name])
    assert (row[header.index("RECORDS")], row[header.index("REPORTS")]) == ("8", "4")

    code, body = d.get(f"/reef/records/{later[0]}")
    assert code == 404 and json.loads(body)["error"]["code"] == "record_not_found"
    code, error, _ = d.post("/reef/report", {"score": 1.0, "references": [later[0]]},
                            headers={"x-reef-scenario": name})
    assert code == 404 and error["error"]["code"] == "receipt_not_found" and error["error"]["param"] == "references"
    assert later[0] in error["error"]["message"]
    gone = reefctl(d, "report", later[1], "--score", "1", "--scenario", name)
    assert gone.returncode == 1 and "unknown receipt" in gone.stderr


def records_of(d: Daemon, name: str) -> int:
    status = json.loads(d.get("/reef/status")[1])
    return int(next(s["records"] for s in status["scenarios"] if s["name"] == name))
