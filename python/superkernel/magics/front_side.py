"""Front-side magics: handled by the kernel process before (or instead of) sending a cell to the ranks.

A cell may start with ``%%rank SPEC`` (run on a subset) or ``%%local`` (run in the kernel process only),
and with any number of front-side line magics (``%pull``, ``%push``, ``%scatter``, ``%gather``,
``%restart``, ``%timeout``, ``%output``), one per line; what follows is sent to the ranks.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from superkernel.magics import data_movement, pool_control, subset

collective_warning = subset.collective_warning


class FrontMagicError(Exception):
    """A front-side magic was used wrongly; the cell fails with this message."""


LineMagic = Callable[[Any, str, dict[str, Any]], Awaitable[str]]

LINE_MAGICS: dict[str, LineMagic] = {
    "pull": data_movement.pull,
    "push": data_movement.push,
    "scatter": data_movement.scatter,
    "gather": data_movement.gather,
    "restart": pool_control.restart,
    "timeout": pool_control.timeout,
    "output": pool_control.output,
}
CELL_MAGICS = ("rank", "local")

_LINE = re.compile(r"^%(\w+)(?:\s+(.*))?$")


@dataclass
class SplitCell:
    cell_magic: str | None = None
    ranks: list[int] | None = None
    line_magics: list[tuple[str, str]] = field(default_factory=list)
    body: str = ""


def split_cell(code: str) -> SplitCell:
    lines = code.split("\n")
    out = SplitCell()
    i = 0
    first = lines[0].strip() if lines else ""
    if first.startswith("%%"):
        name, _, args = first[2:].partition(" ")
        if name in CELL_MAGICS:
            out.cell_magic = name
            if name == "rank":
                out.ranks = subset.parse_rank_spec(args)
            i = 1
            if name == "local":
                out.body = "\n".join(lines[1:])
                return out
    while i < len(lines):
        stripped = lines[i].strip()
        m = _LINE.match(stripped)
        if m and m.group(1) in LINE_MAGICS:
            out.line_magics.append((m.group(1), (m.group(2) or "").strip()))
            i += 1
        elif stripped == "" and out.line_magics:
            i += 1
        else:
            break
    out.body = "\n".join(lines[i:])
    return out


async def run_line_magic(kernel: Any, name: str, args: str, parent: dict[str, Any]) -> str:
    try:
        return await LINE_MAGICS[name](kernel, args, parent)
    except (ValueError, KeyError, TypeError, TimeoutError, ConnectionError) as e:
        raise FrontMagicError(f"%{name} {args}: {e}") from e
