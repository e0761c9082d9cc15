"""Cases of bench/fused_ops.py for moe_dispatch_gemm, moe_combine and ring_attention.

MoE shapes are (t, h, f, k, E_r) per rank: t tokens of hidden size h, top-k routing drawn uniformly over all
E = R*E_r experts, expert weights [E_r, h, f]. The unfused dispatch is what a model does without the fused
op: sort the rows by expert, all_to_all_single the counts, all_to_all_single the routed rows (uneven splits),
then one matmul per (expert, source) block, back to back; the unfused combine is the all_to_all_single back
and the weighted sum, from the same y as the fused op (rows by local expert, gathered into source order
for the all_to_all_single; the returned rows gathered into (token, choice) order, then one batched
[t, 1, k] x [t, k, f] product: the fused op's formulation, so the two differ only in how they move rows).
compute = the expert matmuls (resp. the weighted sum) alone, comm = the all_to_all_single calls alone.

Attention shapes are (b, hq, hkv, s, d) per rank (s positions per rank, R*s in all). The unfused ring
attention is all_gather_into_tensor of this rank's packed K/V, then scaled_dot_product_attention of the
local queries over the gathered sequence (kv heads repeated for GQA; causal cases use a boolean mask for the
zigzag positions that the fused op is given); compute = that SDPA alone, comm = the all_gather alone.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

import superkernel.ops as mk
from fused_registry import Case, Context, dtype_name, register, seeded
from superkernel.ops.attention import zigzag_positions

MOE_SHAPES = [(512, 512, 512, 2, 2), (2048, 512, 1024, 2, 2), (2048, 1024, 256, 2, 4)]
ATTENTION_SHAPES = [(1, 8, 2, 512, 64), (1, 8, 8, 1024, 64)]


# ------------------------------------------------------------------------------------------------ MoE
def moe_cases_for(ctx: Context, t: int, h: int, f: int, k: int, er: int) -> list[Case]:
    R, g, dt, me = ctx.world_size, ctx.group, ctx.dtype, ctx.rank
    E = R * er
    x = seeded((t, h), dt, 10 + me)
    w = seeded((er, h, f), dt, 20 + me, scale=h ** -0.5)
    ids = torch.randint(0, E, (t, k), generator=torch.Generator().manual_seed(30 + me))
    tw = torch.rand(t, k, generator=torch.Generator().manual_seed(40 + me)).to(dt)
    y, _, handle = mk.moe_dispatch_gemm(x, ids, w, g)

    # The unfused dispatch, step by step (the routing it needs is recomputed per call, like the fused op's).
    def route() -> tuple[torch.Tensor, list[int], list[int], torch.Tensor]:
        flat = ids.reshape(-1)
        perm = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=E)
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts, group=g)  # [R, E_r]: what each source sends to my experts
        send = counts.view(R, er).sum(1).tolist()
        recv = recv_counts.view(R, er).sum(1).tolist()
        return perm, send, recv, recv_counts.view(R, er)

    perm0, send0, recv0, rc0 = route()
    routed0 = x.index_select(0, perm0 // k)
    received0 = x.new_empty((sum(recv0), h))
    dist.all_to_all_single(received0, routed0, recv0, send0, group=g)

    def expert_matmuls(received: torch.Tensor, rc: torch.Tensor) -> list[torch.Tensor]:
        out, row = [], 0
        for s in range(R):
            for e in range(er):
                n = int(rc[s, e])
                if n:
                    out.append(received[row:row + n] @ w[e])
                row += n
        return out

    def dispatch_unfused() -> list[torch.Tensor]:
        perm, send, recv, rc = route()
        routed = x.index_select(0, perm // k)
        received = x.new_empty((sum(recv), h))
        dist.all_to_all_single(received, routed, recv, send, group=g)
        return expert_matmuls(received, rc)

    def dispatch_comm() -> None:
        counts = torch.bincount(ids.reshape(-1), minlength=E)
        dist.all_to_all_single(torch.empty_like(counts), counts, group=g)
        dist.all_to_all_single(received0, routed0, recv0, send0, group=g)

    # The unfused combine from the same y the fused op gets (rows by local expert, then source): y in
    # (source, expert) order for the all_to_all_single back along the reverse splits, then the weighted sum.
    col = rc0.sum(0).tolist()   # rows per local expert
    order = []
    for s in range(R):
        for e in range(er):
            start = sum(col[:e]) + int(rc0[:s, e].sum())
            order.extend(range(start, start + int(rc0[s, e])))
    by_source = torch.tensor(order, dtype=torch.long)
    y_by_source = y.index_select(0, by_source)
    back = x.new_empty((t * k, f))
    inv0 = torch.empty_like(perm0).scatter_(0, perm0, torch.arange(t * k))  # sorted row of (token, choice)
    weights = tw.reshape(t, 1, k).float()

    def weighted_sum(rows: torch.Tensor) -> torch.Tensor:
        return torch.bmm(weights, rows.index_select(0, inv0).view(t, k, f).float()).view(t, f).to(dt)

    def combine_unfused() -> torch.Tensor:
        home = x.new_empty((t * k, f))  # a fresh receive buffer per call, as the unfused dispatch's `received`
        dist.all_to_all_single(home, y.index_select(0, by_source), send0, recv0, group=g)
        return weighted_sum(home)

    rows = t * k
    flops = 2.0 * rows * h * f  # about this rank's share, when routing is uniform
    elt = x.element_size()
    shape = f"t={t} h={h} f={f} k={k} E={E} {dtype_name(dt)}"
    return [
        Case(op="moe_dispatch_gemm", shape=shape, fused=lambda: mk.moe_dispatch_gemm(x, ids, w, g),
             unfused=dispatch_unfused, compute=lambda: expert_matmuls(received0, rc0), comm=dispatch_comm,
             extra={"flops": flops, "comm_bytes": rows * h * elt * (R - 1) / R}),
        Case(op="moe_combine", shape=shape, fused=lambda: mk.moe_combine(y, handle, tw, g),
             unfused=combine_unfused, compute=lambda: weighted_sum(back),
             comm=lambda: dist.all_to_all_single(back, y_by_source, send0, recv0, group=g),
             extra={"flops": 2.0 * rows * f, "comm_bytes": rows * f * elt * (R - 1) / R}),
    ]


@register("moe")
def moe_cases(ctx: Context) -> list[Case]:
    shapes = [s for s in (ctx.shapes or MOE_SHAPES) if len(s) == 5]
    return [c for s in shapes for c in moe_cases_for(ctx, *s)]


# ------------------------------------------------------------------------------------------------ attention
def attention_layout(rank: int, world: int, s: int, causal: bool) -> tuple[bool, torch.Tensor | None]:
    """(zigzag, mask) of a case: causal cases use the zigzag layout when s is even, and the boolean mask
    [s, world*s] (True = attend) says which gathered key (every rank's block in rank order, each in its
    layout) each of this rank's queries sees; None without a mask."""
    zigzag = causal and s % 2 == 0
    if not causal:
        return zigzag, None
    pos = torch.cat([zigzag_positions(r, world, s) if zigzag else torch.arange(r * s, (r + 1) * s)
                     for r in range(world)])
    mine = pos[rank * s:(rank + 1) * s]
    return zigzag, pos.unsqueeze(0) <= mine.unsqueeze(1)


def attend_gathered(q: torch.Tensor, kv: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """The unfused attention: queries q [b, hq, s, d] over the gathered keys and values kv
    [R, 2, b, hkv, s, d] (kv heads repeated for grouped-query attention), by scaled_dot_product_attention."""
    R, _, b, hkv, s, d = kv.shape
    keys = kv[:, 0].permute(1, 2, 0, 3, 4).reshape(b, hkv, R * s, d)
    vals = kv[:, 1].permute(1, 2, 0, 3, 4).reshape(b, hkv, R * s, d)
    rep = q.shape[1] // hkv
    if rep > 1:
        keys, vals = keys.repeat_interleave(rep, 1), vals.repeat_interleave(rep, 1)
    return F.scaled_dot_product_attention(q, keys, vals, attn_mask=mask)


def attention_case(ctx: Context, b: int, hq: int, hkv: int, s: int, d: int, causal: bool) -> Case:
    R, g, dt, me = ctx.world_size, ctx.group, ctx.dtype, ctx.rank
    q = seeded((b, hq, s, d), dt, 50 + me)
    kv = seeded((2, b, hkv, s, d), dt, 60 + me)
    k, v = kv[0], kv[1]
    gathered = torch.empty((R, 2, b, hkv, s, d), dtype=dt)
    zigzag, mask = attention_layout(me, R, s, causal)

    def sdpa() -> torch.Tensor:
        return attend_gathered(q, gathered, mask)

    def comm() -> None:
        dist.all_gather_into_tensor(gathered.view(-1), kv.reshape(-1), group=g)

    def unfused() -> torch.Tensor:
        comm()
        return sdpa()

    comm()
    visible = 0.5 if causal else 1.0
    return Case(op="ring_attention", shape=f"b={b} hq={hq} hkv={hkv} s={s}x{R} d={d}{' causal' if causal else ''} {dtype_name(dt)}",
                fused=lambda: mk.ring_attention(q, k, v, g, causal=causal, zigzag=zigzag), unfused=unfused,
                compute=sdpa, comm=comm,
                note="causal: fused zigzag layout skips masked blocks; unfused SDPA masks" if causal else "",
                extra={"flops": 4.0 * b * hq * s * R * s * d * visible,
                       "comm_bytes": (R - 1) * kv.numel() * kv.element_size()})


@register("attention")
def attention_cases(ctx: Context) -> list[Case]:
    shapes = [s for s in (ctx.shapes or ATTENTION_SHAPES) if len(s) == 5]
    return [attention_case(ctx, *s, causal) for s in shapes for causal in (False, True)]
