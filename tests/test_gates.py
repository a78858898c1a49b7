"""Gates against real task files in tmp_path and a scripted `generate`: the callback stands in for the
engine, whose answers a gate only scores (no model, no daemon)."""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

import pytest

from reefd.commit import gates
from reefd.commit.gates import GateError, Generate, Sampling, Task, Verdict, build, load_tasks, scorer

CAND, CUR = "cand", "cur"
NOT_CALLABLE = 42


def length_score(text: str, task: Task) -> float:
    """A user's scorer: the share of the expected answer's length that the text reaches."""
    return min(1.0, len(text.strip()) / len(str(task.answer)))


def too_high(text: str, task: Task) -> float:
    return 2.0


def not_a_number(text: str, task: Task) -> float:
    return math.nan


def crashes(text: str, task: Task) -> float:
    raise KeyError("boom")


def write_tasks(folder: Path, n: int, name: str = "tasks.jsonl") -> str:
    """n tasks `q<i>` -> `a<i>`; returns the name relative to `folder` (the scenarios folder)."""
    lines = [json.dumps({"prompt": f"q{i}", "answer": f"a{i}"}) for i in range(n)]
    (folder / name).write_text("\n".join(lines) + "\n", encoding="utf-8")
    return name


def config(**kw: Any) -> dict[str, Any]:
    """A scenario's `gate:` mapping (kind always unless given)."""
    return {"kind": "always", **kw}


def evaluate(cfg: dict[str, Any], folder: Path, generate: Generate, **kw: Any) -> Awaitable[Verdict]:
    """The gate that the mapping `cfg` declares (tasks relative to `folder`), judging with `generate`."""
    return build(cfg, folder).evaluate(generate, **kw)


def check_config(cfg: dict[str, Any], folder: Path) -> str | None:
    """What `reefd --check` reports about a `gate:` mapping."""
    try:
        return build(cfg, folder).check()
    except GateError as exc:
        return str(exc)


def fingerprint(cfg: dict[str, Any], folder: Path, context: dict[str, Any] | None = None) -> str:
    return gates.fingerprint(build(cfg, folder).cfg, folder, context)  # type: ignore[attr-defined]


class Engine:
    """Scripted answers: adapter -> the task indices it gets right; records every call in order."""

    def __init__(self, right: dict[str | None, set[int]], wrong: str = " nope ") -> None:
        self.right = right
        self.wrong = wrong
        self.calls: list[tuple[int, str | None, int]] = []
        self.in_flight = 0
        self.max_in_flight = 0

    async def __call__(self, messages: list[dict[str, Any]], adapter: str | None, cfg: Sampling,
                       seed: int) -> str:
        i = int(messages[-1]["content"][1:])
        self.calls.append((i, adapter, seed))
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        self.in_flight -= 1
        return f" a{i}\n" if i in self.right[adapter] else self.wrong


def run(cfg: Sampling, folder: Path, engine: Generate, concurrency: int = 4,
        current: str | None = CUR, candidate: str | None = CAND) -> Verdict:
    return asyncio.run(evaluate(cfg, folder, engine, current=current, candidate=candidate,
                                concurrency=concurrency))


def holdout(tasks: str, **kw: Any) -> dict[str, Any]:
    return config(kind="holdout", tasks=tasks, **kw)


# ---------------------------------------------------------------- kinds and pass rules


def test_always_passes_without_generating(tmp_path: Path) -> None:
    engine = Engine({})
    verdict = run(config(kind="always"), tmp_path, engine)
    assert verdict.passed and verdict.kind == "always" and verdict.tasks == 0
    assert verdict.candidate_mean is None and verdict.current_mean is None
    assert engine.calls == []


def test_holdout_passes_by_margin(tmp_path: Path) -> None:
    tasks = write_tasks(tmp_path, 4)
    engine = Engine({CAND: {0, 1, 2}, CUR: {0}})
    verdict = run(holdout(tasks, margin=0.5), tmp_path, engine)
    assert verdict.passed, verdict.reason
    assert (verdict.candidate_mean, verdict.current_mean, verdict.tasks) == (0.75, 0.25, 4)
    assert verdict.reason == "candidate 0.750 vs current 0.250 on 4 tasks: +0.500 (needs >= +0.5)"
    assert verdict.per_task == [{"candidate": 1.0, "current": 1.0}, {"candidate": 1.0, "current": 0.0},
                                {"candidate": 1.0, "current": 0.0}, {"candidate": 0.0, "current": 0.0}]
    failed = run(holdout(tasks, margin=0.6), tmp_path, Engine({CAND: {0, 1, 2}, CUR: {0}}))
    assert not failed.passed
    assert failed.reason.endswith("+0.500 (needs >= +0.6)")


def test_holdout_margin_survives_float_rounding(tmp_path: Path) -> None:
    tasks = write_tasks(tmp_path, 10)
    engine = Engine({CAND: set(range(7)), CUR: set(range(6))})  # 0.7 - 0.6 == 0.09999999999999998
    assert run(holdout(tasks, margin=0.1), tmp_path, engine).passed


def test_holdout_tie_fails_at_margin_zero(tmp_path: Path) -> None:
    tasks = write_tasks(tmp_path, 4)
    tie = run(holdout(tasks), tmp_path, Engine({CAND: {0, 1}, CUR: {2, 3}}))
    assert not tie.passed
    assert tie.reason == "candidate 0.500 vs current 0.500 on 4 tasks: +0.000 (needs > 0)"
    assert run(holdout(tasks), tmp_path, Engine({CAND: {0, 1, 2}, CUR: {2, 3}})).passed


def test_holdout_negative_margin_tolerates_regression(tmp_path: Path) -> None:
    tasks = write_tasks(tmp_path, 4)
    engine = Engine({CAND: {0, 1, 2}, CUR: {0, 1, 2, 3}})
    assert run(holdout(tasks, margin=-0.25), tmp_path, engine).passed
    assert not run(holdout(tasks, margin=-0.2), tmp_path, engine).passed


def test_holdout_base_model_is_none(tmp_path: Path) -> None:
    tasks = write_tasks(tmp_path, 2)
    engine = Engine({CAND: {0, 1}, None: set()})
    assert run(holdout(tasks), tmp_path, engine, current=None).passed
    assert {adapter for _, adapter, _ in engine.calls} == {CAND, None}


def test_holdout_floor_must_be_met_too(tmp_path: Path) -> None:
    tasks = write_tasks(tmp_path, 4)
    verdict = run(holdout(tasks, floor=0.75), tmp_path, Engine({CAND: {0, 1}, CUR: set()}))
    assert not verdict.passed
    assert verdict.reason.endswith("(needs > 0), floor 0.75 missed")
    assert run(holdout(tasks, floor=0.5), tmp_path, Engine({CAND: {0, 1}, CUR: set()})).passed


def test_too_few_tasks_is_a_failed_verdict(tmp_path: Path) -> None:
    tasks = write_tasks(tmp_path, 2)
    engine = Engine({CAND: {0, 1}, CUR: set()})
    verdict = run(holdout(tasks, min_tasks=3), tmp_path, engine)
    assert not verdict.passed
    assert verdict.reason == "2 tasks, fewer than min_tasks 3"
    assert verdict.tasks == 2 and verdict.candidate_mean is None and verdict.per_task == []
    assert engine.calls == []


def test_floor_kind_asks_only_the_candidate(tmp_path: Path) -> None:
    tasks = write_tasks(tmp_path, 4)
    engine = Engine({CAND: {0, 1, 2}})
    verdict = run(config(kind="floor", tasks=tasks, floor=0.75), tmp_path, engine)
    assert verdict.passed, verdict.reason
    assert verdict.reason == "candidate 0.750 on 4 tasks, floor 0.75 met"
    assert verdict.current_mean is None
    assert verdict.per_task[3] == {"candidate": 0.0, "current": None}
    assert {adapter for _, adapter, _ in engine.calls} == {CAND}
    missed = run(config(kind="floor", tasks=tasks, floor=0.8), tmp_path, engine)
    assert not missed.passed and missed.reason.endswith("floor 0.8 missed")


def test_floor_kind_without_floor_is_a_config_error(tmp_path: Path) -> None:
    tasks = write_tasks(tmp_path, 1)
    with pytest.raises(GateError, match=r"^gate\.floor: a floor gate needs a floor$"):
        run(config(kind="floor", tasks=tasks), tmp_path, Engine({}))


def test_missing_tasks_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(GateError, match=r"gate\.tasks: .*nowhere\.jsonl: tasks file not found"):
        run(holdout("nowhere.jsonl"), tmp_path, Engine({}))


# ---------------------------------------------------------------- sampling and concurrency


def test_samples_are_averaged_with_shared_seeds(tmp_path: Path) -> None:
    tasks = write_tasks(tmp_path, 3)

    class Seeded(Engine):
        async def __call__(self, messages: list[dict[str, Any]], adapter: str | None, cfg: Sampling,
                           seed: int) -> str:
            assert (cfg.max_tokens, cfg.temperature) == (7, 0.8)
            text = await super().__call__(messages, adapter, cfg, seed)
            # the candidate is right on even seeds, the current release on seeds divisible by 3
            good = seed % 2 == 0 if adapter == CAND else seed % 3 == 0
            return text if good else self.wrong

    engine = Seeded({CAND: {0, 1, 2}, CUR: {0, 1, 2}})
    cfg = holdout(tasks, samples=2, seed=10, max_tokens=7, temperature=0.8)
    verdict = run(cfg, tmp_path, engine, concurrency=1)
    # seed = cfg.seed + task * samples + sample, the same for both sides, which alternate
    assert engine.calls == [(0, CAND, 10), (0, CUR, 10), (0, CAND, 11), (0, CUR, 11),
                            (1, CAND, 12), (1, CUR, 12), (1, CAND, 13), (1, CUR, 13),
                            (2, CAND, 14), (2, CUR, 14), (2, CAND, 15), (2, CUR, 15)]
    assert verdict.per_task == [{"candidate": 0.5, "current": 0.0}, {"candidate": 0.5, "current": 0.5},
                                {"candidate": 0.5, "current": 0.5}]
    assert verdict.candidate_mean == 0.5 and verdict.current_mean == pytest.approx(1 / 3)
    assert verdict.passed


def test_generation_is_bounded_and_every_job_runs_once(tmp_path: Path) -> None:
    tasks = write_tasks(tmp_path, 10)
    engine = Engine({CAND: set(range(10)), CUR: set()})
    run(holdout(tasks, samples=2), tmp_path, engine, concurrency=3)
    assert engine.max_in_flight == 3
    assert sorted(engine.calls) == sorted((i, side, i * 2 + s) for i in range(10) for s in range(2)
                                          for side in (CAND, CUR))


def test_engine_errors_propagate_and_stop_the_rest(tmp_path: Path) -> None:
    tasks = write_tasks(tmp_path, 20)
    engine = Engine({CAND: set(range(20)), CUR: set()})

    async def flaky(messages: list[dict[str, Any]], adapter: str | None, cfg: Sampling, seed: int) -> str:
        if seed == 3:
            raise TimeoutError("engine call deadline")
        return await engine(messages, adapter, cfg, seed)

    with pytest.raises(TimeoutError, match="engine call deadline"):
        run(holdout(tasks), tmp_path, flaky, concurrency=2)
    assert len(engine.calls) < 40 - 2


def test_generate_gets_a_copy_of_the_messages(tmp_path: Path) -> None:
    tasks = write_tasks(tmp_path, 1)
    engine = Engine({CAND: {0}, CUR: {0}})

    async def mutating(messages: list[dict[str, Any]], adapter: str | None, cfg: Sampling, seed: int) -> str:
        text = await engine(messages, adapter, cfg, seed)
        messages.append({"role": "assistant", "content": text})
        return text

    run(holdout(tasks, samples=3), tmp_path, mutating)
    assert len(engine.calls) == 6  # each call still saw the task's one user message


def test_concurrency_must_be_positive(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="concurrency"):
        run(config(kind="always"), tmp_path, Engine({}), concurrency=0)


# ---------------------------------------------------------------- scorers


def task(answer: Any, where: str = "t.jsonl:7") -> Task:
    return Task(messages=[{"role": "user", "content": "q"}], answer=answer, raw={"answer": answer}, where=where)


def test_exact_scorer_strips_and_stringifies() -> None:
    exact = scorer("exact")
    assert exact("  42\n", task(42)) == 1.0
    assert exact("42.0", task(42)) == 0.0
    assert exact("Paris", task(" Paris ")) == 1.0


def test_regex_scorer_searches_and_names_a_bad_pattern() -> None:
    regex = scorer("regex")
    assert regex("the answer is 42.", task(r"\b42\b")) == 1.0
    assert regex("the answer is 421", task(r"\b42\b")) == 0.0
    with pytest.raises(GateError, match=r"^t\.jsonl:3: bad regex '\(unclosed'"):
        regex("x", task("(unclosed", where="t.jsonl:3"))
    with pytest.raises(GateError, match=r"^t\.jsonl:7: the regex scorer needs a string answer"):
        regex("42", task(42))


def test_regex_scorer_in_a_gate(tmp_path: Path) -> None:
    lines = [{"prompt": "q0", "answer": r"^\s*a0\b"}, {"prompt": "q1", "answer": "a1$"}]
    (tmp_path / "re.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines), encoding="utf-8")
    verdict = run(config(kind="floor", tasks="re.jsonl", scorer="regex", floor=1.0), tmp_path,
                  Engine({CAND: {0, 1}}))
    assert verdict.passed, verdict.reason


def test_dotted_path_scorer(tmp_path: Path) -> None:
    fn = scorer("tests.test_gates:length_score")
    assert fn("ab", task("abcd")) == 0.5
    tasks = write_tasks(tmp_path, 2)
    verdict = run(config(kind="floor", tasks=tasks, scorer="tests.test_gates:length_score", floor=0.5),
                  tmp_path, Engine({CAND: {0}}, wrong="x"))
    assert verdict.per_task == [{"candidate": 1.0, "current": None}, {"candidate": 0.5, "current": None}]
    assert verdict.passed


@pytest.mark.parametrize(("spec", "message"), [
    ("tests.no_such_module:fn", r"scorer 'tests\.no_such_module:fn': cannot import tests\.no_such_module: "
                                r"ModuleNotFoundError"),
    ("tests.test_gates:missing", r"scorer 'tests\.test_gates:missing': tests\.test_gates has no 'missing'"),
    ("tests.test_gates:NOT_CALLABLE", r"int is not callable"),
    ("fuzzy", r"scorer 'fuzzy': expected exact, regex or a dotted path pkg\.mod:fn"),
])
def test_bad_scorer_specs(spec: str, message: str) -> None:
    with pytest.raises(GateError, match=message):
        scorer(spec)


@pytest.mark.parametrize(("fn", "message"), [
    ("too_high", r"^t\.jsonl:7: scorer 'tests\.test_gates:too_high' returned 2\.0, not a number in \[0, 1\]$"),
    ("not_a_number", r"^t\.jsonl:7: scorer .* returned nan, not a number in \[0, 1\]$"),
    ("crashes", r"^t\.jsonl:7: scorer 'tests\.test_gates:crashes' failed: KeyError: 'boom'$"),
])
def test_bad_scores_name_the_task(fn: str, message: str) -> None:
    with pytest.raises(GateError, match=message):
        scorer(f"tests.test_gates:{fn}")("x", task("x"))


def test_bad_score_stops_the_gate(tmp_path: Path) -> None:
    tasks = write_tasks(tmp_path, 3)
    with pytest.raises(GateError, match=r"tasks\.jsonl:1: scorer .* returned 2\.0"):
        run(holdout(tasks, scorer="tests.test_gates:too_high"), tmp_path, Engine({CAND: set(), CUR: set()}))


# ---------------------------------------------------------------- task files


def test_load_tasks_reads_strings_and_message_lists(tmp_path: Path) -> None:
    messages = [{"role": "system", "content": "Answer tersely."}, {"role": "user", "content": "2+2?"}]
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"prompt": "hi", "answer": "hello", "tag": "x"}) + "\n\n  \n"
                    + json.dumps({"prompt": messages, "answer": 4}) + "\n", encoding="utf-8")
    first, second = load_tasks(path)
    assert first == Task([{"role": "user", "content": "hi"}], "hello", {"prompt": "hi", "answer": "hello", "tag": "x"},
                         f"{path}:1")
    assert second.messages == messages and second.answer == 4 and second.where == f"{path}:4"


def test_load_tasks_keeps_line_separators_inside_strings(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text('{"prompt": "a\u2028b", "answer": "c"}\n', encoding="utf-8")
    assert load_tasks(path)[0].messages[0]["content"] == "a\u2028b"


@pytest.mark.parametrize(("line", "message"), [
    ('{"prompt": "q", "answer": ', r"not valid JSON: Expecting value \(column 27\)"),
    ('["q", "a"]', r"a task is a JSON object, not list"),
    ('{"answer": "a"}', r"missing 'prompt'"),
    ('{"prompt": "q"}', r"missing 'answer'"),
    ('{"prompt": 3, "answer": "a"}', r"'prompt' must be a string or a non-empty list of chat messages"),
    ('{"prompt": [], "answer": "a"}', r"'prompt' must be a string or a non-empty list of chat messages"),
    ('{"prompt": [{"content": "q"}], "answer": "a"}', r"prompt\[0\] is not a chat message"),
])
def test_bad_task_lines_name_file_and_line(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text('{"prompt": "ok", "answer": "ok"}\n\n' + line + "\n", encoding="utf-8")
    with pytest.raises(GateError, match=rf"^{path}:3: {message}"):
        load_tasks(path)


def test_missing_tasks_file(tmp_path: Path) -> None:
    with pytest.raises(GateError, match=r"nope\.jsonl: tasks file not found$"):
        load_tasks(tmp_path / "nope.jsonl")


# ---------------------------------------------------------------- verdicts and config checks


def test_as_meta_is_json_for_release_meta(tmp_path: Path) -> None:
    tasks = write_tasks(tmp_path, 2)
    verdict = run(holdout(tasks, margin=0.25, floor=0.5), tmp_path, Engine({CAND: {0, 1}, CUR: {0}}))
    meta = json.loads(json.dumps(verdict.as_meta()))
    assert meta == {
        "fingerprint": fingerprint(holdout(tasks, margin=0.25, floor=0.5), tmp_path), "current_reused": False,
        "verdict": "pass", "kind": "holdout", "reason": verdict.reason, "tasks": 2,
        "candidate_mean": 1.0, "current_mean": 0.5, "margin": 0.25, "floor": 0.5,
        "per_task": [{"candidate": 1.0, "current": 1.0}, {"candidate": 1.0, "current": 0.0}],
    }
    failed = run(holdout(tasks, min_tasks=5), tmp_path, Engine({}))
    assert failed.as_meta()["verdict"] == "fail"
    always = run(config(kind="always"), tmp_path, Engine({})).as_meta()
    assert always["verdict"] == "pass" and always["candidate_mean"] is None and always["per_task"] == []


def test_check_config(tmp_path: Path) -> None:
    tasks = write_tasks(tmp_path, 2)
    (tmp_path / "bad.jsonl").write_text("{oops\n", encoding="utf-8")
    assert check_config(config(), tmp_path) is None
    assert check_config(config(kind="always", tasks="x.jsonl"), tmp_path) == \
        "gate: Additional properties are not allowed ('tasks' was unexpected): the always kind has no such key " \
        "(each kind has its own keys; to change the kind, choose its group in the defaults list, e.g. `- gate: floor`)"
    assert check_config(config(kind="floor", tasks=tasks, floor=0.5, margin=0.1), tmp_path) == \
        "gate: Additional properties are not allowed ('margin' was unexpected): the floor kind has no such key " \
        "(each kind has its own keys; to change the kind, choose its group in the defaults list, e.g. `- gate: floor`)"
    assert check_config(config(kind="nope"), tmp_path) == \
        "gate.kind: unknown gate kind 'nope': use one of always, floor, holdout, paired or pkg.mod:Class"
    assert check_config(holdout(tasks), tmp_path) is None
    assert check_config(config(kind="floor", tasks=tasks, floor=0.5, scorer="regex"), tmp_path) is None
    assert check_config(config(kind="holdout"), tmp_path) == "gate.tasks: a holdout gate needs a tasks file"
    assert check_config(config(kind="floor"), tmp_path) == "gate.tasks: a floor gate needs a tasks file"
    assert check_config(holdout("nowhere.jsonl"), tmp_path) == \
        f"gate.tasks: {tmp_path / 'nowhere.jsonl'}: tasks file not found"
    assert check_config(config(kind="floor", tasks=tasks), tmp_path) == "gate.floor: a floor gate needs a floor"
    assert check_config(holdout(tasks, floor=1.5), tmp_path) == "gate.floor: 1.5 is outside [0, 1], where scores lie"
    problem = check_config(holdout(tasks, scorer="tests.no_such_module:fn"), tmp_path)
    assert problem is not None and problem.startswith("gate.scorer: scorer 'tests.no_such_module:fn': cannot import")
    problem = check_config(holdout("bad.jsonl"), tmp_path)
    assert problem is not None and problem.startswith(f"gate.tasks: {tmp_path / 'bad.jsonl'}:1: not valid JSON")
    assert check_config(holdout(tasks, min_tasks=3), tmp_path) == \
        "gate.tasks: tasks.jsonl holds 2 tasks, fewer than min_tasks 3: the gate would always fail"


def test_paired_counts_wins_and_losses(tmp_path: Path) -> None:
    """A harness candidate is judged task by task: published only if wins - losses > min_win_margin."""
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"q{i}", "answer": "yes"}) + "\n" for i in range(5)))

    def gen(answers: dict[str, list[str]]) -> Any:
        async def generate(messages: list[dict[str, Any]], side: str | None, cfg: Sampling, seed: int) -> str:
            return answers[str(side)][int(messages[-1]["content"][1:])]
        return generate

    cfg = config(kind="paired", tasks="t.jsonl", min_win_margin=0)
    answers = {"cand": ["yes", "yes", "yes", "no", "no"], "cur": ["no", "no", "yes", "yes", "no"]}  # 2 wins 1 loss
    verdict = asyncio.run(evaluate(cfg, tmp_path, gen(answers), current="cur", candidate="cand"))
    assert verdict.passed and verdict.reason == (
        "paired on 5 tasks: 2 wins, 1 losses, 2 ties; wins - losses +1 (needs > +0)")
    strict = config(kind="paired", tasks="t.jsonl", min_win_margin=1)
    assert not asyncio.run(evaluate(strict, tmp_path, gen(answers), current="cur", candidate="cand")).passed


# ---------------------------------------------------------------- the current side's scores, reused


def lookup(known: dict[str, list[float]]) -> Any:
    """A `known_current` callback over scores measured earlier, by fingerprint."""
    async def find(digest: str) -> list[float] | None:
        return known.get(digest)

    return find


def test_known_current_scores_stand_in_for_generating_them(tmp_path: Path) -> None:
    tasks = write_tasks(tmp_path, 4)
    cfg = holdout(tasks)
    digest = fingerprint(cfg, tmp_path, {"model": "m"})
    engine = Engine({CAND: {0, 1, 2}, CUR: {0}})
    verdict = asyncio.run(evaluate(cfg, tmp_path, engine, current=CUR, candidate=CAND, context={"model": "m"},
                                   known_current=lookup({digest: [1.0, 1.0, 0.0, 0.0]})))
    assert {adapter for _, adapter, _ in engine.calls} == {CAND}  # the current side was not asked
    assert len(engine.calls) == 4
    assert verdict.current_reused and verdict.fingerprint == digest
    assert verdict.current_mean == 0.5 and verdict.candidate_mean == 0.75 and verdict.passed
    assert [p["current"] for p in verdict.per_task] == [1.0, 1.0, 0.0, 0.0]
    assert "current's scores from its own gate" in verdict.reason
    assert verdict.as_meta()["current_reused"] is True


@pytest.mark.parametrize("known", ["other digest", "wrong length"])
def test_known_scores_of_another_gate_are_not_used(tmp_path: Path, known: str) -> None:
    tasks = write_tasks(tmp_path, 3)
    cfg = holdout(tasks)
    digest = fingerprint(cfg, tmp_path)
    scores = {fingerprint(holdout(tasks, seed=1), tmp_path): [1.0] * 3} if known == "other digest" else {digest: [1.0]}
    engine = Engine({CAND: {0}, CUR: {1, 2}})
    verdict = asyncio.run(evaluate(cfg, tmp_path, engine, current=CUR, candidate=CAND, known_current=lookup(scores)))
    assert {adapter for _, adapter, _ in engine.calls} == {CAND, CUR}
    assert not verdict.current_reused and verdict.current_mean == pytest.approx(2 / 3)


def test_a_floor_gate_asks_only_the_candidate_whatever_is_known(tmp_path: Path) -> None:
    tasks = write_tasks(tmp_path, 2)
    cfg = config(kind="floor", tasks=tasks, floor=0.5)
    engine = Engine({CAND: {0}})
    verdict = asyncio.run(evaluate(cfg, tmp_path, engine, current=CUR, candidate=CAND,
                                   known_current=lookup({fingerprint(cfg, tmp_path): [1.0, 1.0]})))
    assert verdict.passed and verdict.current_mean is None and not verdict.current_reused


def test_the_fingerprint_follows_what_scores_depend_on(tmp_path: Path) -> None:
    tasks = write_tasks(tmp_path, 2)
    base = fingerprint(holdout(tasks), tmp_path, {"model": "m"})
    assert base == fingerprint(holdout(tasks), tmp_path, {"model": "m"})
    assert base == fingerprint(holdout(tasks, margin=0.5, min_tasks=2), tmp_path, {"model": "m"})  # pass rules only
    changed = [fingerprint(holdout(tasks, **kw), tmp_path, {"model": "m"}) for kw in (
        {"seed": 1}, {"temperature": 0.5}, {"max_tokens": 7}, {"samples": 2}, {"scorer": "regex"})]
    changed.append(fingerprint(holdout(tasks), tmp_path, {"model": "other"}))
    (tmp_path / tasks).write_text((tmp_path / tasks).read_text() + '{"prompt": "q9", "answer": "a9"}\n')
    changed.append(fingerprint(holdout(tasks), tmp_path, {"model": "m"}))
    assert len({base, *changed}) == len(changed) + 1
    with pytest.raises(GateError, match="cannot read tasks file"):
        fingerprint(holdout("missing.jsonl"), tmp_path)
