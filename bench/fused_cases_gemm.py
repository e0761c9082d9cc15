"""Cases of bench/fused_ops.py for allgather_gemm, gemm_allreduce and gemm_reducescatter.

Shapes are (m, k, n) per rank: allgather_gemm's a is the [m, k] shard and b [k, n]; gemm_allreduce's a is
[m, k] (this rank's k shard) and b [k, n]; gemm_reducescatter's a is [m, k] with the group size dividing m.
The unfused composition uses the same backend's collective and ATen's matmul, back to back.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

import superkernel.ops as mk
from fused_registry import Case, Context, dtype_name, register, seeded

# comm ~ compute for gemm_allreduce at about k ~ 2 F / bw (F: flop/s per rank, bw: link bytes/s): on this
# VM (F ~ 5e10 single-thread fp32) about k ~ 60 over shm, ~100 at 10 Gbit/s, ~800 at 1 Gbit/s.
DEFAULT_SHAPES = [(256, 256, 256), (1024, 128, 1024), (1024, 1024, 1024), (2048, 512, 2048)]


def _fmt(m: int, k: int, n: int, dtype: torch.dtype) -> str:
    return f"{m}x{k}x{n} {dtype_name(dtype)}"


def allgather_gemm_case(ctx: Context, m: int, k: int, n: int) -> Case:
    R, g, dt = ctx.world_size, ctx.group, ctx.dtype
    a, b = seeded((m, k), dt, ctx.rank), seeded((k, n), dt, 100)
    gathered = torch.empty((R * m, k), dtype=dt)

    def unfused() -> torch.Tensor:
        dist.all_gather_into_tensor(gathered, a, group=g)
        return gathered @ b

    return Case(op="allgather_gemm", shape=_fmt(m, k, n, dt),
                fused=lambda: mk.allgather_gemm(a, b, g, chunks=ctx.chunks), unfused=unfused,
                compute=lambda: gathered @ b,
                comm=lambda: dist.all_gather_into_tensor(gathered, a, group=g),
                extra={"flops": 2.0 * R * m * k * n, "comm_bytes": (R - 1) * m * k * a.element_size()})


# bf16/fp16: the fused op sums partial products in fp32 (twice the bytes of a half-type collective, except
# mk's across hosts, which widens too); a product small enough to be carried travels as made (see Products
# in csrc/kernels/gemm_collectives.cc).
_HALF_PARTIALS = "fused sums fp32 partials (carried products as made)"
# other backends, where oneDNN makes the product in the half type: the products travel as made and are summed
# in fp32 on each rank (2 ranks: chunks of 1 MiB and more by the backend's half-type allreduce, the same sum)
_HALF_PRODUCTS = "fused sends half products, sums them in fp32"


def _half_note(ctx: Context) -> str:
    if ctx.dtype == torch.float32:
        return ""
    from superkernel import _C
    native = ctx.backend != "mk" and _C.half_gemm_native(str(ctx.dtype).split(".")[1])
    return _HALF_PRODUCTS if native else _HALF_PARTIALS


def gemm_allreduce_case(ctx: Context, m: int, k: int, n: int) -> Case:
    g, dt = ctx.group, ctx.dtype
    a, b = seeded((m, k), dt, ctx.rank), seeded((k, n), dt, 100 + ctx.rank)
    c = torch.empty((m, n), dtype=dt)

    def unfused() -> torch.Tensor:
        out = a @ b
        dist.all_reduce(out, group=g)
        return out

    note = _half_note(ctx)
    return Case(op="gemm_allreduce", shape=_fmt(m, k, n, dt),
                fused=lambda: mk.gemm_allreduce(a, b, g, chunks=ctx.chunks), unfused=unfused,
                compute=lambda: a @ b, comm=lambda: dist.all_reduce(c, group=g), note=note,
                extra={"flops": 2.0 * m * k * n, "comm_bytes": m * n * c.element_size()})


def gemm_reducescatter_case(ctx: Context, m: int, k: int, n: int) -> Case:
    R, g, dt = ctx.world_size, ctx.group, ctx.dtype
    m = max(R, m - m % R)
    a, b = seeded((m, k), dt, ctx.rank), seeded((k, n), dt, 100 + ctx.rank)
    full = torch.empty((m, n), dtype=dt)
    out = torch.empty((m // R, n), dtype=dt)

    def unfused() -> torch.Tensor:
        c = a @ b
        dist.reduce_scatter_tensor(out, c, group=g)
        return out

    note = _half_note(ctx)
    return Case(op="gemm_reducescatter", shape=_fmt(m, k, n, dt),
                fused=lambda: mk.gemm_reducescatter(a, b, g, chunks=ctx.chunks), unfused=unfused,
                compute=lambda: a @ b, comm=lambda: dist.reduce_scatter_tensor(out, full, group=g), note=note,
                extra={"flops": 2.0 * m * k * n, "comm_bytes": m * n * full.element_size()})


@register("gemm")
def gemm_cases(ctx: Context) -> list[Case]:
    shapes = [s for s in (ctx.shapes or DEFAULT_SHAPES) if len(s) == 3]
    cases: list[Case] = []
    for m, k, n in shapes:
        cases.append(allgather_gemm_case(ctx, m, k, n))
        cases.append(gemm_allreduce_case(ctx, m, k, n))
        cases.append(gemm_reducescatter_case(ctx, m, k, n))
    return cases
