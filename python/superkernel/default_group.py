"""The rank's default process group as the worker made it, and making it again once it was aborted.

An interrupt that ends a wait inside an mk collective or fused op aborts that group's communicator (its
peers' messages are torn, so it cannot go on); so do a timeout and a lost peer. Each rank reports, with
every cell's reply, whether its default group is aborted (``aborted_reason``); when any rank does and none
died, the kernel runs ``remake`` on every rank, which destroys the default group and initialises it again
with the worker's own arguments, the namespace kept. That destroys every other process group too
(torch.distributed has no way to destroy only the default one), so when the user made groups of their own
(``dist.new_group``) it is left alone and the note says how to make it again by hand (``remake(force=True)``
on every rank, then the new_group calls again). Objects bound to the aborted group (windows, tensor stores)
stay aborted either way.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from datetime import timedelta

NOTE = "[superkernel] the default group's mk communicator was aborted (by an interrupt, a timeout or a lost peer)"


@dataclass(frozen=True)
class InitArgs:
    backend: str
    rank: int
    world_size: int
    timeout: timedelta


_init: InitArgs | None = None


def remember(args: InitArgs) -> None:
    """What the worker passed to ``dist.init_process_group`` (``remake`` passes it again)."""
    global _init
    _init = args


def aborted_reason() -> str | None:
    """Why this rank's default group's mk communicator was aborted, or None (not aborted, not mk, no group)."""
    if _init is None or "torch.distributed" not in sys.modules:
        return None
    import torch.distributed as dist

    from superkernel.backend import cpu_backend

    if not dist.is_initialized():
        return None
    try:
        backend = cpu_backend()
    except RuntimeError:
        return None
    if (backend.name() if hasattr(backend, "name") else "") != "mk":
        return None
    from superkernel import _C

    return _C.aborted(backend)


_remakes = 0  # default groups made here so far (the same count on every rank: every rank makes each)


def remake(force: bool = False) -> None:
    """Collective over every rank: destroy and initialise the default group again, the namespace kept.
    Without ``force`` (the kernel's call after an interrupt) nothing is done when the user made other groups,
    which would be destroyed too; ``force=True`` destroys them (make them again afterwards). Prints what it did
    (the same line on every rank, so the notebook shows it once).

    The new group keeps its keys under a store prefix of its own: torch.distributed numbers groups from 0
    again after destroy_process_group, so a group made with new_group after a plain destroy and init reads
    the keys of the one before it under the same store (a Gloo group then waits for the old one's peers)."""
    import torch.distributed as dist

    global _remakes
    if _init is None:
        raise RuntimeError("superkernel.default_group.remake: this process's default group was not made by the "
                           "superkernel worker")
    base = None
    if dist.is_initialized():
        others = len(dist.distributed_c10d._world.pg_map) - 1
        if others and not force:
            print(f"{NOTE}; it was left so: {others} other process group(s) made with dist.new_group would go "
                  "with it. To make it again and destroy those, on every rank: from superkernel import "
                  "default_group; default_group.remake(force=True), then your new_group calls.",
                  file=sys.stderr, flush=True)
            return
        base = dist.distributed_c10d._get_default_store()
        dist.destroy_process_group()
    a = _init
    _remakes += 1
    if base is None:
        dist.init_process_group(a.backend, rank=a.rank, world_size=a.world_size, timeout=a.timeout)
    else:
        store = dist.PrefixStore(f"superkernel/default_group/{_remakes}/", base)
        dist.init_process_group(a.backend, store=store, rank=a.rank, world_size=a.world_size, timeout=a.timeout)
    said = "[superkernel] the default group was made again" if force else f"{NOTE}; the default group was made again"
    print(f"{said} (windows and tensor stores made on the old one stay aborted).", file=sys.stderr, flush=True)
