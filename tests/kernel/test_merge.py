"""Unit tests of superkernel.merge: pure functions, no processes."""
from __future__ import annotations

import pytest

from superkernel.merge import (
    ErrorInfo,
    LineSplitter,
    ProgressUpdate,
    StreamMerger,
    display_token,
    format_ranks,
    group_errors,
    merge_results,
    parse_ranks,
    render_lines,
    split_displays,
)


@pytest.mark.parametrize(
    "ranks, text",
    [([1], "rank 1"), ([0, 1, 2, 3], "ranks 0-3"), ([0, 2], "ranks 0,2"), ([3, 0, 1, 2, 5], "ranks 0-3,5"),
     ([0, 1], "ranks 0,1"), ([0, 1, 2, 4, 5, 6, 9], "ranks 0-2,4-6,9")],
)
def test_format_ranks(ranks, text):
    assert format_ranks(ranks) == text


def test_parse_ranks():
    assert parse_ranks("0,2-3") == [0, 2, 3]
    assert parse_ranks("all", 3) == [0, 1, 2]
    with pytest.raises(ValueError, match="rank 4 does not exist"):
        parse_ranks("1,4", 4)
    with pytest.raises(ValueError):
        parse_ranks("x")


def test_line_splitter_carriage_return():
    s = LineSplitter()
    assert s.feed("a\nb") == ["a"]
    assert s.progress is None
    assert s.feed("\n 10%\r 20%") == ["b"]
    assert s.progress == " 20%"
    assert s.feed("\r100%\n") == ["100%"]
    assert s.feed("x\r\ny") == ["x"]
    assert s.flush() == ["y"]


def _collapse(merger: StreamMerger, per_rank: dict[int, list[str]]) -> list[tuple[tuple[int, ...], str]]:
    for r, lines in per_rank.items():
        merger.add(r, "".join(l + "\n" for l in lines), 0.0)
    return merger.take(0.0, final=True)


def test_identical_lines_collapse_and_order_is_kept():
    m = StreamMerger([0, 1, 2, 3])
    out = _collapse(m, {r: ["hello", f"I am {r}", "bye"] for r in range(4)})
    assert out[0] == ((0, 1, 2, 3), "hello")
    assert [o for o in out[1:5]] == [((r,), f"I am {r}") for r in range(4)]
    assert out[5] == ((0, 1, 2, 3), "bye")
    text = render_lines(out)
    assert text.splitlines()[0] == "[ranks 0-3] hello"
    assert "[rank 2] I am 2" in text


def test_identical_displays_collapse_in_place_among_lines():
    png = {"data": {"image/png": "iVBOR..."}, "metadata": {}}
    other = {"data": {"image/png": "iVBOR-other"}, "metadata": {}}
    m = StreamMerger([0, 1, 2])
    for r in range(3):
        m.add(r, "before\n", now=0.0)
        m.add_item(r, display_token(other if r == 2 else png), now=0.0)
        m.add(r, "after\n", now=0.0)
        m.finish(r)
    runs = split_displays(m.take(now=10.0, final=True))
    assert [kind for kind, _ in runs] == ["text", "display", "display", "text"]
    assert runs[0][1] == [((0, 1, 2), "before")]
    assert runs[1][1] == [((0, 1), display_token(png))]
    assert runs[2][1] == [((2,), display_token(other))]
    assert runs[3][1] == [((0, 1, 2), "after")]
    assert display_token(png) != display_token(other) and display_token(png) != "before"


def test_display_ends_an_unfinished_line_first():
    m = StreamMerger([0])
    m.add(0, "no newline yet", now=0.0)
    m.add_item(0, display_token({"data": {"text/html": "<b>x</b>"}}), now=0.0)
    out = m.take(now=10.0, final=True)
    assert [line for _, line in out][0] == "no newline yet" and len(out) == 2


def test_render_labels_a_run_once():
    groups = [((0, 1), "a"), ((0, 1), "b"), ((1,), "c"), ((0, 1), "d")]
    assert render_lines(groups) == "[ranks 0,1] a\n            b\n[rank 1] c\n[ranks 0,1] d\n"
    assert render_lines([((0, 1), "e")], after=(0, 1)) == "            e\n"
    assert render_lines(groups, label=False) == "a\nb\nc\nd\n"


def test_extra_line_on_one_rank_does_not_break_collapse():
    m = StreamMerger([0, 1])
    out = _collapse(m, {0: ["a", "only rank 0", "b"], 1: ["a", "b"]})
    assert out == [((0, 1), "a"), ((0,), "only rank 0"), ((0, 1), "b")]


def test_per_rank_order_is_kept_under_any_interleaving():
    m = StreamMerger([0, 1, 2])
    per = {0: ["x", "y", "z", "x"], 1: ["z", "y", "x"], 2: ["y", "y"]}
    out = _collapse(m, per)
    for r, lines in per.items():
        assert [line for rs, line in out if r in rs] == lines


def test_live_hold_waits_for_slow_rank_then_gives_up():
    m = StreamMerger([0, 1], hold=0.1)
    m.add(0, "same\n", now=0.0)
    assert m.take(now=0.05) == []          # rank 1 might print the same line
    m.add(1, "same\n", now=0.06)
    assert m.take(now=0.07) == [((0, 1), "same")]
    m.add(0, "lonely\n", now=1.0)
    assert m.take(now=1.05) == []
    assert m.take(now=1.2) == [((0,), "lonely")]   # not forever


def test_last_lines_of_a_finished_rank_wait_a_little_longer_for_the_others():
    m = StreamMerger([0, 1], hold=0.1, finish_hold=1.0)
    m.add(0, "last\n", now=0.0)
    m.finish(0, now=0.0)
    assert m.take(now=0.5) == []
    m.add(1, "last\n", now=0.6)
    assert m.take(now=0.6) == [((0, 1), "last")]
    m2 = StreamMerger([0, 1], hold=0.1, finish_hold=1.0)
    m2.add(0, "last\n", now=0.0)
    m2.finish(0, now=0.0)
    assert m2.take(now=1.1) == [((0,), "last")]


def test_finished_rank_does_not_hold_others():
    m = StreamMerger([0, 1], hold=10.0)
    m.finish(1)
    m.add(0, "go\n", now=0.0)
    assert m.take(now=0.0) == [((0,), "go")]


def test_raw_mode_labels_every_rank():
    m = StreamMerger([0, 1], mode="raw")
    out = _collapse(m, {0: ["a"], 1: ["a"]})
    assert out == [((0,), "a"), ((1,), "a")]


def test_line_cap_notes_dropped_lines():
    m = StreamMerger([0, 1], max_lines=3)
    out = _collapse(m, {0: [str(i) for i in range(10)], 1: [str(i) for i in range(5)]})
    assert [line for rs, line in out[:3]] == ["0", "1", "2"]
    notes = [line for rs, line in out if line.startswith("…")]
    assert notes[0].startswith("… 7 more lines from rank 0")
    assert notes[1].startswith("… 2 more lines from rank 1")


def test_progress_lines_update_in_place_per_rank():
    m = StreamMerger([0, 1])
    m.add(0, "\r 10%", 0.0)
    m.add(1, "\r 10%", 0.0)
    m.add(0, "\r 50%", 0.0)
    assert m.progress_updates() == [ProgressUpdate(0, " 10%"), ProgressUpdate(1, " 10%"), ProgressUpdate(0, " 50%")]
    m.add(0, "\r100%\ndone\n", 0.0)
    assert m.progress_updates() == [ProgressUpdate(0, "100%", done=True)]
    m.finish(1)
    assert m.progress_updates() == [ProgressUpdate(1, " 10%", done=True)]
    assert m.take(0.0, final=True) == [((0,), "done")]


def test_merge_results():
    same = merge_results({0: {"text/plain": "4"}, 1: {"text/plain": "4"}})
    assert same == {"text/plain": "[ranks 0,1] 4"}
    diff = merge_results({0: {"text/plain": "0"}, 1: {"text/plain": "1"}, 2: {"text/plain": "0"}})
    assert diff["text/plain"] == "[ranks 0,2] 0\n[rank 1] 1"
    assert merge_results({0: {"text/plain": "7"}}) == {"text/plain": "7"}


def test_group_errors():
    tb = ("Traceback", "ZeroDivisionError: division by zero")
    errs = {r: ErrorInfo("ZeroDivisionError", "division by zero", tb) for r in range(4)}
    errs[2] = ErrorInfo("KeyError", "'x'", ("Traceback", "KeyError: 'x'"))
    content = group_errors(errs)
    assert content["ename"] == "ZeroDivisionError"
    assert content["evalue"].startswith("[ranks 0,1,3] division by zero")
    heads = [l for l in content["traceback"] if "[rank" in l]
    assert len(heads) == 2
    assert "KeyError" in heads[1] and "[rank 2]" in heads[1]
