"""GEMM fused with a collective: ``torch.ops.mk.allgather_gemm``, ``gemm_allreduce``, ``gemm_reducescatter``.

Each computes chunk i of the product while chunk i-1 communicates (csrc/kernels/pipeline.h). Inputs are
float32, bfloat16 or float16 (fp32 accumulation); ``chunks=0`` picks the chunk count from the shape and the
measured link and compute speed, then tunes it on the first calls of each shape (between hosts on mk also
against the plain path: one collective, then one GEMM, as the unfused composition runs; rank 0's choice
holds on every rank); a positive value overrides it. Every rank must call with matching shapes and dtypes;
a mismatch raises on every rank.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from superkernel.ops.dispatch import call
from superkernel.ops.group_names import group_name, group_size

Group = dist.ProcessGroup | str | None


def allgather_gemm(a: torch.Tensor, b: torch.Tensor, group: Group = None, *, return_gathered: bool = False,
                   chunks: int = 0) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``cat_r(a_r) @ b`` for row shards ``a`` [m, k] and ``b`` [k, n]: [R*m, n] (and the gathered A when
    ``return_gathered``)."""
    c, gathered = call(torch.ops.mk.allgather_gemm.default, a, b, group_name(group), return_gathered, chunks)
    return (c, gathered) if return_gathered else c


def gemm_allreduce(a: torch.Tensor, b: torch.Tensor, group: Group = None, *, chunks: int = 0) -> torch.Tensor:
    """``sum_r a_r @ b_r`` for ``a`` [m, k_r], ``b`` [k_r, n] (k sharded): [m, n], identical on every rank."""
    return call(torch.ops.mk.gemm_allreduce.default, a, b, group_name(group), chunks)


def gemm_reducescatter(a: torch.Tensor, b: torch.Tensor, group: Group = None, *, chunks: int = 0) -> torch.Tensor:
    """Rows ``[r*m/R, (r+1)*m/R)`` of ``sum_r a_r @ b_r`` (R must divide m): [m/R, n]."""
    return call(torch.ops.mk.gemm_reducescatter.default, a, b, group_name(group), chunks)


@torch.library.register_fake("mk::allgather_gemm")
def _allgather_gemm_fake(a: torch.Tensor, b: torch.Tensor, group_name: str, return_gathered: bool = False,
                         chunks: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    torch._check(a.dim() == 2 and b.dim() == 2, lambda: "mk allgather_gemm: a and b must be 2-D")
    torch._check(a.shape[1] == b.shape[0], lambda: "mk allgather_gemm: inner dimensions differ")
    world = group_size(group_name)
    c = a.new_empty((world * a.shape[0], b.shape[1]))
    gathered = a.new_empty((world * a.shape[0], a.shape[1])) if return_gathered else a.new_empty((0, a.shape[1]))
    return c, gathered


@torch.library.register_fake("mk::gemm_allreduce")
def _gemm_allreduce_fake(a: torch.Tensor, b: torch.Tensor, group_name: str, chunks: int = 0) -> torch.Tensor:
    torch._check(a.dim() == 2 and b.dim() == 2, lambda: "mk gemm_allreduce: a and b must be 2-D")
    torch._check(a.shape[1] == b.shape[0], lambda: "mk gemm_allreduce: inner dimensions differ")
    return a.new_empty((a.shape[0], b.shape[1]))


@torch.library.register_fake("mk::gemm_reducescatter")
def _gemm_reducescatter_fake(a: torch.Tensor, b: torch.Tensor, group_name: str, chunks: int = 0) -> torch.Tensor:
    torch._check(a.dim() == 2 and b.dim() == 2, lambda: "mk gemm_reducescatter: a and b must be 2-D")
    torch._check(a.shape[1] == b.shape[0], lambda: "mk gemm_reducescatter: inner dimensions differ")
    world = group_size(group_name)
    torch._check(a.shape[0] % world == 0, lambda: "mk gemm_reducescatter: the group size must divide m")
    return a.new_empty((a.shape[0] // world, b.shape[1]))
