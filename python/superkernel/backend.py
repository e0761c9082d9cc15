"""Registers the ``mk`` backend with torch.distributed and gives Python access to its introspection.

After ``import superkernel``::

    dist.init_process_group("mk")                  # CPU tensors over mk
    dist.init_process_group("cpu:mk,cuda:nccl")    # mk for CPU tensors, NCCL for CUDA tensors
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _resolve_process_group

from superkernel import _C

BACKEND_NAME = "mk"


def register_backend() -> None:
    """Register ``mk`` once per process (idempotent)."""
    if not dist.is_available():
        raise ImportError("superkernel needs a torch build with torch.distributed")
    if BACKEND_NAME in dist.Backend.backend_list:
        return
    dist.Backend.register_backend(BACKEND_NAME, _create_backend, extended_api=True, devices=["cpu"])


def _create_backend(opts: "dist.distributed_c10d._DistributedBackendOptions",
                    backend_options: object) -> torch._C._distributed_c10d.Backend:
    """torch.distributed's creator: an mk backend, remembered by the group's name (which the fused ops use to
    find it behind TORCH_DISTRIBUTED_DEBUG=DETAIL's wrapper)."""
    return _C.create_backend(opts.store, opts.group_rank, opts.group_size, opts.timeout, opts.group_id)


def cpu_backend(group: dist.ProcessGroup | None = None) -> torch._C._distributed_c10d.Backend:
    """The backend of ``group`` (the default group when None) for CPU tensors, itself: without the wrapper
    that TORCH_DISTRIBUTED_DEBUG=DETAIL puts around it to check collectives."""
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    backend = pg._get_backend(torch.device("cpu"))
    wrapper = getattr(torch._C._distributed_c10d, "_ProcessGroupWrapper", None)
    if wrapper is not None and isinstance(backend, wrapper):
        backend = backend.wrapped_pg
    return backend


def mk_backend(group: dist.ProcessGroup | None = None) -> torch._C._distributed_c10d.Backend:
    """The mk backend object behind ``group`` (the default group when None)."""
    return cpu_backend(group)


def transports(group: dist.ProcessGroup | None = None) -> list[str]:
    """Per peer rank of ``group``: 'self', 'shm' or 'tcp'."""
    return list(_C.transports(mk_backend(group)))


def peer_hosts(group: dist.ProcessGroup | None = None) -> list[str]:
    """Per rank of ``group``: the host name it runs on."""
    return list(_C.peer_hosts(mk_backend(group)))


def network_peers(group: dist.ProcessGroup | str | None = None) -> bool:
    """Whether ``group`` (a group or its registered name) reaches some peer over the network: on mk, a peer
    over TCP; a group whose CPU backend is not mk (Gloo, NCCL) counts as one, its transports unknown here."""
    pg = _resolve_process_group(group) if isinstance(group, str) else group
    try:
        return "tcp" in transports(pg)
    except RuntimeError:   # not mk, or no CPU backend
        return True


def collective_runs(group: dist.ProcessGroup | None = None) -> dict[str, int]:
    """How many of ``group``'s collectives so far ran on the thread that issued them (``caller``: small ones,
    and a fused op's last collective, which it waits for at once) and how many on the backend's worker thread
    (``worker``)."""
    on_caller, on_worker = _C.collective_runs(mk_backend(group))
    return {"caller": on_caller, "worker": on_worker}


def cancel_waits() -> None:
    """Fail every blocked mk wait in this process now, and the fused ops' waits inside Gloo's send/recv (used
    by the notebook worker on interrupt, ``superkernel.cell_interrupts``)."""
    _C.cancel_waits()
