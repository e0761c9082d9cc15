"""Runs inside every rank of a world (tests/transport/world.py): the three GEMM+collective ops against the
unfused reference computed in float64 from every rank's inputs, over random and awkward shapes, every dtype
and several chunk counts; gradients against float64 autograd of the whole sum of the ranks' losses; optionally the cross-rank mismatch errors, torch.library.opcheck and a
torch.compile(fullgraph=True) trace. On Gloo, half-type sums with one chunk are also checked bit for bit (see
exact_half_types). Prints one REPORT line: failures per family, result digests (the test compares them across
ranks), timings, and how many results were checked bit for bit.

    python gemm_suite.py [--backend mk|gloo] [--errors] [--opcheck] [--compile] [--large] [--widen-half-on R,...]
                         [--small-half-gemm-on R:N,...] [--tune-plain CALLS]

--widen-half-on sets SUPERKERNEL_OPS_WIDEN_HALF=1 on the ranks listed only, as in a cluster whose processors
differ in oneDNN bf16/fp16 support (the ops read it at their first half-type call). --small-half-gemm-on sets
SUPERKERNEL_OPS_SMALL_HALF_GEMM=N on rank R (else each rank measures its own small-GEMM limit; the models of
the products use every rank's, gathered at the start). --tune-plain runs only run_tune_plain.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
import traceback
from collections import defaultdict

import torch
import torch.distributed as dist


# --widen-half-on and --small-half-gemm-on, read before the imports (set_rank_variables) and listed by main()'s parser
RANK_VARIABLES = argparse.ArgumentParser(add_help=False)
RANK_VARIABLES.add_argument("--widen-half-on", default="", help="comma-separated ranks that widen half types")
RANK_VARIABLES.add_argument("--small-half-gemm-on", default="",
                            help="R:N,... sets SUPERKERNEL_OPS_SMALL_HALF_GEMM=N on rank R")
RANK_VARIABLES.add_argument("--packed-b-on", default="", help="R:V,... sets SUPERKERNEL_OPS_PACKED_B=V on rank R")


def set_rank_variables(argv: list[str]) -> None:
    """--widen-half-on R,... and --small-half-gemm-on R:N,...: this rank's SUPERKERNEL_OPS_WIDEN_HALF and
    SUPERKERNEL_OPS_SMALL_HALF_GEMM, set before superkernel is imported, which reads both (once) at import: set
    later, in main(), until 2026-12-01, they changed nothing, and the tests of ranks that differ in them ran
    ranks that did not. --packed-b-on R:V,...: this rank's SUPERKERNEL_OPS_PACKED_B (read on every call)."""
    known, _ = RANK_VARIABLES.parse_known_args(argv)
    me = int(os.environ["RANK"])
    if known.widen_half_on and me in {int(r) for r in known.widen_half_on.split(",")}:
        os.environ["SUPERKERNEL_OPS_WIDEN_HALF"] = "1"
    for item in filter(None, known.small_half_gemm_on.split(",")):
        on, limit = item.split(":")
        if int(on) == me:
            os.environ["SUPERKERNEL_OPS_SMALL_HALF_GEMM"] = limit
    for item in filter(None, known.packed_b_on.split(",")):
        on, value = item.split(":")
        if int(on) == me:
            os.environ["SUPERKERNEL_OPS_PACKED_B"] = value


set_rank_variables(sys.argv[1:])

import superkernel  # noqa: E402,F401  (registers "mk" and torch.ops.mk.*)
import superkernel.ops as mk  # noqa: E402
from superkernel import _C  # noqa: E402
from superkernel.ops.autograd import product  # noqa: E402
from rank_tensors import DTYPES, digest, mismatch, path_rules_changed, rank_tensor  # noqa: E402

failures: dict[str, list[str]] = defaultdict(list)
digests: dict[str, int] = {}
timings: dict[str, float] = defaultdict(float)
rank = world = 0
# Every rank multiplying half types as they are, on Gloo (the ops sum the half-type products here, sums_here in
# csrc/kernels/gemm_collectives.cc) or on mk over shared memory (mk's collective sums them in fp32 in rank
# order and rounds once, mk_sums_half): with one chunk (whole GEMMs, as `a @ b` makes them) the result is known
# bit for bit. On mk only while a rank's whole term fits one staging slot (exact_half_bytes; beyond, the
# in-place path multiplies it slot by slot). Set in main(); exact_half_sums counts the results so checked.
exact_half_types: set[torch.dtype] = set()
exact_half_bytes = float("inf")
exact_half_sums = 0
# Every rank's small-GEMM limit per half type (_C.small_half_limit there): the products it makes widened.
small_limits: list[dict[torch.dtype, int]] = []


def check(family: str, name: str, fn) -> None:
    t0 = time.perf_counter()
    try:
        problem = fn()
    except Exception as e:  # noqa: BLE001  (report every failure, keep going)
        problem = f"raised {type(e).__name__}: {e}\n{traceback.format_exc(limit=3)}"
    timings[family] += time.perf_counter() - t0
    if problem:
        failures[family].append(f"{name}: {problem}")


# ---------------------------------------------------------------- shapes


def shapes(seed: int, large: bool) -> list[tuple[int, int, int]]:
    """(m, k, n): fixed awkward ones plus random ones (the same on every rank)."""
    fixed = [(1, 1, 1), (5, 1, 3), (7, 13, 5), (3, 9, 1), (33, 64, 17), (130, 70, 90)]
    rnd = random.Random(seed)
    fixed += [(rnd.randint(1, 80), rnd.randint(1, 96), rnd.randint(1, 80)) for _ in range(3)]
    if large:
        fixed.append((256, 384, 320))
    return fixed


CHUNKS = [0, 1, 3, 8]


# ---------------------------------------------------------------- the three ops


def column_major(b: torch.Tensor) -> torch.Tensor:
    """The same values as b with transposed strides (what a backward passes as b.t())."""
    return b.t().contiguous().t()


def allgather_gemm_case(m: int, k: int, n: int, dtype: torch.dtype, chunks: int, gathered: bool,
                        strided: bool = False) -> str:
    key = f"ag/{m}/{k}/{n}"
    shards = [rank_tensor(key + "/a", r, (m, k), dtype) for r in range(world)]
    b = rank_tensor(key + "/b", 0, (k, n), dtype)
    b_arg = column_major(b) if strided else b
    if gathered:
        c, g = mk.allgather_gemm(shards[rank], b_arg, return_gathered=True, chunks=chunks)
        if not torch.equal(g, torch.cat(shards)):
            return "gathered A differs from cat of the shards"
    else:
        c = mk.allgather_gemm(shards[rank], b_arg, chunks=chunks)
    ref = torch.cat([s.double() for s in shards]) @ b.double()
    digests[f"ag/{m}/{k}/{n}/{dtype}/{chunks}/{gathered}"] = digest(c)
    return mismatch(c, ref, dtype)


def half_sum_problem(c: torch.Tensor, products: list[torch.Tensor], chunks: int, term_bytes: int) -> str:
    """'' unless c differs from the products' fp32 sum in rank order rounded once to c's type, where that is
    what the op computes (see exact_half_types; term_bytes: one rank's whole product)."""
    global exact_half_sums
    if c.dtype not in exact_half_types or chunks != 1 or world == 1 or term_bytes > exact_half_bytes:
        return ""
    total = products[0].float()
    for p in products[1:]:
        total = total + p.float()
    want = total.to(c.dtype)
    exact_half_sums += 1
    if torch.equal(c, want):
        return ""
    return (f"{int((c != want).sum())} of {c.numel()} elements differ from the fp32 sum in rank order of the "
            f"products, rounded once")


def products(a: list[torch.Tensor], b: list[torch.Tensor]) -> list[torch.Tensor]:
    """Every rank's partial product as that rank makes it (its own small-GEMM limit)."""
    return [product(x, y, small_limits[r].get(x.dtype)) for r, (x, y) in enumerate(zip(a, b))]


def k_of(r: int, k: int) -> int:
    """Uneven k shards: rank r holds k + r % 2 columns (k = 0 stays 0 on rank 0)."""
    return k + (r % 2)


def gemm_allreduce_case(m: int, k: int, n: int, dtype: torch.dtype, chunks: int, strided: bool = False) -> str:
    key = f"ar/{m}/{k}/{n}"
    a = [rank_tensor(key + "/a", r, (m, k_of(r, k)), dtype) for r in range(world)]
    b = [rank_tensor(key + "/b", r, (k_of(r, k), n), dtype) for r in range(world)]
    b_arg = [column_major(y) if strided else y for y in b]
    c = mk.gemm_allreduce(a[rank], b_arg[rank], chunks=chunks)
    ref = sum(x.double() @ y.double() for x, y in zip(a, b))
    digests[f"ar/{m}/{k}/{n}/{dtype}/{chunks}"] = digest(c)
    return mismatch(c, ref, dtype) or half_sum_problem(c, products(a, b_arg), chunks, c.nbytes)


def gemm_reducescatter_case(mb: int, k: int, n: int, dtype: torch.dtype, chunks: int, strided: bool = False) -> str:
    m = mb * world
    key = f"rs/{m}/{k}/{n}"
    a = [rank_tensor(key + "/a", r, (m, k_of(r, k)), dtype) for r in range(world)]
    b = [rank_tensor(key + "/b", r, (k_of(r, k), n), dtype) for r in range(world)]
    b_arg = [column_major(y) if strided else y for y in b]
    c = mk.gemm_reducescatter(a[rank], b_arg[rank], chunks=chunks)
    ref = sum(x.double() @ y.double() for x, y in zip(a, b))[rank * mb:(rank + 1) * mb]
    return mismatch(c, ref, dtype) or half_sum_problem(
        c, [p[rank * mb:(rank + 1) * mb] for p in products(a, b_arg)], chunks, world * c.nbytes)


def run_ops(large: bool) -> None:
    rnd = random.Random(1234)
    for (m, k, n) in shapes(world, large):
        for dtype in DTYPES:
            chunks = rnd.choice(CHUNKS)
            name = f"m={m} k={k} n={n} {dtype} chunks={chunks}"
            check("allgather_gemm", name, lambda: allgather_gemm_case(m, k, n, dtype, chunks, False))
            check("gemm_allreduce", name, lambda: gemm_allreduce_case(m, k, n, dtype, chunks))
            check("gemm_reducescatter", name, lambda: gemm_reducescatter_case(m, k, n, dtype, chunks))
    # a k long enough that a half-type product made as it is and one made widened and rounded differ in some
    # elements, in one GEMM below every rank's small-GEMM limit (_C.small_half_limit; as many rows as fit, at
    # least one a rank), one below the largest rank's limit (where ranks' limits differ, only some widen it)
    # and one above it (48 a rank): one chunk, so the half-type sums are checked bit for bit where that
    # applies (half_sum_problem), and allgather_gemm's digests show whether every rank made its blocks alike
    for dtype in (torch.bfloat16, torch.float16):
        fits = sorted({max(1, f([limits[dtype] for limits in small_limits]) // (world * 2048 * 64))
                       for f in (min, max)})
        for mb in fits + [48]:
            name = f"m={mb * world} k=2048 n=64 {dtype} chunks=1"
            check("gemm_allreduce", name, lambda: gemm_allreduce_case(mb * world, 2048, 64, dtype, 1))
            check("gemm_reducescatter", name, lambda: gemm_reducescatter_case(mb, 2048, 64, dtype, 1))
            check("allgather_gemm", name, lambda: allgather_gemm_case(mb, 2048, 64, dtype, 1, False))
    # every chunk count on one awkward shape (m not divisible by the chunk count), and the gathered A
    for chunks in CHUNKS + [50]:
        for dtype in DTYPES:
            name = f"m=7 k=5 n=6 {dtype} chunks={chunks}"
            check("allgather_gemm", name + " gathered", lambda: allgather_gemm_case(7, 5, 6, dtype, chunks, True))
            check("gemm_allreduce", name, lambda: gemm_allreduce_case(7, 5, 6, dtype, chunks))
            # R divides m: over tcp the ring path (chunks beyond m / R leave some empty)
            check("gemm_allreduce", f"m={7 * world} k=5 n=6 {dtype} chunks={chunks}",
                  lambda: gemm_allreduce_case(7 * world, 5, 6, dtype, chunks))
            check("gemm_reducescatter", name, lambda: gemm_reducescatter_case(7, 5, 6, dtype, chunks))
            # b with column-major strides (used in place, not copied)
            check("allgather_gemm", name + " strided b",
                  lambda: allgather_gemm_case(7, 5, 6, dtype, chunks, False, True))
            check("gemm_allreduce", f"m={7 * world} k=5 n=6 {dtype} chunks={chunks} strided b",
                  lambda: gemm_allreduce_case(7 * world, 5, 6, dtype, chunks, True))
            check("gemm_reducescatter", name + " strided b",
                  lambda: gemm_reducescatter_case(7, 5, 6, dtype, chunks, True))
    # gemm_reducescatter with 1 MiB blocks of fp32 partial sums (chunks of the collective path hold many rows)
    for dtype in DTYPES:
        chunks = rnd.choice(CHUNKS)
        check("gemm_reducescatter", f"mb=256 k=5 n=1024 {dtype} chunks={chunks}",
              lambda: gemm_reducescatter_case(256, 5, 1024, dtype, chunks))
    # half-type products of 1 MiB chunks: on Gloo two ranks sum them with the backend's allreduce in the half
    # type (exactly the fp32 sum rounded once, checked with one chunk); with two chunks of 1024 and 1023 rows
    # the first takes that allreduce, the second the gather (below 1 MiB)
    for dtype in (torch.bfloat16, torch.float16):
        check("gemm_allreduce", f"m=1024 k=4 n=512 {dtype} chunks=1", lambda: gemm_allreduce_case(1024, 4, 512, dtype, 1))
        check("gemm_allreduce", f"m=2047 k=4 n=512 {dtype} chunks=2", lambda: gemm_allreduce_case(2047, 4, 512, dtype, 2))
    # a product above mk's 64 KiB carry limit, within the 256 KiB the GEMM ops carry on other backends
    check("gemm_allreduce", "m=96 k=8 n=256 float32 chunks=0", lambda: gemm_allreduce_case(96, 8, 256, torch.float32, 0))
    # two ranks on other backends carry gemm_allreduce's product up to 512 KiB (kPairCarryBytes): 384 KiB of
    # fp16 and 512 KiB of fp32 travel in the agreement, 514 KiB of fp32 does not
    check("gemm_allreduce", "m=384 k=8 n=512 float16 chunks=0",
          lambda: gemm_allreduce_case(384, 8, 512, torch.float16, 0))
    check("gemm_allreduce", "m=256 k=8 n=512 float32 chunks=0", lambda: gemm_allreduce_case(256, 8, 512, torch.float32, 0))
    check("gemm_allreduce", "m=257 k=8 n=512 float32 chunks=0", lambda: gemm_allreduce_case(257, 8, 512, torch.float32, 0))
    # 48 KiB to each peer: from 3 ranks on more than 64 KiB in all, which allgather_gemm and gemm_reducescatter
    # carry across hosts and gemm_allreduce does not (pipeline.h's CarryTotal)
    check("allgather_gemm", "m=96 k=128 n=24 float32 chunks=0",
          lambda: allgather_gemm_case(96, 128, 24, torch.float32, 0, False))
    check("gemm_allreduce", "m=96 k=8 n=128 float32 chunks=0", lambda: gemm_allreduce_case(96, 8, 128, torch.float32, 0))
    # shards of 1.25 MiB and 4.06 MiB: on other backends allgather_gemm carries up to 4 MiB to a peer
    check("allgather_gemm", "m=320 k=1024 n=8 float32 chunks=0",
          lambda: allgather_gemm_case(320, 1024, 8, torch.float32, 0, False))
    check("allgather_gemm", "m=1040 k=1024 n=4 float32 chunks=0",
          lambda: allgather_gemm_case(1040, 1024, 4, torch.float32, 0, False))
    check("gemm_reducescatter", "mb=96 k=8 n=128 float32 chunks=0",
          lambda: gemm_reducescatter_case(96, 8, 128, torch.float32, 0))
    # empty results: m = 0, and k = 0 on rank 0 (k sharded unevenly)
    check("empty", "allgather_gemm m=0", lambda: allgather_gemm_case(0, 4, 3, torch.float32, 0, True))
    check("empty", "gemm_allreduce m=0", lambda: gemm_allreduce_case(0, 4, 3, torch.float32, 0))
    check("empty", "gemm_reducescatter m=0", lambda: gemm_reducescatter_case(0, 4, 3, torch.float32, 0))
    check("empty", "gemm_allreduce k=0", lambda: gemm_allreduce_case(6, 0, 3, torch.float32, 2))
    check("empty", "gemm_reducescatter n=0", lambda: gemm_reducescatter_case(3, 4, 0, torch.float32, 2))


# ---------------------------------------------------------------- errors


def expect_error(call, *must_contain: str) -> str:
    try:
        call()
    except RuntimeError as e:
        text = str(e)
        missing = [s for s in must_contain if s not in text]
        return f"error text lacks {missing}: {text[:400]}" if missing else ""
    return "no error raised"


def run_errors() -> None:
    if world > 1:
        run_disagreements()
    # a local argument error on the last rank only: every rank raises
    bad = torch.ones(4, 3, 1) if rank == world - 1 else torch.ones(4, 3)
    check("errors", "one rank passes a 3-D a", lambda: expect_error(
        lambda: mk.gemm_allreduce(bad, torch.ones(3, 2)), "gemm_allreduce",
        "2-D" if rank == world - 1 else f"rank {world - 1} rejected its arguments"))
    # errors every rank sees locally
    check("errors", "inner dimensions", lambda: expect_error(
        lambda: mk.allgather_gemm(torch.ones(4, 3), torch.ones(5, 2)), "allgather_gemm", "inner dimensions"))
    if world > 1:
        check("errors", "R does not divide m", lambda: expect_error(
            lambda: mk.gemm_reducescatter(torch.ones(world * 2 + 1, 3), torch.ones(3, 2)), "gemm_reducescatter",
            "must divide m"))
    check("errors", "int dtype", lambda: expect_error(
        lambda: mk.gemm_allreduce(torch.ones(2, 2, dtype=torch.int32), torch.ones(2, 2, dtype=torch.int32)),
        "not supported"))
    check("errors", "unknown group", lambda: expect_error(
        lambda: torch.ops.mk.gemm_allreduce(torch.ones(2, 2), torch.ones(2, 2), "no-such-group"), "no process group"))
    # the group is still usable afterwards, with correct results
    check("errors", "usable after errors", lambda: gemm_allreduce_case(9, 4, 5, torch.float32, 2))


def run_disagreements() -> None:
    """Ranks disagree on k (allgather_gemm), on n and dtype (gemm_allreduce), on m (gemm_reducescatter)."""
    f32 = torch.float32
    a = torch.ones(4, 3 + rank)
    check("errors", "allgather_gemm k differs", lambda: expect_error(
        lambda: mk.allgather_gemm(a, torch.ones(3 + rank, 5)), "allgather_gemm", "k differs", "rank 0 has 3",
        f"rank {world - 1} has {3 + world - 1}"))
    check("errors", "gemm_allreduce n differs", lambda: expect_error(
        lambda: mk.gemm_allreduce(torch.ones(4, 2), torch.ones(2, 5 + rank)), "gemm_allreduce", "n differs"))
    dt = torch.bfloat16 if rank == world - 1 else f32
    check("errors", "gemm_allreduce dtype differs", lambda: expect_error(
        lambda: mk.gemm_allreduce(torch.ones(4, 2, dtype=dt), torch.ones(2, 5, dtype=dt)), "gemm_allreduce",
        "dtype differs", "BFloat16"))
    check("errors", "gemm_reducescatter m differs", lambda: expect_error(
        lambda: mk.gemm_reducescatter(torch.ones(world * (2 + rank), 2), torch.ones(2, 3)), "gemm_reducescatter",
        "m differs"))
    # rank 0 calls another op than the rest: every rank names both ops (and the group stays in step)
    other = "gemm_allreduce" if rank == 0 else "allgather_gemm"
    op = mk.gemm_allreduce if rank == 0 else mk.allgather_gemm
    check("errors", "different ops", lambda: expect_error(
        lambda: op(torch.ones(world * 2, 2), torch.ones(2, 3)), other, "different fused-op calls",
        "gemm_allreduce" if rank else "allgather_gemm"))
    # the in-place switch differs between ranks (they would pick different collectives): an error everywhere
    if rank == 0:
        os.environ["SUPERKERNEL_OPS_IN_PLACE"] = "0"
    try:
        for name, fn in (("allgather_gemm", lambda: mk.allgather_gemm(torch.ones(4, 3), torch.ones(3, 5))),
                         ("gemm_allreduce", lambda: mk.gemm_allreduce(torch.ones(4, 3), torch.ones(3, 5))),
                         ("gemm_reducescatter",
                          lambda: mk.gemm_reducescatter(torch.ones(world * 2, 3), torch.ones(3, 5)))):
            check("errors", f"{name} in-place switch differs", lambda: expect_error(
                fn, name, "SUPERKERNEL_OPS_IN_PLACE differs", "rank 0 has 0", f"rank {world - 1} has 1"))
    finally:
        os.environ.pop("SUPERKERNEL_OPS_IN_PLACE", None)
    if os.environ.get("SUPERKERNEL_TRANSPORT") == "tcp":  # (only read where a ring could run)
        run_transport_rule_errors()


def invalid_on_rank0(name: str, var: str, value: str, kind: str, op: str, call) -> None:
    """``var`` set to an invalid ``value`` on rank 0 only: rank 0 names the variable, every other rank says
    rank 0 rejected its call (the caller restores the variable)."""
    if rank == 0:
        os.environ[var] = value
    check("errors", name, lambda: expect_error(
        call, op, f"{var} must be {kind} integer, got '{value}'" if rank == 0 else "rank 0 rejected its arguments"))


def run_transport_rule_errors() -> None:
    """Across hosts: SUPERKERNEL_OPS_RING_MIN_ROWS and SUPERKERNEL_OPS_CARRY_BYTES, invalid or different
    between ranks."""
    with path_rules_changed("SUPERKERNEL_OPS_RING_MIN_ROWS", "SUPERKERNEL_OPS_CARRY_BYTES"):
        # the carry limit differs (rank 0 carries nothing, the others would): no error, every rank takes the
        # usual path and drops what came along; the results stay right
        if rank == 0:
            os.environ["SUPERKERNEL_OPS_CARRY_BYTES"] = "0"
        check("errors", "carry limit differs: gemm_allreduce", lambda: gemm_allreduce_case(9, 4, 5, torch.float32, 0))
        check("errors", "carry limit differs: gemm_reducescatter",
              lambda: gemm_reducescatter_case(3, 4, 5, torch.float32, 0))
        check("errors", "carry limit differs: allgather_gemm",
              lambda: allgather_gemm_case(3, 4, 5, torch.float32, 0, True))
        invalid_on_rank0("carry limit invalid", "SUPERKERNEL_OPS_CARRY_BYTES", "-1", "a non-negative",
                         "gemm_reducescatter", lambda: mk.gemm_reducescatter(torch.ones(2 * world, 3), torch.ones(3, 5)))
        os.environ["SUPERKERNEL_OPS_CARRY_BYTES"] = "0"  # (the small calls below would be carried)
        check("errors", "usable after the carry limit errors", lambda: gemm_allreduce_case(9, 4, 5, torch.float32, 0))
        # the ring threshold differs (rank 0 would not ring, the others would): an error everywhere
        if rank == 0:
            os.environ["SUPERKERNEL_OPS_RING_MIN_ROWS"] = "1000"
        for name, fn in (("allgather_gemm", lambda: mk.allgather_gemm(torch.ones(64, 3), torch.ones(3, 5))),
                         ("gemm_allreduce", lambda: mk.gemm_allreduce(torch.ones(64 * world, 3), torch.ones(3, 5))),
                         ("gemm_reducescatter",
                          lambda: mk.gemm_reducescatter(torch.ones(64 * world, 3), torch.ones(3, 5)))):
            check("errors", f"{name} ring threshold differs", lambda: expect_error(
                fn, name, "ring differs", "rank 0 has 0", f"rank {world - 1} has 1"))
        invalid_on_rank0("ring threshold invalid", "SUPERKERNEL_OPS_RING_MIN_ROWS", "many", "a positive",
                         "gemm_allreduce", lambda: mk.gemm_allreduce(torch.ones(64 * world, 3), torch.ones(3, 5)))


# ---------------------------------------------------------------- gradients
# The loss is the sum of every rank's loss L_p = sum(c_p * w_p) (w_p random per rank); the reference
# builds every rank's inputs in float64, computes the whole sum and backpropagates it locally.


def _leaves(key: str, shapes_by_rank: list[tuple[int, int]], dtype: torch.dtype) -> list[torch.Tensor]:
    return [rank_tensor(key, r, shp, dtype).double().requires_grad_() for r, shp in enumerate(shapes_by_rank)]


def _compare(name_grads: list[tuple[str, torch.Tensor | None, torch.Tensor | None]], dtype: torch.dtype) -> str:
    problems = []
    for name, got, ref in name_grads:
        if (got is None) != (ref is None):
            problems.append(f"{name}: gradient {'missing' if got is None else 'unexpected'}")
        elif got is not None:
            p = mismatch(got, ref, dtype)
            if p:
                problems.append(f"{name}: {p}")
    return "; ".join(problems)


def grad_allgather_gemm_case(m: int, k: int, n: int, dtype: torch.dtype, chunks: int, gathered: bool,
                             b_grad: bool) -> str:
    key = f"g-ag/{m}/{k}/{n}"
    A = _leaves(key + "/a", [(m, k)] * world, dtype)
    B = _leaves(key + "/b", [(k, n)] * world, dtype)
    W = [rank_tensor(key + "/w", r, (world * m, n), dtype).double() for r in range(world)]
    V = [rank_tensor(key + "/v", r, (world * m, k), dtype).double() for r in range(world)]
    G = torch.cat(A)
    ref_loss = sum((G @ B[p] * W[p]).sum() + ((G * V[p]).sum() if gathered else 0) for p in range(world))
    ref_loss.backward()
    a = A[rank].detach().to(dtype).requires_grad_()
    b = B[rank].detach().to(dtype).requires_grad_(b_grad)
    out = mk.allgather_gemm(a, b, return_gathered=gathered, chunks=chunks)
    c, g = out if gathered else (out, None)
    loss = (c * W[rank].to(dtype)).sum() + ((g * V[rank].to(dtype)).sum() if gathered else 0)
    loss.backward()
    return _compare([("grad a", a.grad, A[rank].grad), ("grad b", b.grad, B[rank].grad if b_grad else None)], dtype)


def grad_gemm_allreduce_case(m: int, k: int, n: int, dtype: torch.dtype, chunks: int) -> str:
    key = f"g-ar/{m}/{k}/{n}"
    A = _leaves(key + "/a", [(m, k_of(r, k)) for r in range(world)], dtype)
    B = _leaves(key + "/b", [(k_of(r, k), n) for r in range(world)], dtype)
    W = [rank_tensor(key + "/w", r, (m, n), dtype).double() for r in range(world)]
    S = sum(x @ y for x, y in zip(A, B))
    sum((S * W[p]).sum() for p in range(world)).backward()
    a, b = A[rank].detach().to(dtype).requires_grad_(), B[rank].detach().to(dtype).requires_grad_()
    (mk.gemm_allreduce(a, b, chunks=chunks) * W[rank].to(dtype)).sum().backward()
    return _compare([("grad a", a.grad, A[rank].grad), ("grad b", b.grad, B[rank].grad)], dtype)


def grad_gemm_reducescatter_case(mb: int, k: int, n: int, dtype: torch.dtype, chunks: int) -> str:
    m = mb * world
    key = f"g-rs/{m}/{k}/{n}"
    A = _leaves(key + "/a", [(m, k_of(r, k)) for r in range(world)], dtype)
    B = _leaves(key + "/b", [(k_of(r, k), n) for r in range(world)], dtype)
    W = [rank_tensor(key + "/w", r, (mb, n), dtype).double() for r in range(world)]
    S = sum(x @ y for x, y in zip(A, B))
    sum((S[p * mb:(p + 1) * mb] * W[p]).sum() for p in range(world)).backward()
    a, b = A[rank].detach().to(dtype).requires_grad_(), B[rank].detach().to(dtype).requires_grad_()
    (mk.gemm_reducescatter(a, b, chunks=chunks) * W[rank].to(dtype)).sum().backward()
    return _compare([("grad a", a.grad, A[rank].grad), ("grad b", b.grad, B[rank].grad)], dtype)


def busy(case):
    """case() while an asynchronous 16 MiB allreduce is still queued or running on the group: on mk the op's
    collective then waits its turn (and may run on ProcessGroupMK's worker thread, with the caller's
    autograd state). Also checks that allreduce's result."""
    def run() -> str:
        big = torch.full((4 << 20,), float(rank + 1))
        work = dist.all_reduce(big, async_op=True)
        try:
            problem = case()
        finally:
            work.wait()
        want = float(world * (world + 1) // 2)
        return problem or ("" if torch.all(big == want) else "the concurrent allreduce's result is wrong")
    return run


def run_grads() -> None:
    for (m, k, n), dtype, chunks in [((5, 3, 4), torch.float32, 0), ((7, 13, 5), torch.float32, 3),
                                     ((33, 64, 17), torch.bfloat16, 0), ((1, 1, 1), torch.float16, 1)]:
        name = f"m={m} k={k} n={n} {dtype} chunks={chunks}"
        for gathered, b_grad in [(False, True), (True, True), (False, False)]:
            check("grad", f"allgather_gemm {name} return_gathered={gathered} b.requires_grad={b_grad}",
                  lambda: grad_allgather_gemm_case(m, k, n, dtype, chunks, gathered, b_grad))
        check("grad", f"gemm_allreduce {name}", lambda: grad_gemm_allreduce_case(m, k, n, dtype, chunks))
        check("grad", f"gemm_reducescatter {name}", lambda: grad_gemm_reducescatter_case(m, k, n, dtype, chunks))
    # inputs that require grad while the group is busy with another collective
    m, k, n, dtype = 8 * world, 24, 40, torch.float32
    check("grad", "allgather_gemm while busy",
          busy(lambda: grad_allgather_gemm_case(m, k, n, dtype, 0, True, True)))
    check("grad", "gemm_allreduce while busy", busy(lambda: grad_gemm_allreduce_case(m, k, n, dtype, 0)))
    check("grad", "gemm_reducescatter while busy",
          busy(lambda: grad_gemm_reducescatter_case(m // world, k, n, dtype, 0)))


# ---------------------------------------------------------------- opcheck and compile


def run_opcheck() -> None:
    name = mk.group_name()
    m = 4 * world
    cases = [
        (torch.ops.mk.allgather_gemm.default, (torch.randn(3, 5), torch.randn(5, 4), name, False, 0)),
        (torch.ops.mk.allgather_gemm.default, (torch.randn(3, 5), torch.randn(5, 4), name, True, 2)),
        (torch.ops.mk.gemm_allreduce.default, (torch.randn(5, 3), torch.randn(3, 4), name, 0)),
        (torch.ops.mk.gemm_reducescatter.default, (torch.randn(m, 3), torch.randn(3, 4), name, 2)),
        (torch.ops.mk.gemm_allreduce.default, (torch.randn(5, 3, dtype=torch.bfloat16),
                                               torch.randn(3, 4, dtype=torch.bfloat16), name, 0)),
        # inputs that require gradients: opcheck then also checks the autograd registration (gemm_grad.py)
        (torch.ops.mk.allgather_gemm.default, (torch.randn(3, 5, requires_grad=True),
                                               torch.randn(5, 4, requires_grad=True), name, False, 0)),
        (torch.ops.mk.allgather_gemm.default, (torch.randn(3, 5, requires_grad=True),
                                               torch.randn(5, 4, requires_grad=True), name, True, 0)),
        (torch.ops.mk.gemm_allreduce.default, (torch.randn(5, 3, requires_grad=True),
                                               torch.randn(3, 4, requires_grad=True), name, 0)),
        (torch.ops.mk.gemm_reducescatter.default, (torch.randn(m, 3, requires_grad=True),
                                                   torch.randn(3, 4, requires_grad=True), name, 0)),
    ]
    for op, args in cases:
        torch.manual_seed(0)  # same random inputs on every rank are fine: opcheck only compares shapes/metadata
        check("opcheck", str(op), lambda: _opcheck(op, args))


def _opcheck(op, args) -> str:
    result = torch.library.opcheck(op, args)
    bad = {k: v for k, v in result.items() if v != "SUCCESS"}
    return f"{bad}" if bad else ""


def run_compile() -> None:
    def f(a: torch.Tensor, b: torch.Tensor, a2: torch.Tensor) -> torch.Tensor:
        c = mk.gemm_allreduce(torch.relu(a), b)
        d = mk.allgather_gemm(a2, c.t().contiguous())
        return mk.gemm_reducescatter(d, c) * 2

    def case() -> str:
        torch._dynamo.reset()
        a = rank_tensor("compile/a", rank, (4 * world, 6), torch.float32)
        b = rank_tensor("compile/b", rank, (6, 5), torch.float32)
        a2 = rank_tensor("compile/a2", rank, (2, 5), torch.float32)
        eager = f(a, b, a2)
        compiled = torch.compile(f, fullgraph=True, backend=os.environ.get("SK_COMPILE_BACKEND", "aot_eager"))
        out = compiled(a, b, a2)
        return mismatch(out, eager.double(), torch.float32)

    check("compile", "fullgraph trace", case)


def run_tune_plain(calls: int) -> None:
    """Each GEMM op at one shape whose blocks have the ring's 64 rows (allgather_gemm's shard; the other two's
    m / R, on 2 ranks), called `calls` times with an automatic chunk count (allgather_gemm alternating the
    gathered A): across hosts the chunk tuner times the ring's chunk counts and the plain path (one GEMM and
    mk's collective) on these calls; every call is checked, and allgather_gemm's and gemm_allreduce's results
    are digested per call (a call that raised is a failure and has no digest)."""
    def digest_as(case_key: str, call_key: str) -> None:
        # (popped: the next call of the case must not find this one's digest if it raises)
        got = digests.pop(case_key, None)
        if got is not None:
            digests[call_key] = got

    for i in range(calls):
        for dtype in (torch.float32, torch.bfloat16):
            name = f"call {i} {dtype}"
            check("allgather_gemm", name, lambda: allgather_gemm_case(96, 40, 24, dtype, 0, i % 2 == 1))
            digest_as(f"ag/96/40/24/{dtype}/0/{i % 2 == 1}", f"tune/ag/{i}/{dtype}")
            check("gemm_allreduce", name, lambda: gemm_allreduce_case(64 * world, 40, 24, dtype, 0))
            digest_as(f"ar/{64 * world}/40/24/{dtype}/0", f"tune/ar/{i}/{dtype}")
            check("gemm_reducescatter", name, lambda: gemm_reducescatter_case(64, 40, 24, dtype, 0))


def main() -> None:
    global rank, world, exact_half_bytes
    ap = argparse.ArgumentParser(parents=[RANK_VARIABLES])
    ap.add_argument("--backend", default="mk")
    ap.add_argument("--errors", action="store_true")
    ap.add_argument("--opcheck", action="store_true")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--large", action="store_true")
    ap.add_argument("--tune-plain", type=int, default=0, help="only each op at one shape, this many calls")
    args = ap.parse_args()  # (--widen-half-on and --small-half-gemm-on took effect before the imports)
    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = {t: _C.small_half_limit(str(t).split(".")[1]) for t in (torch.bfloat16, torch.float16)}
    small_limits.extend([{}] * world)
    dist.all_gather_object(small_limits, mine)
    mk_shm = args.backend == "mk" and os.environ.get("SUPERKERNEL_TRANSPORT") == "shm"
    if (args.backend == "gloo" or mk_shm) and not args.widen_half_on:
        exact_half_types.update(t for t in (torch.bfloat16, torch.float16)
                                if _C.half_gemm_native(str(t).split(".")[1]))
        if mk_shm:
            exact_half_bytes = int(os.environ.get("SUPERKERNEL_SHM_CHUNK", 1 << 20))
    t0 = time.perf_counter()
    if args.tune_plain:
        run_tune_plain(args.tune_plain)
    else:
        run_ops(args.large)
        run_grads()
    if args.errors:
        run_errors()
    if args.opcheck:
        run_opcheck()
    if args.compile:
        run_compile()
    timings["total"] = time.perf_counter() - t0
    dist.barrier()
    report = {"rank": rank, "world": world, "failures": failures, "digests": digests, "timings": timings,
              "exact_half_sums": exact_half_sums, "exact_half_types": sorted(str(t) for t in exact_half_types),
              # what this rank's process decided (the tests check that --widen-half-on and --small-half-gemm-on
              # reached it)
              "half_native": {str(t): _C.half_gemm_native(str(t).split(".")[1]) for t in (torch.bfloat16,
                                                                                         torch.float16)},
              "small_limits": {str(t): v for t, v in small_limits[rank].items()},
              "packed_products": _C.packed_products()}
    sys.stdout.write("REPORT " + json.dumps(report) + "\n")
    sys.stdout.flush()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
