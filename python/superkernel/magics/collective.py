"""Gathering small Python objects to rank 0 with whatever the rank has: torch.distributed, MPI, or nothing."""
from __future__ import annotations

from typing import Any


def gather_to_zero(ns: dict[str, Any], obj: Any) -> list[Any] | None:
    """Every rank's ``obj`` on rank 0 (a list by rank), ``None`` elsewhere. Needs all ranks to call it."""
    dist = ns.get("dist")
    if dist is not None and dist.is_initialized():
        world = dist.get_world_size()
        out: list[Any] | None = [None] * world if dist.get_rank() == 0 else None
        dist.gather_object(obj, out, dst=0)
        return out
    comm = ns.get("comm")
    if comm is not None:
        return comm.gather(obj, root=0)
    return [obj]


def barrier(ns: dict[str, Any]) -> None:
    dist = ns.get("dist")
    if dist is not None and dist.is_initialized():
        dist.barrier()
        return
    comm = ns.get("comm")
    if comm is not None:
        comm.Barrier()
