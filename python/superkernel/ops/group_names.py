"""Process groups as the ``str group_name`` the ``torch.ops.mk.*`` schemas take, and back.

The ops take the group's registered name (``pg.group_name``) so they can be traced by ``torch.compile``
(a string is a constant in the graph; a ProcessGroup object is not); C++ resolves it with
``c10d::resolve_process_group``.
"""
from __future__ import annotations

import torch.distributed as dist
from torch._C._distributed_c10d import _resolve_process_group


def group_name(group: dist.ProcessGroup | str | None = None) -> str:
    """The registered name of ``group`` (the default group when None; a name is returned unchanged)."""
    if isinstance(group, str):
        return group
    if group is None:
        if not dist.is_initialized():
            raise RuntimeError("superkernel.ops: torch.distributed is not initialized (call init_process_group)")
        group = dist.distributed_c10d._get_default_group()
    return group.group_name


def group_size(name: str) -> int:
    """World size of the group registered as ``name`` (used by fake kernels to size outputs)."""
    return _resolve_process_group(name).size()


def group_rank(name: str) -> int:
    """This process's rank in the group registered as ``name``."""
    return _resolve_process_group(name).rank()
