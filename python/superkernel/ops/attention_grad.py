"""Autograd formula of ``mk::ring_attention`` (registered with ``torch.library.register_autograd``).

Each rank holds queries, keys and values of s positions of a sequence of R*s (contiguous or zigzag, see
``superkernel.ops.attention``). The backward recomputes the attention probabilities from the saved
log-sum-exp, as FlashAttention's backward does:

  P = exp(scale * q k^T - lse)   (0 where the causal mask hides a key)
  D = rowsum(dout * out) - dlse
  dv = P^T dout,  dS = P * (dout v^T - D),  dq = scale * dS k,  dk = scale * dS^T q

with the gradient of the log-sum-exp output (``dlse``) folded into D. Keys and values of all ranks are gathered once
(one all-gather of K and V together, in the input dtype); this rank's contributions to every rank's dk and dv
(fp32, or the half type where that changes no bit) are summed onto their owners by one reduce-scatter. Where a peer
is reached over the network, neither collective waits in the open: the first half of this rank's own keys is
worked while the gather is under way, the second half while the reduce-scatter is (which then leaves the own term
out; it is added to what arrives). The query heads that share a key/value head are stacked along the rows, so each
block is one product per kv head. When the log-sum-exp output has no gradient (the usual case) on CPU, ATen's
FlashAttention backward kernel takes the visible key blocks in one call, or with the overlap the other ranks' in one
and each half of the own block in one (_aten_grads), in the input dtype where ATen's GEMM is fast on it (as the
unfused SDPA runs), else in fp32; dq is then the sum of those calls' (each rounded once to that dtype) in fp32.
Otherwise the products above run in fp32, in tiles of query rows whose scores stay near 1 MiB (_tiled_grads).
Memory: the gathered K/V (R blocks, as the forward's one-host path holds) and the visible blocks' keys and values
in one piece, or one tile's working set; key blocks the causal mask hides entirely are skipped. Every rank must run
the backward (the gather and the reduce-scatter are collective). Gradients come back in the inputs' dtypes.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from superkernel.ops.attention import zigzag_positions
from superkernel.backend import network_peers
from superkernel.ops.autograd import half_as_is, start_all_gather, start_reduce_scatter, wait
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


def _aten_grads(qs: torch.Tensor, do: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, keys: torch.Tensor,
                values: torch.Tensor, visible: torch.Tensor | None, scale: float) -> tuple:
    """dq, dk, dv of the queries against ``keys``/``values`` ([b, hkv, n, d], any n: one block, several
    blocks side by side, part of one; taken in the queries' dtype) through ATen's FlashAttention backward for
    CPU, given the whole sequence's output and log-sum-exp: the call the unfused SDPA over the gathered sequence
    makes (its rounding too: each gradient made in fp32 inside and rounded once to the operands' dtype), over
    fewer keys. dq is
    [b, hkv, g*s, d] as stacked, in the operands' dtype; dk, dv in it without a mask, in fp32 with one.
    The kernel forms D from dout and out itself, so this path is taken only when the log-sum-exp output has
    no gradient. Its mask must be additive (a boolean one is read as 0/1 numbers), so under a mask
    (``visible``: [s, n], query i may see key c) each query head goes alone with one [s, n] float mask
    instead of a [g*s, n] one, and dk, dv are summed over the heads in fp32. Measured on one core, b=1 hq=8
    hkv=2 s=2048 (2 blocks of 2048 keys) fp32, one call per block: 553 ms, against 720-814 ms for the tiled
    products (tiles of 64-1024 rows) and 583 ms for SDPA's own backward over the gathered sequence."""
    qs, do, out, lse = (t.contiguous() for t in (qs, do, out, lse))
    keys, values = (t.to(qs.dtype).contiguous() for t in (keys, values))   # (a half type widened: fp32)
    if visible is None:
        return _flash_backward(do, qs, keys, values, out, lse, 0.0, False, attn_mask=None, scale=scale)[:3]
    s = visible.shape[0]
    mask = torch.zeros(visible.shape, dtype=qs.dtype, device=qs.device).masked_fill_(~visible, float("-inf"))
    dq = torch.empty_like(qs)
    dk = torch.zeros(keys.shape, dtype=torch.float32, device=qs.device)
    dv = torch.zeros_like(dk)
    for j in range(qs.shape[2] // max(1, s)):
        rows = slice(j * s, (j + 1) * s)
        gq, gk, gv = _flash_backward(do[:, :, rows].contiguous(), qs[:, :, rows].contiguous(), keys, values,
                                     out[:, :, rows].contiguous(), lse[:, :, rows].contiguous(), 0.0, False,
                                     attn_mask=mask, scale=scale)
        dq[:, :, rows] = gq
        dk.add_(gk)
        dv.add_(gv)
    return dq, dk, dv


_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default


def _tiled_grads(qf: torch.Tensor, do: torch.Tensor, lse: torch.Tensor, delta: torch.Tensor, keys: torch.Tensor,
                 values: torch.Tensor, visible: torch.Tensor | None, scale: float, dq: torch.Tensor,
                 dk: torch.Tensor, dv: torch.Tensor) -> None:
    """The same by products in fp32 in tiles of query rows (_row_tile), with D = ``delta`` given (it holds
    the log-sum-exp's gradient), added into dq, dk and dv (fp32). Measured on 2 ranks, b=1 hq=8 hkv=2 s=512
    d=64 fp32, forward + backward: 86 ms with 5-D broadcast products and a sum over g, 66 ms stacked, 60-64
    ms stacked and tiled (the unfused all-gather + SDPA step: 53-56 ms)."""
    b, hkv, rows_all, _ = qf.shape
    kr, vr = keys.float(), values.float()   # [b, hkv, n, d]
    rows = _row_tile(b * hkv, rows_all, kr.shape[2])
    if visible is not None:
        visible = visible.repeat(rows_all // max(1, visible.shape[0]), 1)   # row (head j, query i) may see key c
    for lo in range(0, rows_all, rows):
        hi = min(rows_all, lo + rows)
        qt, dot = qf[:, :, lo:hi], do[:, :, lo:hi]
        p = torch.matmul(qt, kr.transpose(-1, -2)).mul_(scale).sub_(lse[:, :, lo:hi]).exp_()  # [b, hkv, T, n]
        if visible is not None:
            p.masked_fill_(~visible[lo:hi], 0.0)
        dv.add_(p.transpose(-1, -2) @ dot)
        ds = p.mul_(torch.matmul(dot, vr.transpose(-1, -2)).sub_(delta[:, :, lo:hi]))
        dq[:, :, lo:hi].add_(ds @ kr, alpha=scale)
        dk.add_(ds.transpose(-1, -2) @ qt, alpha=scale)


# Fewest keys in each half of the own block when it is split (ATen's CPU kernel works keys in blocks of up to 512;
# fewer cost more per key). Backward alone, 2 ranks on one host (Intel Xeon VM, AVX512-BF16), b=1 hq=8 hkv=2 d=64
# bf16, time before the split / after, medians of interleaved calls: s=512 (halves of 256) 0.92x without a mask,
# 0.86x causal; s=1024 0.99x and 0.97x; s=2048 1.04x and 1.01x. The own block whole first: s=512 0.96x and 1.03x.
_SPLIT_MIN_KEYS = 512


def _setup(ctx: Any, inputs: tuple, output: tuple) -> None:
    q, k, v, name, causal, scale, zigzag = inputs
    out, lse = output
    ctx.name, ctx.causal, ctx.scale, ctx.zigzag = name, bool(causal), scale, bool(zigzag)
    ctx.save_for_backward(q, k, v, out, lse)
    # An output the loss does not use gets None, not zeros: a log-sum-exp without a gradient (the usual
    # case) lets the backward use ATen's kernel (_visible_aten)
    ctx.set_materialize_grads(False)


def _backward(ctx: Any, dout: torch.Tensor | None, dlse: torch.Tensor | None) -> tuple:
    q, k, v, out, lse = ctx.saved_tensors
    R, me = group_size(ctx.name), group_rank(ctx.name)
    b, hq, s, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    scale = ctx.scale if ctx.scale is not None else (1 / math.sqrt(d) if d else 1.0)

    # Every rank's K and V, [R, 2, b, hkv, s, d], by one gather in the input dtype, started here (the own
    # keys need no other rank's).
    own = torch.stack([k, v])
    gathering = start_all_gather(own, ctx.name) if R > 1 else None
    overlap = gathering is not None and network_peers(ctx.name)   # (see below, where the blocks are worked)

    # The g query heads that share a key/value head, stacked along the rows: [b, hkv, g*s, ...]. Each block
    # is then one product per kv head, and the sums of dk and dv over those g heads happen inside the
    # products. ATen's kernel takes a half type as it is where ATen's GEMM is fast on it (as the unfused SDPA
    # does); the tiled products are in fp32.
    aten = dlse is None and q.device.type == "cpu" and q.numel() > 0 and k.numel() > 0
    as_is = aten and half_as_is(q)
    ct = q.dtype if as_is else torch.float32
    qf = q.to(ct).reshape(b, hkv, g * s, d)
    do = (dout.to(ct) if dout is not None else torch.zeros_like(q, dtype=ct)).reshape(b, hkv, g * s, d)
    of = out.to(ct).reshape(b, hkv, g * s, d)
    lse_rows = lse.reshape(b, hkv, g * s)
    q_pos = _positions(me, R, s, ctx.zigzag).to(q.device)
    # dk, dv: fp32 sums across ranks, except where the half type changes no bit of them: ATen's kernel made
    # each key's in it in one call (no mask: no sum over query heads here) and two ranks add the two terms
    # once, in fp32 (the backend's half-type sum, mk's or Gloo's, or the addition of the own term below),
    # rounded once. Half the bytes: at 1 Gbit/s between two namespace hosts, bf16 b=1 hq=8 hkv=2 s=2048x2 d=64,
    # the fp32 reduce-scatter took about 8 ms more than the unfused backward's bf16 one.
    half_sum = as_is and R == 2 and not ctx.causal
    dkv = torch.zeros((R, 2, b, hkv, s, d), dtype=ct if half_sum else torch.float32, device=q.device)
    # this rank's own term of its dk, dv, where it is made apart from the gathered blocks (its slot in dkv then
    # stays zero)
    own_grad = torch.zeros_like(dkv[0]) if gathering is None or overlap else None
    others = []   # (r, [s, s] visibility (query i may see key c) or None) of the other ranks' key blocks seen here
    for r in range(R):
        if r == me:
            continue
        visible = None
        if ctx.causal:
            if _first_and_last(r, R, s, ctx.zigzag)[0] > _first_and_last(me, R, s, ctx.zigzag)[1]:
                continue  # every key of block r comes after every query here
            visible = _positions(r, R, s, ctx.zigzag).to(q.device).unsqueeze(0) <= q_pos.unsqueeze(1)  # [s, s]
        others.append((r, visible))
    own_visible = q_pos.unsqueeze(0) <= q_pos.unsqueeze(1) if ctx.causal else None

    dq_parts = []   # ATen's path: dq of each call, in ct (summed in fp32 at the end)
    dq = None if aten else torch.zeros_like(qf)
    delta = None
    if not aten:
        delta = (do * of).sum(-1, keepdim=True)
        if dlse is not None:
            delta = delta - dlse.float().reshape(b, hkv, g * s, 1)

    def work(keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor | None, dk: torch.Tensor,
             dv: torch.Tensor) -> None:
        """dq from these keys; their dk, dv written into (ATen's path) or added to (tiled) dk, dv."""
        if aten:
            gq, gk, gv = _aten_grads(qf, do, of, lse_rows, keys, values, visible, scale)
            dq_parts.append(gq)
            dk.copy_(gk)
            dv.copy_(gv)
        else:
            _tiled_grads(qf, do, lse_rows.unsqueeze(-1), delta, keys, values, visible, scale, dq, dk, dv)

    def own_part(lo: int, hi: int) -> None:
        if hi > lo:
            work(k[:, :, lo:hi], v[:, :, lo:hi], own_visible[:, lo:hi] if own_visible is not None else None,
                 own_grad[0, :, :, lo:hi], own_grad[1, :, :, lo:hi])

    # Where a peer is reached over the network, neither collective waits in the open: the first half of the own
    # keys is worked while the gather is under way, the second while the reduce-scatter is (in one piece, before
    # the gather is waited for, where a half would hold fewer than _SPLIT_MIN_KEYS keys). Every peer on this
    # host (mk over shared memory: the gather and the reduce-scatter take well under a millisecond): the own
    # block goes with the others in one call, which costs less than the extra call would hide. dq is made in
    # up to three calls, each rounded once to ct, and added in fp32.
    half = s // 2 if overlap and s // 2 >= _SPLIT_MIN_KEYS else s
    if gathering is None or overlap:
        own_part(0, half)
    summing = None
    if gathering is not None:
        kv = wait(gathering).view(R, 2, b, hkv, s, d)
        seen_blocks = others if overlap else sorted([*others, (me, own_visible)], key=lambda block: block[0])
        if seen_blocks:
            seen = [r for r, _ in seen_blocks]
            n = len(seen)

            def side_by_side(which: int) -> torch.Tensor:   # [b, hkv, n*s, d]: the seen blocks' keys or values
                return kv[seen, which].permute(1, 2, 0, 3, 4).reshape(b, hkv, n * s, d)
            visible = torch.cat([vis for _, vis in seen_blocks], dim=1) if ctx.causal else None   # [s, n*s]
            if aten:   # (dk, dv straight into their blocks of dkv: one copy)
                gq, gk, gv = _aten_grads(qf, do, of, lse_rows, side_by_side(0), side_by_side(1), visible, scale)
                dq_parts.append(gq)
                dkv[seen, 0] = gk.view(b, hkv, n, s, d).permute(2, 0, 1, 3, 4).to(dkv.dtype)
                dkv[seen, 1] = gv.view(b, hkv, n, s, d).permute(2, 0, 1, 3, 4).to(dkv.dtype)
            else:
                for r, vis in seen_blocks:
                    work(kv[r, 0], kv[r, 1], vis, dkv[r, 0], dkv[r, 1])
        # This rank's share of every rank's dk, dv, summed onto the rank that holds those positions; with the
        # overlap, the own term (zero in dkv) is added when it arrives.
        summing = start_reduce_scatter(dkv.view(R * 2 * b, hkv, s, d), ctx.name)
    if overlap:
        own_part(half, s)
    if summing is None:
        mine = own_grad
    else:
        mine = wait(summing).view(2, b, hkv, s, d)
        mine = mine + own_grad if overlap else mine
    if aten:
        dq = dq_parts[0] if len(dq_parts) == 1 else dq_parts[0].float()
        for part in dq_parts[1:]:
            dq = dq.add_(part)
    need = ctx.needs_input_grad
    return (dq.reshape(b, hq, s, d).to(q.dtype) if need[0] else None, mine[0].to(k.dtype) if need[1] else None,
            mine[1].to(v.dtype) if need[2] else None, None, None, None, None)


torch.library.register_autograd("mk::ring_attention", _backward, setup_context=_setup)
