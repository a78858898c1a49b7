"""Export without the daemon: the store's pages, what `since` accepts, the flat Parquet row and file, reefctl
without pyarrow, and records as Tinker datums."""

from __future__ import annotations

import calendar
import io
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lmdb
import pyarrow.parquet as pq
import pytest

from reefd.api.errors import ApiError
from reefd.api.export import since_cursor
from reefd.cli import main as cli
from reefd.cli.export_verbs import PARQUET_COLUMNS, datum_line, flat_row, write_parquet
from reefd.commit.chain import ReleaseChain
from reefd.observe.receipts import new_receipt, receipt_ms
from reefd.observe.records import RecordStore
from tests.test_records import record, with_store


def test_pages_go_through_one_scenario_in_receipt_order(tmp_path: Path) -> None:
    async def body(store: RecordStore) -> None:
        ids = []
        for i in range(7):
            rec = record("s1", i=i)
            await store.put_record(rec)
            await store.put_record(record("s0"))  # a neighbour in key order
            ids.append(rec["id"])
        await store.put_report("s1", {"references": [ids[1], ids[5]], "score": 1.0})
        pages, after = [], None
        while True:
            found, after = store.export_page("s1", after, limit=3)
            pages.append([r["id"] for r in found])
            if after is None:
                break
        assert pages == [ids[:3], ids[3:6], ids[6:]]
        assert [r["id"] for r in store.export_page("s1", None, reported_only=True)[0]] == [ids[1], ids[5]]
        found, after = store.export_page("s1", None, reported_only=True, scan=3)  # bounded work per page
        assert [r["id"] for r in found] == [ids[1]] and after == ids[2]
        assert store.export_page("s1", ids[5], limit=10) == ([store.get_record(ids[6])], None)
        assert store.export_page("nobody", None) == ([], None)

    with_store(tmp_path / "db", body)


def test_since_takes_a_receipt_a_release_a_duration_or_a_time(tmp_path: Path) -> None:
    chain = ReleaseChain(tmp_path / "releases.git")
    base = chain.publish("s1", expected_head=None, kind="base", artifact_dir=None, meta={})
    receipt = new_receipt()
    assert since_cursor("", "s1", chain) is None
    assert since_cursor(receipt, "s1", chain) == receipt
    hour_ago = receipt_ms(since_cursor("1h", "s1", chain) or "")
    assert abs(hour_ago - (time.time() - 3600) * 1000) < 60_000
    assert receipt_ms(since_cursor("2025-01-31T00:00:00Z", "s1", chain) or "") == 1738281600000
    published = calendar.timegm(time.strptime(base.created_at, "%Y-%m-%dT%H:%M:%SZ"))
    assert receipt_ms(since_cursor(base.id, "s1", chain) or "") == published * 1000
    for bad, status in (("yesterday", 400), ("2025-01-31T00:00:00", 400), ("r9-abcdef0", 404), ("5 h", 400)):
        with pytest.raises(ApiError) as info:
            since_cursor(bad, "s1", chain)
        assert info.value.status == status and info.value.param == "since"


def served(**fields: Any) -> dict[str, Any]:
    return {**record("s1"), "api": "openai", "model": "tiny", "release": "r0-abcdef0", "session": "u1", "turn": 0,
            "created_at": 1700000000.5, "usage": {"prompt_tokens": 4, "completion_tokens": 3}, "latency_s": 0.25,
            "finish_reason": "stop", "prompt_token_ids": [5, 6, 7, 8], "tags": {"team": "a"},
            "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
            "response": {"choices": [{"message": {"role": "assistant", "content": "hello"}}]}, **fields}


def test_a_record_is_one_flat_row() -> None:
    reports = [{"report_id": "a", "score": 0.5, "feedback": "ok", "created_at": 1.0},
               {"report_id": "b", "score": None, "feedback": {"label": "late"}, "created_at": 3.0},
               {"report_id": "c", "score": 1, "created_at": 2.0}]
    row = flat_row(served(reports=reports, next="01ARZ3NDEKTSV4RRFFQ69G5FAV"))
    assert set(row) == {name for name, _ in PARQUET_COLUMNS}
    assert row["completion"] == "hello" and json.loads(row["prompt"]) == [{"role": "user", "content": "hi"}]
    assert row["score"] == 1.0 and json.loads(row["feedback"]) == {"label": "late"}  # the newest of each
    assert [r["report_id"] for r in json.loads(row["reports"])] == ["a", "b", "c"]
    assert row["completion_token_ids"] == [1, 2, 3] and row["completion_logprobs"] == [-0.5, -0.25, -0.125]
    assert (row["prompt_tokens"], row["completion_tokens"], row["turn"]) == (4, 3, 0)
    assert row["next"] == "01ARZ3NDEKTSV4RRFFQ69G5FAV" and json.loads(row["tags"]) == {"team": "a"}
    bare = flat_row({"id": "x", "scenario": "s1", "messages": [{"role": "user", "content": "q"}]})
    assert bare["completion"] is None and bare["score"] is None and bare["prompt_token_ids"] is None
    assert json.loads(bare["prompt"]) == [{"role": "user", "content": "q"}]  # no answer: every message is prompt


def test_parquet_file_has_the_flat_schema_in_row_groups(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("reefd.cli.export_verbs.ROW_GROUP", 2)
    records = [served(reports=[{"score": float(i)}]) for i in range(5)]
    out = io.BytesIO()
    assert write_parquet(iter(records), out) == 5
    out.seek(0)
    meta = pq.ParquetFile(out).metadata
    assert (meta.num_rows, meta.num_row_groups) == (5, 3)
    table = pq.read_table(out)
    assert table.column_names == [name for name, _ in PARQUET_COLUMNS]
    assert table.column("receipt").to_pylist() == [r["id"] for r in records]
    assert table.column("score").to_pylist() == [0.0, 1.0, 2.0, 3.0, 4.0]
    empty = io.BytesIO()
    assert write_parquet(iter([]), empty) == 0
    empty.seek(0)
    assert pq.read_table(empty).schema == table.schema


def test_parquet_without_pyarrow_names_the_extra(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # `import pyarrow` raises ImportError
    code = cli.main(["--url", "http://127.0.0.1:9", "export", "s1", "--format", "parquet", "-o",
                     str(tmp_path / "x.parquet")])
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1  # one line, before reefd is asked anything
    assert "pip install 'reefd[export]'" in err and "cannot reach" not in err
    assert not (tmp_path / "x.parquet").exists()


def export_app(tmp_path: Path, records: list[dict[str, Any]]) -> Any:
    """The export route alone, in-process, over a real store holding `records` (and their `reports`)."""
    from aiohttp import web

    from reefd.api import export as export_api
    from reefd.api.errors import error_middleware
    from reefd.loop import CHAIN, RECORDS, REGISTRY

    app = web.Application(middlewares=[error_middleware])

    async def store(app: web.Application) -> Any:
        app[RECORDS] = RecordStore(tmp_path / "db")
        await app[RECORDS].open()
        for rec in records:
            reports = rec.pop("reports", [])
            await app[RECORDS].put_record(rec)
            for report in reports:
                await app[RECORDS].put_report(rec["scenario"], {**report, "references": [rec["id"]]})
        yield
        await app[RECORDS].close()

    app.cleanup_ctx.append(store)
    app[REGISTRY] = SimpleNamespace(get=lambda name: SimpleNamespace(name=name))  # type: ignore[assignment]
    app[CHAIN] = ReleaseChain(tmp_path / "releases.git")
    app.router.add_get("/reef/scenarios/{name}/export", export_api.export)
    return app


def test_an_export_cut_half_way_is_an_error_not_a_short_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A failure after the first page was sent cuts the stream: the client cannot take a part for the whole."""
    from reefd.api import export as export_api
    from reefd.cli.client import Client, CliError
    from tests.served import aiohttp_in_thread

    app = export_app(tmp_path, [record("s1", i=i) for i in range(5)])
    monkeypatch.setattr(export_api, "PAGE", 2)
    read_page = RecordStore.export_page
    calls: list[int] = []

    def failing_second(self: RecordStore, *args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if fail and len(calls) == 2:
            raise lmdb.Error("the disk went away")
        return read_page(self, *args, **kwargs)

    monkeypatch.setattr(RecordStore, "export_page", failing_second)
    with aiohttp_in_thread(app) as url:
        client = Client(url, None)
        fail = False
        assert len(list(client.lines("/reef/scenarios/s1/export"))) == 5
        calls.clear()
        fail, got = True, []
        with pytest.raises(CliError, match="ended early"):
            for line in client.lines("/reef/scenarios/s1/export"):
                got.append(line)
        assert len(got) == 2


def test_a_record_is_one_shifted_datum() -> None:
    """Next-token prediction over prompt + completion: the prompt's targets weigh 0, the completion's 1; logprobs
    and the newest report's score ride on the completion's targets; a record without ids or answer has none."""
    reports = [{"score": 0.5, "created_at": 1.0}, {"score": 2, "created_at": 3.0}, {"score": None, "created_at": 4.0},
               {"score": True, "created_at": 5.0}]
    line, _ = datum_line(served(reports=reports, turn_kind="main"))
    assert line is not None and line["score"] == 2.0 and line["turn_kind"] == "main"
    datum = line["datum"]
    assert datum["model_input"] == {"chunks": [{"type": "encoded_text", "tokens": [5, 6, 7, 8, 1, 2]}]}
    inputs = datum["loss_fn_inputs"]
    assert inputs["target_tokens"] == {"data": [6, 7, 8, 1, 2, 3], "dtype": "int64", "shape": [6]}
    assert inputs["weights"]["data"] == [0.0, 0.0, 0.0, 1.0, 1.0, 1.0] and inputs["weights"]["dtype"] == "float32"
    assert inputs["logprobs"]["data"] == [0.0, 0.0, 0.0, -0.5, -0.25, -0.125]
    assert inputs["advantages"]["data"] == [0.0, 0.0, 0.0, 2.0, 2.0, 2.0]
    plain, _ = datum_line(served(completion_logprobs=[-0.5, None, -0.125]))  # a null: no logprobs, no score
    assert plain is not None and set(plain["datum"]["loss_fn_inputs"]) == {"target_tokens", "weights"}
    assert plain["score"] is None
    assert datum_line(served(prompt_token_ids=None)) == (None, "without token ids")
    assert datum_line(served(completion_token_ids=[])) == (None, "without a completion token to predict")


def test_datums_skip_what_has_no_token_ids_and_say_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tinker import types

    from tests.served import aiohttp_in_thread

    kept = served(reports=[{"score": 0.5}])
    records = [kept, served(prompt_token_ids=None), served(completion_token_ids=None, completion_logprobs=None),
               served(completion_token_ids=[], completion_logprobs=[])]
    target = tmp_path / "s1.datums.jsonl"
    with aiohttp_in_thread(export_app(tmp_path, records)) as url:
        code = cli.main(["--url", url, "export", "s1", "--format", "datums", "-o", str(target)])
    err = capsys.readouterr().err
    assert code == 0, err
    assert err.splitlines() == ["skipped 3 records of s1: 1 without a completion token to predict, 2 without "
                                "token ids", f"exported 1 datums of s1 to {target}"]
    [line] = [json.loads(text) for text in target.read_text().splitlines()]
    assert (line["receipt"], line["score"]) == (kept["id"], 0.5)
    datum = types.Datum(model_input=types.ModelInput.model_validate(line["datum"]["model_input"]),
                        loss_fn_inputs={k: types.TensorData(**v) for k, v in line["datum"]["loss_fn_inputs"].items()})
    assert datum.model_input.to_ints() == [5, 6, 7, 8, 1, 2]
