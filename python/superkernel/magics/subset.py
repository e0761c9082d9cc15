"""``%%rank SPEC``: run a cell on some ranks only, warning when it calls a collective."""
from __future__ import annotations

import re

from superkernel.merge import format_ranks, parse_ranks

_COLLECTIVE = re.compile(
    r"\b(?:dist|torch\.distributed)\.(all_reduce|all_gather\w*|broadcast\w*|barrier|reduce\w*|scatter\w*|gather\w*|"
    r"all_to_all\w*|new_group|monitored_barrier)\s*\("
    r"|\bcomm\.(allreduce|Allreduce|bcast|Bcast|barrier|Barrier|gather|Gather|scatter|Scatter|allgather|Allgather|"
    r"reduce|Reduce|alltoall|Alltoall)\s*\("
    r"|^\s*%(barrier|info)\b",
    re.M,
)


def parse_rank_spec(args: str) -> list[int]:
    spec = args.strip()
    if not spec:
        raise ValueError("%%rank needs ranks, e.g. %%rank 0,2-3")
    return parse_ranks(spec)


def collective_warning(body: str, ranks: list[int], world_size: int) -> str | None:
    """A warning when a subset cell calls a collective that the other ranks will never join."""
    if len(ranks) >= world_size:
        return None
    m = _COLLECTIVE.search(body)
    if not m:
        return None
    call = m.group(0).strip().rstrip("(")
    others = [r for r in range(world_size) if r not in ranks]
    return (f"warning: this cell runs on {format_ranks(ranks)} only but calls a collective ({call}); "
            f"{format_ranks(others)} will not join it, so it may block until interrupted or %timeout.")
