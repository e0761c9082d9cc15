"""Pure functions and small state machines that turn per-rank output into one cell output.

Nothing here does I/O, knows about zmq or imports torch: the kernel feeds text, results and errors in,
and gets back what to publish. Conventions:

* A rank set is printed the way Slurm/MPI users read it: ``[rank 1]``, ``[ranks 0-3]``, ``[ranks 0,2]``.
* Lines keep their order per rank. Identical lines that several ranks print at the same point collapse
  into one line labelled with the rank set (``collapse`` mode) or each rank's lines are printed with their
  own label (``raw`` mode).
* ``\\r`` progress (tqdm) is not a flood of lines: each rank has one progress line, updated in place; the
  kernel shows it through an updatable display (see :class:`ProgressUpdate`).
* A per-rank line cap keeps 64 ranks x 10k lines usable; the rest is summarised as
  ``… N more lines from rank k``.
* Rich output (``display_data``) travels through the stdout merger as a :class:`DisplayToken`, a
  "line" that stands for the display: identical displays from several ranks collapse exactly like
  identical lines (one image labelled with its rank set instead of one per rank), and each rank's
  displays keep their place among its printed lines.
"""
from __future__ import annotations

import hashlib
import json
import re
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

__all__ = [
    "format_ranks",
    "rank_label",
    "parse_ranks",
    "LineSplitter",
    "ProgressUpdate",
    "StreamMerger",
    "DisplayToken",
    "display_token",
    "split_displays",
    "merge_results",
    "group_errors",
    "ErrorInfo",
]


def format_ranks(ranks: Iterable[int]) -> str:
    """``[0, 1, 2, 3]`` -> ``"ranks 0-3"``, ``[0, 2]`` -> ``"ranks 0,2"``, ``[1]`` -> ``"rank 1"``."""
    rs = sorted(set(ranks))
    if not rs:
        return "no ranks"
    if len(rs) == 1:
        return f"rank {rs[0]}"
    parts: list[str] = []
    start = prev = rs[0]
    for r in rs[1:] + [None]:  # type: ignore[list-item]
        if r is not None and r == prev + 1:
            prev = r
            continue
        if prev == start:
            parts.append(str(start))
        elif prev == start + 1:
            parts.append(f"{start},{prev}")
        else:
            parts.append(f"{start}-{prev}")
        if r is not None:
            start = prev = r
    return "ranks " + ",".join(parts)


def rank_label(ranks: Iterable[int]) -> str:
    """``[ranks 0-3]``: the prefix put in front of a merged line."""
    return f"[{format_ranks(ranks)}]"


def parse_ranks(spec: str, world_size: int | None = None) -> list[int]:
    """Parse ``"0,2-3"`` (also ``"all"``, ``"*"``) into a sorted list of ranks; validates against world_size."""
    spec = spec.strip()
    if spec in ("all", "*", ""):
        if world_size is None:
            raise ValueError("'all' needs the world size")
        return list(range(world_size))
    out: set[int] = set()
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        m = re.fullmatch(r"(\d+)\s*-\s*(\d+)", part)
        if m:
            lo, hi = int(m.group(1)), int(m.group(2))
            if hi < lo:
                raise ValueError(f"bad rank range {part!r}")
            out.update(range(lo, hi + 1))
        elif part.isdigit():
            out.add(int(part))
        else:
            raise ValueError(f"bad rank {part!r} in {spec!r} (expected e.g. 0,2-3)")
    if world_size is not None:
        bad = sorted(r for r in out if r >= world_size)
        if bad:
            raise ValueError(f"rank {bad[0]} does not exist (world size {world_size})")
    return sorted(out)


class LineSplitter:
    """Cuts one rank's stream into complete lines and an in-place progress line.

    ``feed(text)`` returns the newly completed lines. A line that was rewritten with ``\\r`` ends as
    what a terminal would show: its last non-empty ``\\r`` segment. The unfinished tail after the last
    ``\\r`` is the *progress* text (``None`` when the tail contains no ``\\r``).
    """

    def __init__(self) -> None:
        self._tail = ""

    def feed(self, text: str) -> list[str]:
        data = self._tail + text.replace("\r\n", "\n")
        *complete, self._tail = data.split("\n")
        return [self._settle(line) for line in complete]

    @staticmethod
    def _settle(line: str) -> str:
        if "\r" not in line:
            return line
        segments = [s for s in line.split("\r") if s]
        return segments[-1] if segments else ""

    @property
    def progress(self) -> str | None:
        """The current in-place line (text after the last ``\\r``), if the tail is a progress line."""
        if "\r" not in self._tail:
            return None
        return self._settle(self._tail)

    def pending(self) -> str:
        """The unfinished tail as a terminal would show it."""
        return self._settle(self._tail)

    def flush(self) -> list[str]:
        """End of the cell: the unfinished tail becomes a line of its own."""
        tail, self._tail = self._tail, ""
        return [self._settle(tail)] if tail else []


@dataclass(frozen=True)
class ProgressUpdate:
    """Rank ``rank``'s in-place progress line is now ``text`` (``done``: the line was finished)."""

    rank: int
    text: str
    done: bool = False


@dataclass
class _RankQueue:
    splitter: LineSplitter = field(default_factory=LineSplitter)
    lines: deque[tuple[float, str]] = field(default_factory=deque)
    queued: Counter[str] = field(default_factory=Counter)  # the texts in ``lines``, for O(1) lookahead
    emitted: int = 0
    dropped: int = 0
    finished: bool = False
    progress: str | None = None


class StreamMerger:
    """Merges one stream (stdout or stderr) of several ranks, live.

    ``add(rank, text, now)`` buffers; ``take(now)`` returns ``(ranks, line)`` pairs ready to print, in
    an order that keeps every rank's own order. In ``collapse`` mode a line is held back up to ``hold``
    seconds waiting for the other unfinished ranks, so that identical lines printed at about the same
    time by several ranks come out once (``finish_hold`` when the lines left belong to ranks that already
    finished the cell: the last lines of a cell tend to arrive together with the rank's reply). ``finish(rank)`` says a rank will print no more for this cell;
    ``take(now, final=True)`` drains everything.
    """

    def __init__(
        self,
        ranks: Sequence[int],
        *,
        mode: str = "collapse",
        hold: float = 0.1,
        finish_hold: float = 1.0,
        max_lines: int = 0,
    ) -> None:
        if mode not in ("collapse", "raw"):
            raise ValueError(f"unknown output mode {mode!r} (collapse|raw)")
        self.mode = mode
        self.hold = hold
        self.finish_hold = finish_hold
        self.max_lines = max_lines
        self._q: dict[int, _RankQueue] = {r: _RankQueue() for r in ranks}
        self._raw_out: list[tuple[tuple[int, ...], str]] = []
        self._progress_updates: list[ProgressUpdate] = []

    # input -------------------------------------------------------------------------------------------
    def add(self, rank: int, text: str, now: float) -> None:
        q = self._q.setdefault(rank, _RankQueue())
        lines = q.splitter.feed(text)
        if lines and q.progress is not None:
            # the in-place line was finished by a newline: it ends as the rank's final progress state
            self._progress_updates.append(ProgressUpdate(rank, lines[0], done=True))
            q.progress = None
            lines = lines[1:]
        for line in lines:
            self._append(rank, q, line, now)
        prog = q.splitter.progress
        if prog is not None and prog != q.progress:
            q.progress = prog
            self._progress_updates.append(ProgressUpdate(rank, prog))

    def add_item(self, rank: int, item: str, now: float) -> None:
        """Queue ``item`` (a :class:`DisplayToken`) as one whole line of ``rank``, after whatever the rank
        printed before it (an unfinished line is ended first, as a terminal would show it)."""
        q = self._q.setdefault(rank, _RankQueue())
        self._end_line(rank, q, now)
        self._append(rank, q, item, now)

    def _end_line(self, rank: int, q: _RankQueue, now: float) -> None:
        """The rank's unfinished line ends: a progress line as its final state, other text as a line."""
        if q.progress is not None:
            self._progress_updates.append(ProgressUpdate(rank, q.splitter.pending(), done=True))
            q.progress = None
            q.splitter.flush()
        for line in q.splitter.flush():
            self._append(rank, q, line, now)

    def _append(self, rank: int, q: _RankQueue, line: str, now: float) -> None:
        if self.max_lines and q.emitted + len(q.lines) >= self.max_lines:
            q.dropped += 1
            return
        if self.mode == "raw":
            q.emitted += 1
            self._raw_out.append(((rank,), line))
        else:
            q.lines.append((now, line))
            q.queued[line] += 1

    def finish(self, rank: int, now: float = 0.0) -> None:
        q = self._q.setdefault(rank, _RankQueue())
        self._end_line(rank, q, now)
        q.finished = True

    # output ------------------------------------------------------------------------------------------
    def progress_updates(self) -> list[ProgressUpdate]:
        out, self._progress_updates = self._progress_updates, []
        return out

    def take(self, now: float, final: bool = False) -> list[tuple[tuple[int, ...], str]]:
        if final:
            for r, q in self._q.items():
                if not q.finished:
                    self.finish(r, now)
        if self.mode == "raw":
            out, self._raw_out = self._raw_out, []
        else:
            out = self._take_collapsed(now, final)
        if final:
            out.extend(self._cap_notes())
        return out

    def _take_collapsed(self, now: float, final: bool) -> list[tuple[tuple[int, ...], str]]:
        out: list[tuple[tuple[int, ...], str]] = []
        while True:
            heads = {r: q.lines[0] for r, q in self._q.items() if q.lines}
            if not heads:
                break
            waiting = [r for r, q in self._q.items() if not q.lines and not q.finished]
            oldest = min(t for t, _ in heads.values())
            # give the silent ranks a moment to print the same line; a little longer when only ranks that
            # already finished the cell have lines left (the others are about to finish too)
            limit = self.finish_hold if all(self._q[r].finished for r in heads) else self.hold
            if waiting and not final and now - oldest < limit:
                break
            groups: dict[str, list[int]] = {}
            for r, (_, line) in sorted(heads.items()):
                groups.setdefault(line, []).append(r)
            if len(groups) == 1:
                ready = list(groups.items())
            else:
                ready = [
                    (line, rs) for line, rs in groups.items() if not self._appears_later(line, rs)
                ] or list(groups.items())
            for line, rs in sorted(ready, key=lambda item: item[1][0]):
                for r in rs:
                    q = self._q[r]
                    q.lines.popleft()
                    q.queued[line] -= 1
                    if not q.queued[line]:
                        del q.queued[line]
                    q.emitted += 1
                out.append((tuple(rs), line))
        return out

    def _appears_later(self, line: str, holders: list[int]) -> bool:
        """Does another rank print ``line`` a little later? Then hold it so the two copies meet."""
        for r, q in self._q.items():
            if r in holders or not q.lines:
                continue
            if q.queued.get(line, 0) > (1 if q.lines[0][1] == line else 0):
                return True
        return False

    def _cap_notes(self) -> list[tuple[tuple[int, ...], str]]:
        by_count: dict[int, list[int]] = {}
        for r, q in sorted(self._q.items()):
            if q.dropped:
                by_count.setdefault(q.dropped, []).append(r)
        return [
            (tuple(rs), f"… {n} more lines from {format_ranks(rs)} (cap {self.max_lines} lines per rank; %output --max-lines)")
            for n, rs in by_count.items()
        ]


class DisplayToken(str):
    """A ``display_data`` message standing in a :class:`StreamMerger` queue as one line.

    Its text is a digest of the message's ``data`` and ``metadata`` (so equal displays compare equal,
    collapse, and never equal a printed line); the kernel keeps the message itself, keyed by the token."""

    __slots__ = ()


def display_token(content: Mapping[str, object]) -> DisplayToken:
    payload = json.dumps({"data": content.get("data") or {}, "metadata": content.get("metadata") or {}},
                         sort_keys=True, default=str)
    return DisplayToken("\x00display " + hashlib.sha256(payload.encode()).hexdigest())


def split_displays(
    groups: Sequence[tuple[tuple[int, ...], str]],
) -> list[tuple[str, list[tuple[tuple[int, ...], str]]]]:
    """Cut merged output into runs, in order: ``("text", groups)`` to render as stream text and
    ``("display", [(ranks, token)])`` for one display shown for that rank set."""
    runs: list[tuple[str, list[tuple[tuple[int, ...], str]]]] = []
    for rs, line in groups:
        kind = "display" if isinstance(line, DisplayToken) else "text"
        if kind == "text" and runs and runs[-1][0] == "text":
            runs[-1][1].append((rs, line))
        else:
            runs.append((kind, [(rs, line)]))
    return runs


def render_lines(groups: Sequence[tuple[Sequence[int], str]], *, label: bool = True,
                 after: Sequence[int] | None = None) -> str:
    """``[((0, 1), "a"), ((0, 1), "b")]`` -> ``"[ranks 0,1] a\n            b\n"``.

    A run of lines from the same rank set is labelled once; the following lines are indented under the
    label. ``after`` is the rank set of the line printed just before (live output arrives in pieces), so
    a run that continues across pieces is not labelled again. ``label=False`` prints the bare lines.
    """
    if not label:
        return "".join(line + "\n" for _, line in groups)
    out = []
    prev = tuple(after) if after is not None else None
    for rs, line in groups:
        tag = rank_label(rs)
        if tuple(rs) == prev:
            out.append(f"{' ' * len(tag)} {line}\n" if line else "\n")
        else:
            out.append(f"{tag} {line}\n")
        prev = tuple(rs)
    return "".join(out)


# --------------------------------------------------------------------------------------------------------
# execute results and errors


def merge_results(results: Mapping[int, Mapping[str, object]], *, label: bool = True) -> dict[str, object]:
    """One ``execute_result`` data bundle from each rank's bundle.

    Equal results collapse into one (``text/plain`` prefixed with the rank set when labelling); otherwise
    the ``text/plain`` parts are listed per rank and the richer parts of rank ``min(ranks)`` are kept
    only when every rank produced the same rich data.
    """
    if not results:
        return {}
    groups: list[tuple[list[int], Mapping[str, object]]] = []
    for r in sorted(results):
        for rs, bundle in groups:
            if bundle == results[r]:
                rs.append(r)
                break
        else:
            groups.append(([r], results[r]))
    if len(groups) == 1:
        rs, bundle = groups[0]
        merged = dict(bundle)
        if label and len(results) > 1 and "text/plain" in merged:
            merged["text/plain"] = _prefix_block(rank_label(rs), str(merged["text/plain"]))
        return merged
    text = "\n".join(
        _prefix_block(rank_label(rs), str(bundle.get("text/plain", ""))) for rs, bundle in groups
    )
    return {"text/plain": text}


def _prefix_block(label: str, text: str) -> str:
    if "\n" in text:
        return f"{label}\n{text}"
    return f"{label} {text}"


@dataclass(frozen=True)
class ErrorInfo:
    ename: str
    evalue: str
    traceback: tuple[str, ...]


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _error_key(err: ErrorInfo) -> tuple[str, str, tuple[str, ...]]:
    # tracebacks that differ only in colouring or in "rank 3" mentioned by the user still count as equal
    # when their plain text is equal.
    return err.ename, err.evalue, tuple(_ANSI.sub("", line) for line in err.traceback)


def group_errors(errors: Mapping[int, ErrorInfo], *, world_size: int | None = None) -> dict[str, object]:
    """One ``error`` message content for a cell: identical tracebacks grouped with the ranks that raised them.

    ``ename``/``evalue`` are those of the lowest failing rank (so front ends show a sensible headline);
    ``evalue`` is prefixed with the rank set.
    """
    if not errors:
        raise ValueError("no errors to group")
    groups: list[tuple[list[int], ErrorInfo]] = []
    keys: list[tuple[str, str, tuple[str, ...]]] = []
    for r in sorted(errors):
        key = _error_key(errors[r])
        if key in keys:
            groups[keys.index(key)][0].append(r)
        else:
            keys.append(key)
            groups.append(([r], errors[r]))
    traceback: list[str] = []
    for rs, err in groups:
        head = f"{rank_label(rs)} {err.ename}: {err.evalue}" if err.evalue else f"{rank_label(rs)} {err.ename}"
        traceback.append(f"\x1b[1;31m{head}\x1b[0m")
        traceback.extend(err.traceback)
    first_ranks, first = groups[0]
    evalue = f"{rank_label(first_ranks)} {first.evalue}".rstrip()
    if len(groups) > 1:
        others = sorted(r for rs, _ in groups[1:] for r in rs)
        evalue += f" (and different errors on {format_ranks(others)})"
    return {"ename": first.ename, "evalue": evalue, "traceback": traceback}
