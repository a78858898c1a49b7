"""StreamGuard: clients never see stop strings or the start of tool-call markup."""

from __future__ import annotations

from reefd.engines.stream import StreamGuard


def feed_all(guard: StreamGuard, pieces: list[str]) -> str:
    return "".join(guard.feed(p) for p in pieces)


def test_plain_text_passes_through() -> None:
    g = StreamGuard([], hold_tool_markup=False)
    assert feed_all(g, ["Hel", "lo", " <b>"]) == "Hello <b>"


def test_stop_string_split_across_deltas_is_never_shown() -> None:
    g = StreamGuard(["END"], hold_tool_markup=False)
    assert g.feed("abc E") == "abc "
    assert g.feed("N") == ""
    assert g.feed("D and more") == ""
    assert g.emitted == "abc "


def test_held_prefix_is_released_when_it_turns_out_harmless() -> None:
    g = StreamGuard(["END"], hold_tool_markup=False)
    assert g.feed("x E") == "x "
    assert g.feed("ND?") == ""  # "END" completed: cut
    g2 = StreamGuard(["END"], hold_tool_markup=False)
    assert g2.feed("x E") == "x "
    assert g2.feed("very") == "Every"


def test_tool_markup_is_held_and_tail_pays_what_is_owed() -> None:
    g = StreamGuard([], hold_tool_markup=True)
    assert g.feed("Sure <tool") == "Sure "
    assert g.feed('_call>{"name"') == ""
    assert g.tail("Sure") == ""  # the final content is the text before the call
    g2 = StreamGuard([], hold_tool_markup=True)
    assert g2.feed("a <to") == "a "
    assert g2.tail("a <to") == "<to"  # generation ended: the held text was just text
