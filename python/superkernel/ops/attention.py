"""Sequence-parallel attention: ``torch.ops.mk.ring_attention``.

Each rank of a group of R holds ``s`` positions of a sequence of ``R*s``:

- contiguous (``zigzag=False``): rank r holds positions ``[r*s, (r+1)*s)``;
- zigzag (``zigzag=True``, ``s`` even): the sequence is cut into ``2R`` chunks of ``s/2`` positions and rank
  r holds chunk ``r`` followed by chunk ``2R-1-r``. With a causal mask this gives every rank the same
  amount of work (``zigzag_positions`` lists a rank's positions).

Keys and values travel around the ring of ranks while each rank computes its queries against the block it
holds (the transfer of the next block overlaps the current block's compute); partial results are merged
with the log-sum-exp rule in fp32. Where the ring does not pay, K/V is gathered instead and one attention
call covers the whole sequence: blocks small enough to ride in the argument agreement, and on mk on one host
without a mask (shared memory copies would use the cores the attention needs); on mk between hosts, blocks
under ``SUPERKERNEL_OPS_ATTENTION_RING_MIN_SEQ`` positions (256) and, without a mask, wherever the chunk
tuner finds the gather faster on the first calls of a shape (rank 0's choice holds on every rank; setting
the variable forces the ring above it). Returns ``out`` [b, hq, s, d] (the input dtype) and the log-sum-exp
[b, hq, s] (fp32) of each query's scaled scores over all the keys it attends to. Grouped-query attention:
``hq`` must be a multiple of ``hkv`` (query head ``i`` uses key/value head ``i // (hq // hkv)``).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from superkernel.ops.dispatch import call
from superkernel.ops.group_names import group_name

Group = dist.ProcessGroup | str | None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Group = None, *,
                   causal: bool = False, scale: float | None = None,
                   zigzag: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q`` [b, hq, s, d] over the keys/values ``k``, ``v`` [b, hkv, s, d] of every rank
    (softmax scale ``scale``, default ``1/sqrt(d)``): ``(out, lse)``."""
    return call(torch.ops.mk.ring_attention.default, q, k, v, group_name(group), causal, scale, zigzag)


def zigzag_positions(rank: int, world: int, s: int) -> torch.Tensor:
    """Global sequence positions of the ``s`` local positions of ``rank`` in the zigzag layout."""
    if s % 2:
        raise ValueError(f"zigzag layout needs an even local sequence length, got {s}")
    c = s // 2
    return torch.cat([torch.arange(rank * c, (rank + 1) * c),
                      torch.arange((2 * world - 1 - rank) * c, (2 * world - rank) * c)])


@torch.library.register_fake("mk::ring_attention")
def _ring_attention_fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group_name: str,
                         causal: bool = False, scale: float | None = None,
                         zigzag: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    torch._check(q.dim() == 4 and k.dim() == 4 and v.dim() == 4,
                 lambda: "mk ring_attention: q, k, v must be [batch, heads, seq, head_dim]")
    torch._check(k.shape == v.shape, lambda: "mk ring_attention: k and v differ in shape")
    torch._check(q.shape[1] % k.shape[1] == 0,
                 lambda: "mk ring_attention: query heads must be a multiple of key/value heads")
    return q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=torch.float32)
