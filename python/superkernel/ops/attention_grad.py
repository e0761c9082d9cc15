"""Autograd formula of ``mk::ring_attention`` (registered with ``torch.library.register_autograd``).

Each rank holds queries, keys and values of s positions of a sequence of R*s (contiguous or zigzag, see
``superkernel.ops.attention``). The backward recomputes the attention probabilities from the saved
log-sum-exp, block by block, as FlashAttention's backward does, in fp32:

  P = exp(scale * q k^T - lse)   (0 where the causal mask hides a key)
  D = rowsum(dout * out) - dlse
  dv = P^T dout,  dS = P * (dout v^T - D),  dq = scale * dS k,  dk = scale * dS^T q

with the gradient of the log-sum-exp output (``dlse``) folded into D. Keys and values of all ranks are
gathered once (one all-gather of K and V together, in the input dtype); this rank's contributions to every
rank's dk and dv (fp32) are summed onto their owners by one reduce-scatter. Memory: the gathered K/V
(R blocks, as the forward's one-host path holds) and the scores of one tile of query rows at a time (about
1 MiB); key blocks the causal mask hides entirely are skipped. Grouped-query attention sums dk and dv
over the query heads that share a key/value head. Every rank must run the backward (the gather and the
reduce-scatter are collective). Gradients come back in the inputs' dtypes.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from superkernel.ops.attention import zigzag_positions
from superkernel.ops.autograd import all_gather, reduce_scatter
from superkernel.ops.group_names import group_rank, group_size


def _positions(rank: int, world: int, s: int, zigzag: bool) -> torch.Tensor:
    return zigzag_positions(rank, world, s) if zigzag else torch.arange(rank * s, (rank + 1) * s)


def _first_and_last(rank: int, world: int, s: int, zigzag: bool) -> tuple[int, int]:
    """The smallest and largest global position a rank holds (Python ints: no data-dependent branch when
    torch.compile traces the backward)."""
    if zigzag:
        c = s // 2
        return rank * c, (2 * world - rank) * c - 1
    return rank * s, (rank + 1) * s - 1


def _row_tile(heads: int, rows: int, keys: int) -> int:
    """Query rows per tile: one tile's probabilities ([heads, tile, keys] fp32) stay within about 1 MiB, so
    they are recomputed, used and dropped while in cache (a whole block's, 16 MiB at b=1 hq=8 hkv=2
    s=512, were fresh pages on every call)."""
    return max(8, min(rows, _TILE_ELEMENTS // max(1, heads * keys)))


_TILE_ELEMENTS = 1 << 18


def _setup(ctx: Any, inputs: tuple, output: tuple) -> None:
    q, k, v, name, causal, scale, zigzag = inputs
    out, lse = output
    ctx.name, ctx.causal, ctx.scale, ctx.zigzag = name, bool(causal), scale, bool(zigzag)
    ctx.save_for_backward(q, k, v, out, lse)


def _backward(ctx: Any, dout: torch.Tensor | None, dlse: torch.Tensor | None) -> tuple:
    q, k, v, out, lse = ctx.saved_tensors
    R, me = group_size(ctx.name), group_rank(ctx.name)
    b, hq, s, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    scale = ctx.scale if ctx.scale is not None else (1 / math.sqrt(d) if d else 1.0)

    # Every rank's K and V, [R, 2, b, hkv, s, d], by one gather in the input dtype.
    kv = all_gather(torch.stack([k, v]), ctx.name).view(R, 2, b, hkv, s, d)

    # The g query heads that share a key/value head, stacked along the rows: [b, hkv, g*s, ...]. Each block
    # is then one product per kv head, and the sums of dk and dv over those g heads happen inside the
    # products. Rows are taken in tiles (_row_tile). Measured on 2 ranks, b=1 hq=8 hkv=2 s=512 d=64 fp32,
    # forward + backward: 86 ms with 5-D broadcast products and a sum over g, 66 ms stacked, 60-64 ms
    # stacked and tiled (the unfused all-gather + SDPA step: 53-56 ms).
    qf = q.float().reshape(b, hkv, g * s, d)
    do = (dout.float() if dout is not None else torch.zeros_like(q, dtype=torch.float32)).reshape(b, hkv, g * s, d)
    lse_g = lse.reshape(b, hkv, g * s, 1)
    delta = (do * out.float().reshape(b, hkv, g * s, d)).sum(-1, keepdim=True)
    if dlse is not None:
        delta = delta - dlse.float().reshape(b, hkv, g * s, 1)

    q_pos = _positions(me, R, s, ctx.zigzag).to(q.device)
    dq = torch.zeros_like(qf)
    dkv = torch.zeros((R, 2, b, hkv, s, d), dtype=torch.float32, device=q.device)
    rows = _row_tile(b * hkv, g * s, s)
    for r in range(R):
        visible = None
        if ctx.causal:
            if _first_and_last(r, R, s, ctx.zigzag)[0] > _first_and_last(me, R, s, ctx.zigzag)[1]:
                continue  # every key of block r comes after every query here
            # [g*s, s]: row (head j, query i) may see key c
            visible = (_positions(r, R, s, ctx.zigzag).to(q.device).unsqueeze(0) <= q_pos.unsqueeze(1)).repeat(g, 1)
        kr = kv[r, 0].float()   # [b, hkv, s, d]
        vr = kv[r, 1].float()
        dk, dv = dkv[r, 0], dkv[r, 1]
        for lo in range(0, g * s, rows):
            hi = min(g * s, lo + rows)
            qt, dot = qf[:, :, lo:hi], do[:, :, lo:hi]
            p = torch.matmul(qt, kr.transpose(-1, -2)).mul_(scale).sub_(lse_g[:, :, lo:hi]).exp_()  # [b, hkv, T, s]
            if visible is not None:
                p.masked_fill_(~visible[lo:hi], 0.0)
            dv.add_(p.transpose(-1, -2) @ dot)
            ds = p.mul_(torch.matmul(dot, vr.transpose(-1, -2)).sub_(delta[:, :, lo:hi]))
            dq[:, :, lo:hi].add_(ds @ kr, alpha=scale)
            dk.add_(ds.transpose(-1, -2) @ qt, alpha=scale)

    # This rank's share of every rank's dk, dv, summed onto the rank that holds those positions.
    mine = reduce_scatter(dkv.view(R * 2 * b, hkv, s, d), ctx.name).view(2, b, hkv, s, d)
    need = ctx.needs_input_grad
    return (dq.reshape(b, hq, s, d).to(q.dtype) if need[0] else None, mine[0].to(k.dtype) if need[1] else None,
            mine[1].to(v.dtype) if need[2] else None, None, None, None, None)


torch.library.register_autograd("mk::ring_attention", _backward, setup_context=_setup)
