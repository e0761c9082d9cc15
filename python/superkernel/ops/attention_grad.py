"""Autograd formula of ``mk::ring_attention`` (registered with ``torch.library.register_autograd``).

Each rank holds queries, keys and values of s positions of a sequence of R*s (contiguous or zigzag, see
``superkernel.ops.attention``). The backward recomputes the attention probabilities from the saved
log-sum-exp, block by block, as FlashAttention's backward does, in fp32:

  P = exp(scale * q k^T - lse)   (0 where the causal mask hides a key)
  D = rowsum(dout * out) - dlse
  dv = P^T dout,  dS = P * (dout v^T - D),  dq = scale * dS k,  dk = scale * dS^T q

with the gradient of the log-sum-exp output (``dlse``) folded into D. Keys and values of all ranks are
gathered once (one all-gather of K and V together, in the input dtype); this rank's contributions to every
rank's dk and dv (fp32) are summed onto their owners by one reduce-scatter. The query heads that share a
key/value head are stacked along the rows, so each block is one product per kv head. When the log-sum-exp
output has no gradient (the usual case) on CPU, each block goes through ATen's FlashAttention backward
kernel (_blocks_aten); otherwise through the products above in tiles of query rows whose scores stay near
1 MiB (_blocks_tiled). Memory: the gathered K/V (R blocks, as the forward's one-host path holds) and one
block's or tile's working set; key blocks the causal mask hides entirely are skipped. Every rank must run
the backward (the gather and the reduce-scatter are collective). Gradients come back in the inputs' dtypes.
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


def _blocks_aten(qf: torch.Tensor, do: torch.Tensor, of: torch.Tensor, lse: torch.Tensor, kv: torch.Tensor,
                 blocks: list, scale: float, dq: torch.Tensor, dkv: torch.Tensor) -> None:
    """Each key block through ATen's FlashAttention backward for CPU, given the whole sequence's output and
    log-sum-exp: with those, a block's probabilities exp(scale q k^T - lse) are its share of the global
    softmax, so the kernel returns exactly that block's dq share, dk and dv. The kernel forms D from dout
    and out itself, so this path is taken only when the log-sum-exp output has no gradient. Its mask must be
    additive (a boolean one is read as 0/1 numbers), so a masked block goes one query head at a time with
    one [s, s] float mask instead of a [g*s, s] one. Measured on one core, b=1 hq=8 hkv=2 s=2048 (2 blocks
    of 2048 keys) fp32: 553 ms, against 720-814 ms for the tiled products (tiles of 64-1024 rows) and
    583 ms for SDPA's own backward over the gathered sequence."""
    s = kv.shape[4]
    g = qf.shape[2] // max(1, s)
    qf, do, of, lse = (t.contiguous() for t in (qf, do, of, lse))
    for r, visible in blocks:
        kr, vr = kv[r, 0].float(), kv[r, 1].float()
        if visible is None:
            gq, gk, gv = _flash_backward(do, qf, kr, vr, of, lse, 0.0, False, attn_mask=None, scale=scale)
            dq.add_(gq)
            dkv[r, 0], dkv[r, 1] = gk, gv
            continue
        mask = torch.zeros(visible.shape, dtype=qf.dtype, device=qf.device).masked_fill_(~visible, float("-inf"))
        for j in range(g):
            rows = slice(j * s, (j + 1) * s)
            gq, gk, gv = _flash_backward(do[:, :, rows].contiguous(), qf[:, :, rows].contiguous(), kr, vr,
                                         of[:, :, rows].contiguous(), lse[:, :, rows].contiguous(), 0.0, False,
                                         attn_mask=mask, scale=scale)
            dq[:, :, rows].add_(gq)
            dkv[r, 0].add_(gk)
            dkv[r, 1].add_(gv)


_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default


def _blocks_tiled(qf: torch.Tensor, do: torch.Tensor, lse: torch.Tensor, delta: torch.Tensor, kv: torch.Tensor,
                  blocks: list, scale: float, dq: torch.Tensor, dkv: torch.Tensor) -> None:
    """Each key block by products in tiles of query rows (_row_tile), with D = ``delta`` given (it holds the
    log-sum-exp's gradient). Measured on 2 ranks, b=1 hq=8 hkv=2 s=512 d=64 fp32, forward + backward: 86 ms
    with 5-D broadcast products and a sum over g, 66 ms stacked, 60-64 ms stacked and tiled (the unfused
    all-gather + SDPA step: 53-56 ms)."""
    b, hkv, rows_all, _ = qf.shape
    s = kv.shape[4]
    rows = _row_tile(b * hkv, rows_all, s)
    for r, visible in blocks:
        kr, vr = kv[r, 0].float(), kv[r, 1].float()   # [b, hkv, s, d]
        dk, dv = dkv[r, 0], dkv[r, 1]
        if visible is not None:
            visible = visible.repeat(rows_all // max(1, s), 1)   # row (head j, query i) may see key c
        for lo in range(0, rows_all, rows):
            hi = min(rows_all, lo + rows)
            qt, dot = qf[:, :, lo:hi], do[:, :, lo:hi]
            p = torch.matmul(qt, kr.transpose(-1, -2)).mul_(scale).sub_(lse[:, :, lo:hi]).exp_()  # [b, hkv, T, s]
            if visible is not None:
                p.masked_fill_(~visible[lo:hi], 0.0)
            dv.add_(p.transpose(-1, -2) @ dot)
            ds = p.mul_(torch.matmul(dot, vr.transpose(-1, -2)).sub_(delta[:, :, lo:hi]))
            dq[:, :, lo:hi].add_(ds @ kr, alpha=scale)
            dk.add_(ds.transpose(-1, -2) @ qt, alpha=scale)


def _setup(ctx: Any, inputs: tuple, output: tuple) -> None:
    q, k, v, name, causal, scale, zigzag = inputs
    out, lse = output
    ctx.name, ctx.causal, ctx.scale, ctx.zigzag = name, bool(causal), scale, bool(zigzag)
    ctx.save_for_backward(q, k, v, out, lse)
    # An output the loss does not use gets None, not zeros: a log-sum-exp without a gradient (the usual
    # case) lets the backward use ATen's kernel (_blocks_aten)
    ctx.set_materialize_grads(False)


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
    # products.
    qf = q.float().reshape(b, hkv, g * s, d)
    do = (dout.float() if dout is not None else torch.zeros_like(q, dtype=torch.float32)).reshape(b, hkv, g * s, d)
    of = out.float().reshape(b, hkv, g * s, d)
    q_pos = _positions(me, R, s, ctx.zigzag).to(q.device)
    dq = torch.zeros_like(qf)
    dkv = torch.zeros((R, 2, b, hkv, s, d), dtype=torch.float32, device=q.device)
    blocks = []   # (r, [s, s] visibility (query i may see key c) or None) of the key blocks seen here
    for r in range(R):
        visible = None
        if ctx.causal:
            if _first_and_last(r, R, s, ctx.zigzag)[0] > _first_and_last(me, R, s, ctx.zigzag)[1]:
                continue  # every key of block r comes after every query here
            visible = _positions(r, R, s, ctx.zigzag).to(q.device).unsqueeze(0) <= q_pos.unsqueeze(1)  # [s, s]
        blocks.append((r, visible))
    if dlse is None and q.device.type == "cpu" and qf.numel() > 0 and kv.numel() > 0:
        _blocks_aten(qf, do, of, lse.reshape(b, hkv, g * s), kv, blocks, scale, dq, dkv)
    else:
        delta = (do * of).sum(-1, keepdim=True)
        if dlse is not None:
            delta = delta - dlse.float().reshape(b, hkv, g * s, 1)
        _blocks_tiled(qf, do, lse.reshape(b, hkv, g * s, 1), delta, kv, blocks, scale, dq, dkv)

    # This rank's share of every rank's dk, dv, summed onto the rank that holds those positions.
    mine = reduce_scatter(dkv.view(R * 2 * b, hkv, s, d), ctx.name).view(2, b, hkv, s, d)
    need = ctx.needs_input_grad
    return (dq.reshape(b, hq, s, d).to(q.dtype) if need[0] else None, mine[0].to(k.dtype) if need[1] else None,
            mine[1].to(v.dtype) if need[2] else None, None, None, None, None)


torch.library.register_autograd("mk::ring_attention", _backward, setup_context=_setup)
