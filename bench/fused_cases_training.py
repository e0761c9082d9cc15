"""Cases of bench/fused_ops.py for a training step: forward and backward of each fused op (family "train").

Each call runs the op forward and then ``torch.autograd.grad`` of its output against a fixed upstream
gradient, for every differentiable input. The unfused step is what a model gets from torch's own
differentiable collectives (``torch.distributed._functional_collectives``: ``all_gather_single_autograd``,
``reduce_scatter_single_autograd``, ``all_reduce``, ``all_to_all_single``, whose backward is the transposed
collective) and ATen's autograd of the computation, on the same backend. compute = the forward and backward
products alone (no communication, no autograd bookkeeping for the collectives); comm = the forward and
backward collectives alone (same bytes as the unfused step).

* GEMM ops, shapes (m, k, n) as in fused_cases_gemm.py: allgather_gemm's backward is a reduce-scatter of
  dc @ b^T (fused: ``gemm_reducescatter``) and G^T @ dc; gemm_allreduce's an allreduce of dc and two
  products; gemm_reducescatter's an all-gather of dc (fused: ``allgather_gemm``) and two products.
* MoE layer, shapes (t, h, f, k, E_r) as in fused_cases_moe_attention.py: ``moe_dispatch_gemm`` then
  ``moe_combine`` with router weights that need a gradient, against sort + all_to_all_single + per-block
  matmuls + all_to_all_single back + weighted sum. The fused backward routes x again for grad w (it keeps no
  copy of the received rows), so it moves one more all-to-all of x than the unfused autograd, which keeps
  the received rows alive from forward to backward.
* Ring attention, shapes (b, hq, hkv, s, d): fused against an all-gather of K/V and
  scaled_dot_product_attention (causal cases with the zigzag layout and the matching boolean mask).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

import superkernel.ops as mk
from fused_cases_moe_attention import attend_gathered, attention_layout
from fused_registry import Case, Context, dtype_name, register, seeded

GEMM_SHAPES = [(512, 512, 512), (1024, 1024, 1024)]
MOE_SHAPES = [(2048, 512, 1024, 2, 2)]
ATTENTION_SHAPES = [(1, 8, 2, 512, 64)]


def _gen(shape: tuple[int, ...], dtype: torch.dtype, seed: int, scale: float = 1.0,
         grad: bool = False) -> torch.Tensor:
    return seeded(shape, dtype, seed, scale).requires_grad_(grad)


def _step(forward: Callable[[], torch.Tensor], inputs: Sequence[torch.Tensor],
          dout: torch.Tensor) -> Callable[[], tuple[torch.Tensor, ...]]:
    """One training step: the forward, then the gradients of every input for the upstream gradient dout.

    A functional collective returns an AsyncCollectiveTensor that only a use of its value waits for; the
    input gradients of an all_reduce or a reduce-scatter do not use it, so without the explicit wait the
    step would end before its forward collective did (the barrier before the next call, untimed, would
    absorb the rest) and torch would warn of unwaited collectives at exit. A training loop uses the
    forward's output (the next layer, the loss), so the step waits for it."""
    def step() -> tuple[torch.Tensor, ...]:
        out = forward()
        if isinstance(out, funcol.AsyncCollectiveTensor):
            out = funcol.wait_tensor(out)
        return torch.autograd.grad(out, inputs, dout)
    return step


# ------------------------------------------------------------------------------------------------ GEMM
def gemm_cases_for(ctx: Context, m: int, k: int, n: int) -> list[Case]:
    R, g, dt, me = ctx.world_size, ctx.group, ctx.dtype, ctx.rank
    shape = f"{m}x{k}x{n} {dtype_name(dt)} fwd+bwd"
    cases = []

    # allgather_gemm: c = cat_r(a_r) @ b
    a, b = _gen((m, k), dt, me, grad=True), _gen((k, n), dt, 100, grad=True)
    dc = _gen((R * m, n), dt, 200 + me)
    gathered = torch.empty((R * m, k), dtype=dt)
    part = torch.empty((m, k), dtype=dt)
    a0, b0 = a.detach(), b.detach()

    def ag_compute() -> None:
        gathered @ b0
        dc @ b0.t()
        gathered.t() @ dc

    def ag_comm() -> None:
        dist.all_gather_into_tensor(gathered, a0, group=g)
        dist.reduce_scatter_tensor(part, gathered, group=g)

    cases.append(Case(op="allgather_gemm", shape=shape,
                      fused=_step(lambda: mk.allgather_gemm(a, b, g, chunks=ctx.chunks), (a, b), dc),
                      unfused=_step(lambda: funcol.all_gather_single_autograd(a, 0, g) @ b, (a, b), dc),
                      compute=ag_compute, comm=ag_comm))

    # gemm_allreduce: c = sum_r a_r @ b_r
    a2, b2 = _gen((m, k), dt, me, grad=True), _gen((k, n), dt, 100 + me, grad=True)
    dc2 = _gen((m, n), dt, 300 + me)
    c2 = torch.empty((m, n), dtype=dt)
    a20, b20 = a2.detach(), b2.detach()

    def ar_compute() -> None:
        a20 @ b20
        dc2 @ b20.t()
        a20.t() @ dc2

    def ar_comm() -> None:
        dist.all_reduce(c2, group=g)
        dist.all_reduce(c2, group=g)

    cases.append(Case(op="gemm_allreduce", shape=shape,
                      fused=_step(lambda: mk.gemm_allreduce(a2, b2, g, chunks=ctx.chunks), (a2, b2), dc2),
                      unfused=_step(lambda: funcol.all_reduce(a2 @ b2, "sum", g), (a2, b2), dc2),
                      compute=ar_compute, comm=ar_comm))

    # gemm_reducescatter: c = rows of this rank of sum_r a_r @ b_r
    m3 = max(R, m - m % R)
    a3, b3 = _gen((m3, k), dt, me, grad=True), _gen((k, n), dt, 100 + me, grad=True)
    dc3 = _gen((m3 // R, n), dt, 400 + me)
    full = torch.empty((m3, n), dtype=dt)
    a30, b30 = a3.detach(), b3.detach()

    def rs_compute() -> None:
        a30 @ b30
        full @ b30.t()
        a30.t() @ full

    def rs_comm() -> None:
        out = torch.empty((m3 // R, n), dtype=dt)
        dist.reduce_scatter_tensor(out, full, group=g)
        dist.all_gather_into_tensor(full, out, group=g)

    cases.append(Case(op="gemm_reducescatter", shape=f"{m3}x{k}x{n} {dtype_name(dt)} fwd+bwd",
                      fused=_step(lambda: mk.gemm_reducescatter(a3, b3, g, chunks=ctx.chunks), (a3, b3), dc3),
                      unfused=_step(lambda: funcol.reduce_scatter_single_autograd(a3 @ b3, "sum", 0, g), (a3, b3), dc3),
                      compute=rs_compute, comm=rs_comm))
    for c, flops in zip(cases, (6.0 * R * m * k * n, 6.0 * m * k * n, 6.0 * m3 * k * n)):
        c.extra = {"flops": flops}
    return cases


# ------------------------------------------------------------------------------------------------ MoE layer
def moe_layer_case(ctx: Context, t: int, h: int, f: int, k: int, er: int) -> Case:
    R, g, dt, me = ctx.world_size, ctx.group, ctx.dtype, ctx.rank
    E = R * er
    x = _gen((t, h), dt, 10 + me, grad=True)
    w = _gen((er, h, f), dt, 20 + me, scale=h ** -0.5, grad=True)
    ids = torch.randint(0, E, (t, k), generator=torch.Generator().manual_seed(30 + me))
    tw = torch.rand(t, k, generator=torch.Generator().manual_seed(40 + me)).to(dt).requires_grad_(True)
    dout = _gen((t, f), dt, 50 + me)

    def fused() -> torch.Tensor:
        y, _, handle = mk.moe_dispatch_gemm(x, ids, w, g)
        return mk.moe_combine(y, handle, tw, g)

    def route() -> tuple[torch.Tensor, list[int], list[int], torch.Tensor]:
        flat = ids.reshape(-1)
        perm = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=E)
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts, group=g)
        rc = recv_counts.view(R, er)
        return perm, counts.view(R, er).sum(1).tolist(), rc.sum(1).tolist(), rc

    def experts(received: torch.Tensor, rc: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        out, row = [], 0
        for s in range(R):   # rows arrive by source, then expert: the order they are sent back in
            for e in range(er):
                n_rows = int(rc[s, e])
                out.append(received[row:row + n_rows] @ weight[e])
                row += n_rows
        return torch.cat(out)

    def unfused() -> torch.Tensor:
        perm, send, recv, rc = route()
        received = funcol.all_to_all_single(x.index_select(0, perm // k), recv, send, g)
        home = funcol.all_to_all_single(experts(received, rc, w), send, recv, g)
        inv = torch.empty_like(perm).scatter_(0, perm, torch.arange(t * k))
        return torch.bmm(tw.reshape(t, 1, k), home.index_select(0, inv).view(t, k, f)).view(t, f)

    perm0, send0, recv0, rc0 = route()
    received0 = x.new_empty((sum(recv0), h)).detach().requires_grad_(True)
    home0 = x.new_zeros((t * k, f)).detach().requires_grad_(True)
    w0, tw0 = w.detach().requires_grad_(True), tw.detach().requires_grad_(True)
    dy0 = torch.zeros((sum(recv0), f), dtype=dt)

    def compute() -> None:
        y = experts(received0, rc0, w0)
        torch.autograd.grad(y, (received0, w0), dy0)
        out = torch.bmm(tw0.reshape(t, 1, k), home0.view(t, k, f)).view(t, f)
        torch.autograd.grad(out, (tw0, home0), dout)

    rows_h = x.detach().index_select(0, perm0 // k)
    recv_h = torch.empty((sum(recv0), h), dtype=dt)
    rows_f = torch.zeros((sum(recv0), f), dtype=dt)
    home_f = torch.empty((t * k, f), dtype=dt)

    def comm() -> None:   # counts; x out and back (its gradient); y back and out (its gradient)
        dist.all_to_all_single(torch.empty_like(rc0.reshape(-1)), torch.bincount(ids.reshape(-1), minlength=E), group=g)
        dist.all_to_all_single(recv_h, rows_h, recv0, send0, group=g)
        dist.all_to_all_single(home_f, rows_f, send0, recv0, group=g)
        dist.all_to_all_single(rows_f, home_f, recv0, send0, group=g)
        dist.all_to_all_single(rows_h, recv_h, send0, recv0, group=g)

    return Case(op="moe layer", shape=f"t={t} h={h} f={f} k={k} E={E} {dtype_name(dt)} fwd+bwd",
                fused=_step(fused, (x, w, tw), dout), unfused=_step(unfused, (x, w, tw), dout),
                compute=compute, comm=comm,
                note="fused backward routes x again for grad w (one more all-to-all than unfused)",
                extra={"flops": 6.0 * t * k * h * f})


# ------------------------------------------------------------------------------------------------ attention
def attention_case(ctx: Context, b: int, hq: int, hkv: int, s: int, d: int, causal: bool) -> Case:
    R, g, dt, me = ctx.world_size, ctx.group, ctx.dtype, ctx.rank
    q = _gen((b, hq, s, d), dt, 50 + me, grad=True)
    k = _gen((b, hkv, s, d), dt, 60 + me, grad=True)
    v = _gen((b, hkv, s, d), dt, 70 + me, grad=True)
    dout = _gen((b, hq, s, d), dt, 80 + me)
    zigzag, mask = attention_layout(me, R, s, causal)

    def unfused() -> torch.Tensor:
        kv = funcol.all_gather_single_autograd(torch.stack([k, v]).unsqueeze(0), 0, g)
        return attend_gathered(q, kv, mask)

    kv0 = torch.zeros((R, 2, b, hkv, s, d), dtype=dt, requires_grad=True)
    q0 = q.detach().requires_grad_(True)
    mine_kv = torch.empty((2, b, hkv, s, d), dtype=dt)
    full = torch.empty((R, 2, b, hkv, s, d), dtype=dt)   # not kv0: "both" runs comm while compute uses kv0

    def compute() -> None:
        torch.autograd.grad(attend_gathered(q0, kv0, mask), (q0, kv0), dout)

    def comm() -> None:
        dist.all_gather_into_tensor(full.view(-1), mine_kv.view(-1), group=g)
        dist.reduce_scatter_tensor(mine_kv.view(-1), full.reshape(-1), group=g)

    return Case(op="ring_attention", shape=f"b={b} hq={hq} hkv={hkv} s={s}x{R} d={d}{' causal' if causal else ''} "
                                           f"{dtype_name(dt)} fwd+bwd",
                fused=_step(lambda: mk.ring_attention(q, k, v, g, causal=causal, zigzag=zigzag)[0], (q, k, v), dout),
                unfused=_step(unfused, (q, k, v), dout), compute=compute, comm=comm,
                note="causal: fused zigzag layout skips masked blocks; unfused SDPA masks" if causal else "",
                extra={"flops": 12.0 * b * hq * s * R * s * d * (0.5 if causal else 1.0)})


@register("train")
def training_cases(ctx: Context) -> list[Case]:
    """Defaults: every family. With --shapes: 3-tuples are GEMM shapes, 5-tuples attention shapes (the MoE
    layer, whose shapes are 5-tuples too, runs at its defaults only)."""
    given = ctx.shapes
    gemm = [s for s in given if len(s) == 3] if given else GEMM_SHAPES
    attention = [s for s in given if len(s) == 5] if given else ATTENTION_SHAPES
    cases: list[Case] = []
    for m, k, n in gemm:
        cases += gemm_cases_for(ctx, m, k, n)
    for sh in [] if given else MOE_SHAPES:
        cases.append(moe_layer_case(ctx, *sh))
    for sh in attention:
        cases += [attention_case(ctx, *sh, causal) for causal in (False, True)]
    return cases
