"""Records in pieces read exactly as whole records did, through the real daemon on the tiny model.

reefd writes a varied corpus with each record stored whole (`REEF_RECORDS=whole`, the store before pieces): the
three APIs, tools, streams, a retry, a side call, sessions and their next states, reports (a score, text and
structured feedback), and practice with a SAO job that learns from it. The test copies the state, rewrites every
record and link of the copy in pieces through the store's own write path, and starts reefd on each: every read
path answers byte for byte the same. Over HTTP: the records API (listings, sessions, practice filters, one
record), a Responses id read back, lineage, exports (JSON lines and Parquet) and `reefctl records`; in the store
itself, what the trainer's batches, the judge's next states and the canary's tallies read (`unconsumed`,
`recent`, listings and single records, and the samples a recipe makes of them)."""

from __future__ import annotations

import asyncio
import json
import shutil
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import lmdb
import openai
import pyarrow.parquet as pq
import pytest

from reefd.grow.recipes import scored_rollout
from reefd.observe import piecetable
from reefd.observe.recordcodec import unpack
from reefd.observe.records import RecordStore
from tests.conftest import Daemon, make_scenarios, sdk
from tests.e2e.test_grow import wait_job
from tests.e2e.test_practice import EVEN, TASKS, practice_status, practice_yaml
from tests.e2e.test_reefctl import reefctl

SYSTEM = "You are a careful coding agent. " * 70  # a piece of its own: a string of pieces.STRING_MIN or more
TOOLS = [{"type": "function", "function": {"name": f"tool_{i}", "description": f"Tool number {i}. " * 12,
                                           "parameters": {"type": "object", "properties": {"path": {
                                               "type": "string"}}}}} for i in range(3)]
PRACTICE = practice_yaml(f"    command: '{EVEN}'\n", recipe="sao", samples=1, max_waiting="4",
                         extra="trigger:\n  every_n_records: 4\nrecipe:\n  params:\n    batch_size: 4\n")


QUIET = "defaults:\n  - model: tiny\n  - recipe: sao\n  - trigger: manual\n  - release: follow\n  - _self_\n"


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Daemon, dict[str, Any]]]:
    """A daemon that stored the corpus whole and was started again with nothing left to write (no practice, no
    trigger, no job running), and what the corpus made (receipts, ids)."""
    base = tmp_path_factory.mktemp("record-reads")
    scenarios = make_scenarios(base / "scenarios", extra={"prac": PRACTICE})
    (scenarios / "practice-tasks.jsonl").write_text(TASKS)
    d = Daemon(scenarios=scenarios, state=base / "state", log_path=base / "reefd.log",
               env={"REEF_RECORDS": "whole"})
    d.start()
    try:
        made = corpus(d)
        d.stop()
        (scenarios / "prac.yaml").write_text(QUIET)
        d.start()
        settled(d)
        yield d, made
    finally:
        if d.proc is not None and d.proc.poll() is None:
            d.stop()


def settled(d: Daemon, timeout_s: float = 120) -> None:
    """Until no job is queued or running (one the stop interrupted resumes at start)."""
    deadline = time.monotonic() + timeout_s
    while any(j["state"] in ("queued", "running") for j in json.loads(d.get("/reef/jobs")[1])["data"]):
        assert time.monotonic() < deadline, d.logs()
        time.sleep(0.2)


def corpus(d: Daemon) -> dict[str, Any]:
    oa = sdk(openai.OpenAI(base_url=d.url + "/v1", api_key=d.token, max_retries=0,
                           default_headers={"x-reef-scenario": "tiny"}))
    an = sdk(anthropic.Anthropic(base_url=d.url, api_key=d.token, max_retries=0,
                                 default_headers={"x-reef-scenario": "tiny"}))
    messages: list[Any] = [{"role": "system", "content": SYSTEM}]
    receipts = []
    for i, stream in enumerate((False, False, True)):  # one session of three turns, the last streamed
        messages.append({"role": "user", "content": f"Step {i}: list the files under src/ and explain. " * 8})
        raw = oa.chat.completions.with_raw_response.create(model="tiny", messages=messages, tools=TOOLS,
                                                           max_tokens=6, stream=stream)
        receipts.append(raw.headers["x-reef-agent-record-id"])
        parsed = raw.parse()
        text = "".join(c.choices[0].delta.content or "" for c in parsed if c.choices) if stream else \
            parsed.choices[0].message.content or ""
        if i == 1:  # an identical resend: a retry
            oa.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, max_tokens=6)
        messages.append({"role": "assistant", "content": text})
    oa.with_options(default_headers={"x-reef-scenario": "tiny", "x-reef-turn": "side"}).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "A title for this chat"}], max_tokens=4)
    first = oa.responses.create(model="tiny", instructions=SYSTEM, input="What does main() do?",
                                max_output_tokens=5)
    followed = oa.responses.create(model="tiny", previous_response_id=first.id, input="And then?",
                                   max_output_tokens=5, stream=True)
    follow_id = next(e.response.id for e in followed if e.type in ("response.completed", "response.incomplete"))
    convo: list[Any] = [{"role": "user", "content": "Fix the failing test in tests/test_io.py " * 10}]
    for streamed in (False, True):
        tools = [{"name": "read_file", "description": "Read a file. " * 30,
                  "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}}}]
        if streamed:
            with an.messages.stream(model="tiny", system=SYSTEM, messages=convo, tools=tools,
                                    max_tokens=5) as s:
                reply = s.get_final_message()
        else:
            reply = an.messages.create(model="tiny", system=SYSTEM, messages=convo, tools=tools, max_tokens=5)
        convo += [{"role": "assistant", "content": [b.model_dump() for b in reply.content] or "ok"},
                  {"role": "user", "content": "Now run it. " * 20}]
    for body in ({"score": 0.5, "references": receipts[:2]},
                 {"score": -1, "feedback": "wrong file", "references": [receipts[2]]},
                 {"feedback": {"rubric": {"style": 2, "tests": "missing"}}, "metadata": {"ci": [1, 2]},
                  "references": [receipts[0]]}):
        code, answer, _ = d.post("/reef/report", body)
        assert code == 200, answer
    job = wait_job(d, ("published",), name="prac")
    practice_status(d, "prac", "rounds", 2)
    return {"receipts": receipts, "responses": [first.id, follow_id], "release": job["release"]}


def reads(d: Daemon, made: dict[str, Any], out: Path) -> dict[str, bytes]:
    """Every read path's answer, as bytes."""
    got: dict[str, bytes] = {}
    paths = [f"/reef/releases/{made['release']}/lineage", *(f"/v1/responses/{r}" for r in made["responses"])]
    for name in ("tiny", "prac"):
        paths += [f"/reef/scenarios/{name}/records?limit=1000&practice={p}" for p in ("include", "only", "exclude")]
        paths += [f"/reef/scenarios/{name}/export", f"/reef/scenarios/{name}/export?reported_only=true"]
    for path in paths:
        got[path] = _get(d, path)[1]
    every = [json.loads(line) for name in ("tiny", "prac")
             for line in got[f"/reef/scenarios/{name}/export"].splitlines() if line.strip()]
    assert len(every) >= 17, len(every)  # 9 turns of traffic, 8 practice answers (2 rounds of 4)
    for rec in every:
        got[f"/reef/records/{rec['id']}"] = _get(d, f"/reef/records/{rec['id']}")[1]
        if rec.get("session"):
            path = f"/reef/scenarios/{rec['scenario']}/records?limit=1000&session={rec['session']}"
            got[path] = _get(d, path)[1]
    for name in ("tiny", "prac"):
        shown = reefctl(d, "records", name, "-o", "wide")
        assert shown.returncode == 0, shown.stderr
        got[f"reefctl records {name}"] = shown.stdout.encode()
        for session in sorted({r["session"] for r in every if r["scenario"] == name and r.get("session")}):
            turns = reefctl(d, "records", name, "--session", session)
            assert turns.returncode == 0, turns.stderr
            got[f"reefctl records {name} --session {session}"] = turns.stdout.encode()
        target = out / f"{name}.parquet"
        exported = reefctl(d, "export", name, "--format", "parquet", "-o", str(target))
        assert exported.returncode == 0, exported.stderr
        got[f"parquet {name}"] = json.dumps(pq.read_table(target).to_pylist(), sort_keys=True, default=str).encode()
    return got


def _get(d: Daemon, path: str) -> tuple[str, bytes]:
    request = urllib.request.Request(d.url + path, headers={**d.headers(), "x-reef-scenario": "tiny"})
    with urllib.request.urlopen(request, timeout=60) as answer:
        assert answer.status == 200, path
        return path, bytes(answer.read())


def in_pieces(source: Path, target: Path) -> int:
    """A copy of the store at `source` with every record and link rewritten in pieces, as reefd writes them now;
    every other table copied as it is. Returns how many values were rewritten in pieces."""
    env = lmdb.open(str(source), max_dbs=32, readonly=True, lock=False, subdir=True)
    store = RecordStore(target)

    async def rewrite() -> int:
        await store.open()
        rewritten = 0
        try:
            with env.begin() as src, store._env.begin(write=True) as dst:
                for table in RecordStore.TABLES:
                    if table in piecetable.TABLES:
                        continue
                    db_in = env.open_db(table.encode(), txn=src, create=False)
                    for key, value in src.cursor(db=db_in):
                        if table in ("records", "links"):
                            value = piecetable.encode(dst, store._dbs, unpack(value))
                            rewritten += value[:1] != b"a"
                        dst.put(key, value, db=store._dbs[table])
        finally:
            await store.close()
            env.close()
        return rewritten

    return asyncio.run(rewrite())


def store_reads(path: Path) -> dict[str, Any]:
    """What the daemon's own readers take from the store: the trainer (`unconsumed`, and the samples a recipe
    makes of it), the judge and the sessions rebuilt at start (`recent`), the canary (listings, single records)."""
    store = RecordStore(path)

    async def body() -> dict[str, Any]:
        await store.open()
        try:
            out: dict[str, Any] = {}
            for name in ("tiny", "prac"):
                batch = store.unconsumed(name)
                out[f"unconsumed {name}"] = batch
                out[f"samples {name}"] = [scored_rollout(r, r["reports"]) for r in batch]
                out[f"recent {name}"] = store.recent(name, 0.0)
                listed = store.list_records(name, limit=1000)
                out[f"listed {name}"] = listed
                out[f"export {name}"] = store.export_page(name, None, limit=1000)
                out[f"one by one {name}"] = [store.get_record(r["id"]) for r in listed]
            return out
        finally:
            await store.close()

    return asyncio.run(body())


def test_every_read_path_answers_the_same_from_pieces_as_from_whole_records(
        written: tuple[Daemon, dict[str, Any]], tmp_path: Path) -> None:
    d, made = written
    whole = reads(d, made, tmp_path)
    d.stop()
    assert d.proc is not None and d.proc.returncode == 0, d.logs()
    records = d.state / "records"
    shutil.move(records, tmp_path / "whole")
    assert in_pieces(tmp_path / "whole", records) >= 7  # the turns that carry the long system prompt are cut
    store_whole, store_pieces = store_reads(tmp_path / "whole"), store_reads(records)
    assert store_pieces.keys() == store_whole.keys()
    for key, value in store_whole.items():
        assert store_pieces[key] == value, key
    assert any(s is not None for name in ("tiny", "prac") for s in store_whole[f"samples {name}"]), \
        "the trainer's batches hold samples"
    d.env.pop("REEF_RECORDS")
    d.start()
    pieces = reads(d, made, tmp_path)
    assert pieces.keys() == whole.keys()
    for key, value in whole.items():
        assert pieces[key] == value, key
