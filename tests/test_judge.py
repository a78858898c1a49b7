"""The judge (reefd/grow/judge.py): vote parsing, the plurality, hint selection, and a judgment stored as a report
with `source: judge` in a real record store, whatever the judge answers. The daemon's use of it is in
tests/e2e/test_openclaw.py."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from reefd.engines import EngineUnavailable, ModelConfig
from reefd.grow.judge import Judges, JudgeSettings, Unreachable, parse_hint, parse_vote, plurality, select_hints
from reefd.observe.records import RecordStore, new_receipt
from reefd.serve.chat import Completion


def test_the_last_boxed_value_is_the_vote() -> None:
    assert parse_vote("first \\boxed{-1}, on reflection \\boxed{1}") == 1
    assert parse_vote("\\boxed{ 0 }") == 0
    assert parse_vote("\\boxed{+1}") == 1
    assert parse_vote("\\boxed{2}") is None  # not a verdict
    assert parse_vote("\\boxed{yes}") is None and parse_vote("no box") is None
    assert parse_vote(None) is None and parse_vote(12) is None
    assert parse_vote("\\boxed{0}", allowed=(1, -1)) is None  # a hint vote is 1 or -1


def test_the_plurality_wins_and_a_tie_or_nothing_gives_zero() -> None:
    assert plurality([1, 1, -1]) == 1
    assert plurality([-1, None, None]) == -1
    assert plurality([1, -1, 0]) == 0  # three-way tie
    assert plurality([1, -1, None]) == 0  # two-way tie
    assert plurality([None, None, None]) == 0 and plurality([]) == 0


def test_hints_are_long_enough_unique_shortest_first_at_most_three() -> None:
    def vote(hint: str, box: int = 1) -> str:
        return f"\\boxed{{{box}}} [HINT_START] {hint} [HINT_END]"

    answers = [vote("Start every answer with OK:."), vote("too short"), vote("Start every answer with OK:."),
               vote("Say OK: first, always."), vote("A hint from a vote that says no.", box=-1),
               vote("Begin with the literal text OK: and a space."), vote("Open with OK: please, every time."),
               None, "garbage"]
    assert select_hints(answers, limit=3) == ["Say OK: first, always.", "Start every answer with OK:.",
                                              "Open with OK: please, every time."]
    assert parse_hint("[HINT_START]a[HINT_END] then [HINT_START]\nb\n[HINT_END]") == "b"


class Engine:
    """An engine stand-in: down (not ready), or answering every vote with `text`."""

    def __init__(self, text: str | None) -> None:
        self.text, self.calls = text, 0

    @property
    def ready(self) -> bool:
        return self.text is not None

    def describe(self) -> dict[str, Any]:
        return {"state": "ready" if self.ready else "starting"}

    async def generate(self, req: Any, **kw: Any) -> Any:
        self.calls += 1
        if self.text is None:
            raise EngineUnavailable("down", retry_after=1)
        yield Completion(text=self.text, finish_reason="stop", prompt_tokens=1, completion_tokens=1)


async def _judged(tmp_path: Path, settings: JudgeSettings, engine: Any = None) -> tuple[Judges, RecordStore, str]:
    store = RecordStore(tmp_path / "records")
    await store.open()
    receipt = new_receipt()
    await store.put_record({"id": receipt, "scenario": "s", "turn_kind": "main",
                            "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]})
    follow = {"id": new_receipt(), "scenario": "s", "previous": receipt}
    assert await store.put_record(follow, next_state=[{"role": "user", "content": "start your answer with OK:"}])
    registry = SimpleNamespace(scenarios={"s": SimpleNamespace(recipe=SimpleNamespace(judge=settings), engine=engine,
                                                              cfg=SimpleNamespace(model=ModelConfig()))})
    return Judges(registry, store), store, receipt  # type: ignore[arg-type]


@pytest.mark.parametrize("judge", ["garbage", "failing", "split"])
def test_a_judge_that_answers_garbage_fails_or_ties_gives_zero(tmp_path: Path, judge: str) -> None:
    async def body() -> None:
        judges, store, receipt = await _judged(tmp_path, JudgeSettings(model=f"tests.recipes.judges:{judge}"))
        report = await judges.judge("s", receipt)
        assert report is not None and report["source"] == "judge" and report["score"] == 0.0
        assert report["metadata"]["verdict"] == 0 and report["metadata"]["hints"] == []
        assert store.get_record(receipt)["reports"] == [report]
        assert await judges.judge("s", receipt) is None  # judged once
        await store.close()

    asyncio.run(body())


def test_a_timed_out_vote_is_invalid(tmp_path: Path) -> None:
    async def body() -> None:
        judges, store, receipt = await _judged(tmp_path, JudgeSettings(model="tests.recipes.judges:slow",
                                                                       timeout_s=0.05, votes=1, hints=False))
        report = await judges.judge("s", receipt)
        assert report is not None and report["metadata"]["votes"] == [None] and report["score"] == 0.0
        await store.close()

    asyncio.run(body())


def test_the_scripted_judge_gives_a_verdict_and_a_hint(tmp_path: Path) -> None:
    async def body() -> None:
        judges, store, receipt = await _judged(tmp_path, JudgeSettings(model="tests.recipes.judges:scripted"))
        report = await judges.judge("s", receipt)
        assert report is not None
        meta = report["metadata"]
        assert meta["votes"] == [-1, -1, -1] and meta["verdict"] == -1 and report["score"] == -1.0
        assert meta["hints"] == ["Start every answer with 'OK:'."] and meta["hint_votes"] == [1, 1, 1]
        assert meta["judge"] == "function tests.recipes.judges:scripted"
        await store.close()

    asyncio.run(body())


def test_a_judge_engine_that_is_down_delays_the_judgment(tmp_path: Path) -> None:
    async def body() -> None:
        engine = Engine(None)
        judges, store, receipt = await _judged(tmp_path, JudgeSettings(retry_s=0.1, votes=2, hints=False),
                                               engine)
        with pytest.raises(Unreachable):
            await judges.judge("s", receipt)
        judges.linked("s", receipt)  # the background queue: tried, found down, tried again later
        for _ in range(100):
            if judges.status("s")["unreachable"]:
                break
            await asyncio.sleep(0.02)
        assert judges.status("s")["pending"] == 1 and store.get_record(receipt)["reports"] == []
        engine.text = "fine \\boxed{1}"  # the judge comes back
        for _ in range(200):
            if judges.status("s")["pending"] == 0:
                break
            await asyncio.sleep(0.02)
        assert judges.status("s")["judged"] == 1
        assert store.get_record(receipt)["reports"][0]["score"] == 1.0
        await judges.close()
        await store.close()

    asyncio.run(body())


def test_a_judge_model_of_its_own_is_an_upstream_provider(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Contract test: the judge is a `model:` config of its own, here the `upstream` engine against
    tests/fake_upstream.py (a hosted provider stands in), started once and kept until the judges close."""
    import aiohttp

    from tests.fake_upstream import SEEN, build
    from tests.served import aiohttp_in_thread

    monkeypatch.setenv("UP_KEY", "up-key")
    answer = tmp_path / "answer.txt"
    answer.write_text("It worked. \\boxed{1} [HINT_START]Start every answer with 'OK:'.[HINT_END]")
    app = build(str(answer))
    with aiohttp_in_thread(app) as url:
        async def body() -> None:
            model = {"name": "judge", "engine": "upstream", "url": f"{url}/v1", "api_key_env": "UP_KEY",
                     "upstream_model": "judge-model"}
            judges, store, receipt = await _judged(tmp_path, JudgeSettings(model=model, votes=3))
            async with aiohttp.ClientSession() as session:
                judges.registry.state_dir, judges.registry.session = tmp_path, session  # type: ignore[attr-defined]
                report = None
                for _ in range(100):  # the engine of its own starts on first use: until then the turn waits
                    try:
                        report = await judges.judge("s", receipt)
                        break
                    except Unreachable:
                        await asyncio.sleep(0.05)
                assert report is not None and report["score"] == 1.0, report["metadata"]["answers"]
                assert report["metadata"]["hints"] == ["Start every answer with 'OK:'."]
                assert report["metadata"]["judge"] == "model judge"
                await judges.close()
            await store.close()

        asyncio.run(body())
    sent = [r["body"] for r in app[SEEN]]
    assert len(sent) == 6 and {b["model"] for b in sent} == {"judge-model"}  # 3 verdict + 3 hint votes
    assert sum("hint" in b["messages"][0]["content"] for b in sent) == 3
    assert all("start your answer with OK:" in b["messages"][1]["content"] for b in sent)  # the next state
