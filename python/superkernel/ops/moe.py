"""Expert-parallel mixture of experts: ``torch.ops.mk.moe_dispatch_gemm`` and ``moe_combine``.

E experts are spread over the R ranks of a group in contiguous blocks: rank r owns experts
``[r*E_r, (r+1)*E_r)`` and holds their weights ``w`` [E_r, h, f].

``moe_dispatch_gemm`` sends each (token, choice) of this rank only to the rank owning the chosen expert (an
all-to-all with uneven counts: the counts are exchanged first, nothing is sent where there is nothing to
send) and multiplies every received row by its expert's weight (fp32 accumulation) while later blocks are
still arriving. Its output ``y`` [n_recv, f] is ordered by local expert, then source rank, then token index,
then top-k choice; ``counts`` [E_r] (int64) says how many rows each local expert got; ``handle`` (an int64
tensor) records the routing for ``moe_combine``.

``moe_combine`` sends every row back to its token's home rank and returns
``out[t] = sum_k topk_weights[t, k] * y_row(t, k)`` (fp32 accumulation, in y's dtype).

Every rank must call both (the group's ranks in the same order); expert counts, hidden sizes or dtypes that
disagree across ranks and expert ids out of range raise on every rank.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from superkernel.ops.dispatch import call
from superkernel.ops.group_names import group_name, group_size

Group = dist.ProcessGroup | str | None

# Layout of the routing handle (see csrc/kernels/moe.cc): header, then recv counts [R, E_r], send counts
# [R*E_r], send order [t*k].
HANDLE_HEADER = 8
HANDLE_MAGIC = 0x6d6b6d6f65   # its first word ("mkmoe", kMagic in moe.cc)


def moe_dispatch_gemm(x: torch.Tensor, topk_ids: torch.Tensor, w: torch.Tensor,
                      group: Group = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Route tokens ``x`` [t, h] to the experts ``topk_ids`` [t, k] (global ids) and apply the experts'
    weights: ``(y [n_recv, f], counts [E_r], handle)`` on the experts' ranks."""
    return call(torch.ops.mk.moe_dispatch_gemm.default, x, topk_ids, w, group_name(group))


def moe_combine(y: torch.Tensor, handle: torch.Tensor, topk_weights: torch.Tensor,
                group: Group = None) -> torch.Tensor:
    """Return the expert outputs ``y`` to their tokens' ranks and sum them weighted by ``topk_weights``
    [t, k]: [t, f]."""
    return call(torch.ops.mk.moe_combine.default, y, handle, topk_weights, group_name(group))


@torch.library.register_fake("mk::moe_dispatch_gemm")
def _moe_dispatch_gemm_fake(x: torch.Tensor, topk_ids: torch.Tensor, w: torch.Tensor,
                            group_name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    torch._check(x.dim() == 2 and topk_ids.dim() == 2 and w.dim() == 3,
                 lambda: "mk moe_dispatch_gemm: expected x [t, h], topk_ids [t, k], w [E_r, h, f]")
    torch._check(x.shape[0] == topk_ids.shape[0], lambda: "mk moe_dispatch_gemm: x and topk_ids differ in tokens")
    torch._check(x.shape[1] == w.shape[1], lambda: "mk moe_dispatch_gemm: x and w differ in hidden size")
    n_recv = torch.library.get_ctx().new_dynamic_size()  # how many rows arrive depends on the routing
    world = group_size(group_name)
    experts = w.shape[0]
    y = x.new_empty((n_recv, w.shape[2]))
    counts = x.new_empty((experts,), dtype=torch.int64)
    handle = x.new_empty((HANDLE_HEADER + 2 * world * experts + topk_ids.shape[0] * topk_ids.shape[1],),
                         dtype=torch.int64)
    return y, counts, handle


@torch.library.register_fake("mk::moe_combine")
def _moe_combine_fake(y: torch.Tensor, handle: torch.Tensor, topk_weights: torch.Tensor,
                      group_name: str) -> torch.Tensor:
    torch._check(y.dim() == 2 and topk_weights.dim() == 2,
                 lambda: "mk moe_combine: expected y [n_recv, f] and topk_weights [t, k]")
    torch._check(handle.dim() == 1 and handle.dtype == torch.int64,
                 lambda: "mk moe_combine: handle must be the int64 tensor moe_dispatch_gemm returned")
    return y.new_empty((topk_weights.shape[0], y.shape[1]))
