"""Records in pieces (reefd/observe/pieces.py, piecetable.py): every read gives back what was written, exactly;
a session's repeats are stored once, so what it costs grows with the conversation and not with its square; a
piece goes with the last record that needs it; and a store written before pieces reads as it did."""

from __future__ import annotations

import asyncio
import json
import random
import shutil
import zlib
from collections import Counter
from pathlib import Path
from typing import Any

import lmdb
import orjson
import pytest

from reefd.observe import pieces
from reefd.observe.recordcodec import pack, unpack
from reefd.observe.records import RecordStore, new_receipt
from tests.test_records import with_store

FIXTURE = Path(__file__).parent / "fixtures" / "store-before-pieces"
WORDS = (
    "the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "was", "with", "be", "by", "on", "not",
    "he", "this", "are", "or", "his", "from", "at", "which", "but", "have", "an", "they", "you", "were", "her",
    "she", "there", "been", "one", "all", "we", "their", "has", "would", "when", "if", "so", "no", "what", "up",
    "its", "out", "who", "them", "function", "return", "value", "error", "file", "line", "test", "build",
    "module", "import", "class", "self", "none", "true", "false",
)


def text(rng: random.Random, size: int) -> str:
    words: list[str] = []
    while sum(len(w) + 1 for w in words) < size:
        words.append(rng.choice(WORDS))
    return " ".join(words)


def session(turns: int, seed: int = 0, tokens: bool = True) -> list[dict[str, Any]]:
    """A coding agent's session: each turn resends the whole transcript plus a 3 KB message, the tools and a
    system prompt; on the worker, the prompt's token ids extend the last turn's."""
    rng = random.Random(seed)
    system, tools = text(rng, 4000), [{"type": "function", "function": {"name": f"tool{i}", "description":
                                                                        text(rng, 600)}} for i in range(4)]
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}]
    ids: list[int] = []
    out: list[dict[str, Any]] = []
    for turn in range(turns):
        messages = [*messages, {"role": "user", "content": text(rng, 3000)}]
        ids = ids + [int(49152 ** rng.random()) for _ in range(700)]  # log-uniform: a text's ids are Zipf-like
        reply = text(rng, 200)
        rec: dict[str, Any] = {
            "id": new_receipt(), "scenario": "s", "session": "one", "turn": turn, "created_at": 1.5 + turn,
            "request": {"model": "m", "messages": messages, "tools": tools, "stream": False},
            "messages": [*messages, {"role": "assistant", "content": reply}], "tools": tools,
            "response": {"choices": [{"message": {"role": "assistant", "content": reply}}]}, "raw_text": reply,
            "completion_token_ids": [int(49152 ** rng.random()) for _ in range(50)],
            "completion_logprobs": [-rng.random() for _ in range(50)]}
        if tokens:
            rec["prompt_token_ids"] = ids
        out.append(rec)
        messages = rec["messages"]
        ids = ids + rec["completion_token_ids"]
    return out


def held(store: RecordStore, fetch: Any = None) -> dict[str, int]:
    """Bytes in each table of the store's file."""
    with store._reading() as txn:
        return {t: sum(len(v) for _, v in txn.cursor(db=store._dbs[t]))
                for t in ("records", "links", "pieces", "piece_refs")}


@pytest.mark.parametrize("record", [
    {"id": "x", "messages": [{"role": "user", "content": "a" * 600}], "z": 1, "prompt_token_ids": list(range(512))},
    {"id": "x", "request": {"system": "s" * (pieces.STRING_MIN + 50), "messages": [], "k": [1] * 300},
     "completion_logprobs": [float("-inf"), -0.5], "prompt_token_ids": list(range(700)),
     "after": {"nested": [[1, 2], {"a": None}]}},
    {"id": "x", "prompt_token_ids": [2**40, 1], "messages": [{"role": "tool", "content": "é\u2028" * 400}]},
    {"id": "x", "small": [1, 2, 3], "request": {"messages": [{"role": "user", "content": "hi"}]}},
])
def test_a_record_reads_back_exactly_as_a_whole_value_does(record: dict[str, Any]) -> None:
    cut = pieces.split(record)
    back = pieces.join(cut.value, cut.pieces.get) if cut.value[:1] == pieces.FORMAT else unpack(cut.value)
    assert orjson.dumps(back) == orjson.dumps(unpack(pack(record)))  # key order, values, arrays at the end
    assert cut.value[:1] == pieces.FORMAT or not cut.uses  # a record with nothing to cut is one whole value
    if cut.uses:
        assert Counter(pieces.uses(cut.value, cut.pieces.get)) == Counter(cut.uses)


@pytest.mark.parametrize("tokens", [False, True], ids=["upstream", "worker"])
def test_a_sessions_records_cost_about_its_transcript_and_read_exactly(tmp_path: Path, tokens: bool) -> None:
    turns = session(60, tokens=tokens)

    async def body(store: RecordStore) -> dict[str, int]:
        for rec in turns:
            await store.put_record(rec)
        for rec in turns:
            assert orjson.dumps(store.get_record(rec["id"])) == orjson.dumps({**unpack(pack(rec)), "reports": []})
        return held(store)

    sizes = with_store(tmp_path / "s", body)
    final = len(orjson.dumps(turns[-1]["messages"]))
    assert sum(sizes.values()) <= 1.5 * final, (sizes, final)  # it was 60 times the transcript, as one value each


def test_a_long_text_is_stored_once_whatever_form_its_message_takes(tmp_path: Path) -> None:
    """A tool's 3 KB output in the request as sent (with its tool_call_id), in the normalised messages (without
    it) and in a next state: one piece of text, and each record reads back exactly; deleting them leaves none."""
    rng = random.Random(3)
    output, system = text(rng, 3000), text(rng, 3000)
    sent = [{"role": "system", "content": system}, {"role": "tool", "tool_call_id": "call_1", "content": output}]
    normalised = [sent[0], {"role": "tool", "content": output}, {"role": "assistant", "content": None}]
    first = {"id": new_receipt(), "scenario": "s", "request": {"messages": sent}, "messages": normalised}
    second = {**first, "id": new_receipt(), "session": "b"}

    async def body(store: RecordStore) -> None:
        await store.put_record(first)
        await store.put_record({**second, "previous": first["id"]}, next_state=[sent[1]])
        for rec in (first, second):
            got = store.get_record(rec["id"])
            assert got is not None and got["request"] == rec["request"] and got["messages"] == normalised
        with store._reading() as txn:
            texts = [v for _, v in txn.cursor(db=store._dbs["pieces"])
                     if v[:1] == pieces.JSON and output.encode() in zlib.decompress(v[1:])]
        assert len(texts) == 1, len(texts)
        assert await store.delete_records("s", [first["id"], second["id"]]) == 2
        assert held(store)["pieces"] == held(store)["piece_refs"] == 0

    with_store(tmp_path / "s", body)


def test_deleting_half_a_session_keeps_the_rest_whole_and_no_piece_unreferenced(tmp_path: Path) -> None:
    turns = session(24)

    async def body(store: RecordStore) -> None:
        for i, rec in enumerate(turns):
            await store.put_record({**rec, "previous": turns[i - 1]["id"] if i else None},
                                   next_state=rec["request"]["messages"][-1:])
        gone = [r["id"] for r in turns[::2]]  # every other one, as retention may
        assert await store.delete_records("s", gone) == len(gone)
        for rec in turns[1::2]:
            got = store.get_record(rec["id"])
            assert got is not None and {k: got[k] for k in rec if k != "previous"} == \
                {k: v for k, v in unpack(pack(rec)).items() if k != "previous"}
        with store._reading() as txn:
            table = store._dbs["pieces"]
            needed: Counter[bytes] = Counter()
            for t in ("records", "links"):
                for _, value in txn.cursor(db=store._dbs[t]):
                    needed.update(pieces.uses(value, lambda k: txn.get(k, db=table)))
            stored = {k for k, _ in txn.cursor(db=table)}
            counts = {k: int.from_bytes(v, "little") for k, v in txn.cursor(db=store._dbs["piece_refs"])}
        assert stored == set(needed) and counts == dict(needed)  # each piece held exactly by what needs it
        await store.delete_records("s", [r["id"] for r in turns[1::2]])
        assert held(store)["pieces"] == held(store)["piece_refs"] == 0

    with_store(tmp_path / "s", body)


def test_a_store_written_before_pieces_reads_as_it_did_and_takes_new_records(tmp_path: Path) -> None:
    """The fixture was written by reefd before pieces (each record one value) with what its reads returned."""
    shutil.copytree(FIXTURE / "records", tmp_path / "records")
    expected = json.loads((FIXTURE / "expected.json").read_text())

    async def body(store: RecordStore) -> None:
        for receipt in expected["receipts"]:
            assert store.get_record(receipt) == expected["records"][receipt]
        assert store.list_records("s", limit=100) == expected["listed"]
        assert store.export_page("s", None)[0] == expected["export"]
        assert store.unconsumed("s") == expected["unconsumed"]
        assert store.list_records("s", user="alice") == expected["alice"]
        new = session(3, seed=5)
        for rec in new:
            await store.put_record(rec)
        assert store.get_record(new[-1]["id"]) == json.loads(orjson.dumps({**unpack(pack(new[-1])), "reports": []}))
        assert await store.delete_records("s", expected["receipts"]) == len(expected["receipts"])
        assert [r["id"] for r in store.list_records("s", limit=100)] == [r["id"] for r in new]

    with_store(tmp_path / "records", body)
    env = lmdb.open(str(tmp_path / "records"), max_dbs=32, readonly=True, lock=False)
    env.close()


def test_what_the_store_writes_stays_in_pieces_only_when_asked(tmp_path: Path) -> None:
    """`whole=True` writes each record as one value, as before pieces (the benchmark's baseline)."""
    rec = session(2)[-1]

    async def body(store: RecordStore) -> bytes:
        await store.put_record(rec)
        with store._reading() as txn:
            return bytes(txn.get(rec["id"].encode(), db=store._dbs["records"]))

    assert with_store(tmp_path / "whole", body, whole=True)[:1] == b"a"
    assert with_store(tmp_path / "pieces", body)[:1] == pieces.FORMAT
    asyncio.run(asyncio.sleep(0))
