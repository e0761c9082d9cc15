"""Runs inside every rank of a world (tests/transport/world.py): mk.moe_dispatch_gemm and mk.moe_combine
for many routings (uniform, all tokens to one rank so the others receive none, all local, t = 0 or 1 on some
ranks, top-1 .. top-3), shapes and dtypes, each checked against the unfused computation in float64: every
rank regenerates every rank's tokens, expert ids and weights from a shared seed, so it knows exactly which
rows it must receive, in which order (local expert, source rank, token, choice), and what combine must give
back; gradients of both ops against float64 autograd of the sum of every rank's loss. Also mismatched
calls that must fail on every rank, and (with --opcheck) torch.library.opcheck, (with --compile)
torch.compile(fullgraph=True), forward and a training step.
Prints one REPORT line: per family, the failures (empty when all passed).

Usage: moe_suite.py [--backend mk|gloo] [--opcheck] [--compile]
"""
from __future__ import annotations

import json
import sys
import time
import traceback
import zlib
from collections import defaultdict

import torch
import torch.distributed as dist

import superkernel  # noqa: F401  (registers "mk")
from superkernel.ops.moe import moe_combine, moe_dispatch_gemm

TOL = {torch.float32: 1e-5, torch.bfloat16: 1.5e-2, torch.float16: 3e-3}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# name: (tokens on rank 0, extra tokens per rank, h, f, top-k, experts per rank, routing)
CASES = {
    "uniform": (5, 2, 16, 8, 2, 2, "uniform"),
    "top1-awkward": (7, 3, 13, 11, 1, 3, "uniform"),
    "top3-one-expert-per-rank": (4, 1, 8, 5, 3, 1, "uniform"),
    "empty-and-single-token": (0, 1, 6, 4, 2, 2, "uniform"),
    "all-to-rank-0": (6, 1, 8, 8, 2, 2, "rank0"),
    "all-local": (6, 0, 8, 8, 2, 2, "local"),
    "all-to-last-rank": (3, 2, 9, 7, 2, 1, "last"),
    # 3 ranks, fp32: ~50 KiB of rows to each peer, ~100 KiB to both (carried by the per-peer limit)
    "carried-near-limit": (150, 2, 128, 96, 2, 2, "uniform"),
    # ~5 MiB per pair in fp32 on 2-4 ranks: dispatch splits the transfers (mk: 512 KiB pieces; CPU
    # backends' alltoall_base: 4 MiB steps)
    "several-pieces": (5000, 0, 512, 16, 2, 2, "uniform"),
}

rank = world = 0
device = torch.device("cpu")  # where the op runs (nccl_suite.py sets cuda); references stay on the CPU
failures: dict[str, list[str]] = defaultdict(list)


def generator(key: str) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(key.encode()))


def inputs(case: str, r: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """Rank r's x [t, h], topk_ids [t, k], topk_weights [t, k] and w [E_r, h, f] for `case`."""
    t0, dt, h, f, k, er, routing = CASES[case]
    t = t0 + dt * r
    g = generator(f"moe/{case}/{r}/{dtype}")
    n_experts = er * world
    x = torch.randn(t, h, generator=g, dtype=torch.float64).to(dtype)
    lo, hi = {"uniform": (0, n_experts), "rank0": (0, er), "local": (r * er, (r + 1) * er),
              "last": ((world - 1) * er, n_experts)}[routing]
    ids = torch.randint(lo, hi, (t, k), generator=g)
    tw = torch.rand(t, k, generator=g, dtype=torch.float64).to(dtype)
    w = (torch.randn(er, h, f, generator=g, dtype=torch.float64) / h ** 0.5).to(dtype)
    return x, ids, tw, w


def reference(case: str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's dispatch output, counts and combine output, in float64 from the (rounded) inputs."""
    er = CASES[case][5]
    every = [inputs(case, r, dtype) for r in range(world)]
    ws = [w.double() for *_, w in every]
    rows, counts = [], []
    for e in range(er):
        expert = rank * er + e
        n = 0
        for x, ids, _, _ in every:
            tokens = (ids == expert).nonzero()[:, 0]  # row-major: token, then choice
            rows.append(x[tokens].double() @ ws[rank][e])
            n += tokens.numel()
        counts.append(n)
    f = CASES[case][3]
    y = torch.cat(rows) if rows else torch.zeros(0, f, dtype=torch.float64)
    x, ids, tw, _ = every[rank]
    xw = torch.einsum("th,ehf->tef", x.double(), torch.cat(ws))                 # [t, E, f]
    picked = xw[torch.arange(ids.shape[0]).unsqueeze(1), ids]                   # [t, k, f]
    out = (tw.double().unsqueeze(-1) * picked).sum(1)
    return y, torch.tensor(counts), out


def close(got: torch.Tensor, want: torch.Tensor, tol: float) -> str:
    if got.shape != want.shape:
        return f"shape {tuple(got.shape)} != {tuple(want.shape)}"
    if got.numel() == 0:
        return ""
    err = (got.double() - want).abs().max().item()
    bound = tol * (1 + want.abs().max().item())
    return "" if err <= bound else f"max abs error {err:.3g} > {bound:.3g}"


def check_case(case: str, dtype: torch.dtype) -> None:
    name = f"{case} {dtype}"
    x, ids, tw, w = (t.to(device) for t in inputs(case, rank, dtype))
    y, counts, handle = moe_dispatch_gemm(x, ids, w)
    out = moe_combine(y, handle, tw)
    y, counts, out = y.cpu(), counts.cpu(), out.cpu()
    want_y, want_counts, want_out = reference(case, dtype)
    if y.dtype != dtype or out.dtype != dtype or counts.dtype != torch.int64:
        failures["dispatch"].append(f"{name}: dtypes y {y.dtype}, out {out.dtype}, counts {counts.dtype}")
    if not torch.equal(counts, want_counts):
        failures["dispatch"].append(f"{name}: counts {counts.tolist()} != {want_counts.tolist()}")
    if problem := close(y, want_y, TOL[dtype]):
        failures["dispatch"].append(f"{name}: y: {problem}")
    if problem := close(out, want_out, TOL[dtype]):
        failures["combine"].append(f"{name}: {problem}")


GRAD_TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 5e-3}
GRAD_CASES = ["uniform", "top1-awkward", "top3-one-expert-per-rank", "empty-and-single-token", "all-to-rank-0",
              "all-local", "several-pieces"]


def loss_weights(case: str, r: int, n_recv: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank r's weights of its y [n_recv, f] and out [t, f] in its loss (rounded to dtype)."""
    t0, dt, _, f, *_ = CASES[case]
    g = generator(f"moe-grad/{case}/{r}/{dtype}")
    return (torch.randn(n_recv, f, generator=g, dtype=torch.float64).to(dtype),
            torch.randn(t0 + dt * r, f, generator=g, dtype=torch.float64).to(dtype))


def grad_case(case: str, dtype: torch.dtype, y_term: bool, train_w: bool, train_tw: bool,
              tw_dtype: torch.dtype | None = None) -> None:
    """Gradients of the sum over ranks of L_p = sum(y_p * Wy_p) + sum(combine(y_p) * Wo_p) (the y term
    optional) against float64 autograd of the same sum computed from every rank's inputs. ``tw_dtype``: the
    router weights in another dtype than x and w (their values as rounded to ``dtype``)."""
    name = f"{case} {dtype} y_term={y_term} train_w={train_w} train_tw={train_tw} tw_dtype={tw_dtype}"
    er = CASES[case][5]
    every = [inputs(case, r, dtype) for r in range(world)]
    X = [x.double().requires_grad_() for x, *_ in every]
    TW = [tw.double().requires_grad_(train_tw) for _, _, tw, _ in every]
    Wt = [w.double().requires_grad_(train_w) for *_, w in every]
    w_all = torch.cat(Wt)  # [E, h, f]
    total = torch.zeros((), dtype=torch.float64)
    my_wy = my_wo = None
    for p in range(world):
        rows = [X[src][(ids == p * er + e).nonzero()[:, 0]] @ Wt[p][e]
                for e in range(er) for src, (_, ids, _, _) in enumerate(every)]
        y_p = torch.cat(rows)
        xw = torch.einsum("th,ehf->tef", X[p], w_all)                         # [t, E, f]
        ids_p = every[p][1]
        picked = xw[torch.arange(ids_p.shape[0]).unsqueeze(1), ids_p]          # [t, k, f]
        out_p = (TW[p].unsqueeze(-1) * picked).sum(1)
        wy, wo = loss_weights(case, p, y_p.shape[0], dtype)
        total = total + (out_p * wo.double()).sum() + ((y_p * wy.double()).sum() if y_term else 0)
        if p == rank:
            my_wy, my_wo = wy, wo
    total.backward()

    x, ids, tw, w = every[rank]
    x = x.to(device).requires_grad_()
    tw, w = tw.to(device, tw_dtype or dtype).requires_grad_(train_tw), w.to(device).requires_grad_(train_w)
    y, _, handle = moe_dispatch_gemm(x, ids.to(device), w)
    loss = (moe_combine(y, handle, tw) * my_wo.to(device)).sum()
    if y_term:
        loss = loss + (y * my_wy.to(device)).sum()
    loss.backward()
    for what, leaf, ref in (("dx", x, X[rank]), ("dw", w, Wt[rank]), ("dtopk_weights", tw, TW[rank])):
        if not ref.requires_grad:
            if leaf.grad is not None:
                failures["grad"].append(f"{name}: {what} set on a tensor that does not require grad")
        elif leaf.grad is None or leaf.grad.dtype != leaf.dtype:
            failures["grad"].append(f"{name}: {what} {'missing' if leaf.grad is None else leaf.grad.dtype}")
        elif problem := close(leaf.grad.cpu(), ref.grad, GRAD_TOL[dtype]):
            failures["grad"].append(f"{name}: {what}: {problem}")


def expect_error(name: str, fn, needle: str) -> None:
    try:
        fn()
    except RuntimeError as e:
        if needle not in str(e):
            failures["errors"].append(f"{name}: error without {needle!r}: {str(e)[:300]}")
        return
    failures["errors"].append(f"{name}: no error")


def handle_of_next_rank(handle: torch.Tensor) -> torch.Tensor:
    """``handle`` as if the next rank had made it (with one rank: as if from a group one larger)."""
    forged = handle.clone()
    if world > 1:
        forged[2] = (rank + 1) % world
    else:
        forged[1] = 2
    return forged


def check_errors() -> None:
    x = torch.randn(4, 8)
    ids = torch.randint(0, 2 * world, (4, 2))
    w = torch.randn(2, 8, 5)
    if world > 1:
        wide = torch.randn(4, 9) if rank == world - 1 else x
        wide_w = torch.randn(2, 9, 5) if rank == world - 1 else w
        expect_error("hidden size differs", lambda: moe_dispatch_gemm(wide, ids, wide_w), "hidden size")
        more = torch.randn(3, 8, 5) if rank == 0 else w
        expect_error("experts per rank differ", lambda: moe_dispatch_gemm(x, ids, more), "experts per rank")
        half = w.half() if rank == 0 else w
        expect_error("dtype differs", lambda: moe_dispatch_gemm(x.to(half.dtype), ids, half), "dtype")
    bad = ids.clone()
    if rank == 0:
        bad[1, 1] = 2 * world  # one past the last expert
    expect_error("expert id out of range", lambda: moe_dispatch_gemm(x, bad, w),
                 "out of range" if rank == 0 else "rank 0")
    y, _, handle = moe_dispatch_gemm(x, ids, w)
    tw = torch.rand(4, 3) if rank == 0 else torch.rand(4, 2)
    expect_error("combine weights of the wrong shape", lambda: moe_combine(y, handle, tw),
                 "topk_weights" if rank == 0 else "rank 0")
    # a handle whose counts or send order were modified (the combine copies rows at the offsets they give): an
    # error on every rank, before any row moves
    forged = handle.clone()
    forged[-1] = forged[-2]  # the last (token, choice) repeats the one before
    expect_error("send order not a permutation", lambda: moe_combine(y, forged, torch.rand(4, 2)),
                 "not a permutation")
    forged = handle.clone()
    forged[8] += 1  # one more row received from rank 0 for local expert 0 than y holds
    expect_error("counts that do not add up", lambda: moe_combine(y, forged, torch.rand(4, 2)), "add up to")
    # the backward ops refuse a tensor that is not this rank's routing handle (before any exchange)
    name = dist.distributed_c10d._get_default_group().group_name
    for what, bogus in (("zeros", torch.zeros(40, dtype=torch.int64)),
                        ("another rank's", handle_of_next_rank(handle))):
        try:
            torch.ops.mk.moe_combine_backward(torch.randn(4, 5), y, bogus, torch.rand(4, 2), name, True, True)
            failures["errors"].append(f"backward with {what} handle: no error")
        except ValueError as e:
            if "not a routing handle" not in str(e):
                failures["errors"].append(f"backward with {what} handle: {e}")
    check_case("uniform", torch.float32)  # the group is still usable


def check_opcheck() -> None:
    name = dist.distributed_c10d._get_default_group().group_name
    x = torch.randn(5, 8)
    ids = torch.randint(0, 2 * world, (5, 2))
    w = torch.randn(2, 8, 4)
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()

    def combine_args(grad: bool) -> tuple:
        y, _, handle = torch.ops.mk.moe_dispatch_gemm(x, ids, w, name)
        return y.requires_grad_(grad), handle, torch.rand(5, 2, requires_grad=grad), name

    # with inputs that require grad, opcheck also checks the autograd registration
    for op, grad, args in (("moe_dispatch_gemm", False, lambda: (x, ids, w, name)),
                           ("moe_dispatch_gemm", True, lambda: (xg, ids, wg, name)),
                           ("moe_combine", False, lambda: combine_args(False)),
                           ("moe_combine", True, lambda: combine_args(True))):
        try:
            torch.library.opcheck(getattr(torch.ops.mk, op).default, args())
        except Exception:
            failures["opcheck"].append(f"{op} grad={grad}: {traceback.format_exc(limit=3)[-1500:]}")


def check_compile() -> None:
    """torch.compile(fullgraph=True) of a dispatch -> activation -> combine layer (the fake kernels, with the
    data-dependent row count) against the eager result, forward and backward."""
    def layer(x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, tw: torch.Tensor) -> torch.Tensor:
        y, _, handle = moe_dispatch_gemm(x, ids, w)
        return moe_combine(torch.relu(y), handle, tw)

    x, ids, tw, w = inputs("uniform", rank, torch.float32)
    try:
        got = torch.compile(layer, fullgraph=True)(x, ids, w, tw)
        if problem := close(got, layer(x, ids, w, tw).double(), 1e-6):
            failures["compile"].append(problem)
    except Exception:
        failures["compile"].append(traceback.format_exc(limit=3)[-1500:])
    # a compiled training step: the backward ops trace too, and give eager's gradients
    try:
        grads = []
        for fn in (layer, torch.compile(layer, fullgraph=True)):
            leaves = [x.clone().requires_grad_(), w.clone().requires_grad_(), tw.clone().requires_grad_()]
            (fn(leaves[0], ids, leaves[1], leaves[2]) ** 2).sum().backward()
            grads.append([leaf.grad for leaf in leaves])
        for what, eager, compiled in zip(("dx", "dw", "dtopk_weights"), *grads):
            if problem := close(compiled, eager.double(), 1e-5):
                failures["compile"].append(f"compiled backward {what}: {problem}")
    except Exception:
        failures["compile"].append("backward: " + traceback.format_exc(limit=3)[-1500:])


def run(opcheck: bool) -> None:
    for family in ("dispatch", "combine", "grad", "errors", "opcheck", "compile"):
        failures.setdefault(family, [])
    for dtype in DTYPES:
        for case in CASES:
            try:
                check_case(case, dtype)
            except Exception:
                failures["dispatch"].append(f"{case} {dtype}: {traceback.format_exc(limit=4)[-1500:]}")
    for case in GRAD_CASES:
        for dtype in DTYPES if case != "several-pieces" else [torch.float32]:
            for y_term, train_w, train_tw in ((True, True, True), (False, True, True), (True, False, False)):
                try:
                    grad_case(case, dtype, y_term, train_w, train_tw)
                except Exception:
                    failures["grad"].append(f"{case} {dtype} y_term={y_term} train_w={train_w}: "
                                            f"{traceback.format_exc(limit=4)[-1500:]}")
    # fp32 router weights with half-type rows (the backward's dots then stay in fp32)
    for dtype in (d for d in DTYPES if d != torch.float32):
        try:
            grad_case("uniform", dtype, True, True, True, tw_dtype=torch.float32)
        except Exception:
            failures["grad"].append(f"uniform {dtype} tw float32: {traceback.format_exc(limit=4)[-1500:]}")
    check_errors()
    if opcheck:
        check_opcheck()
    if "--compile" in sys.argv:
        check_compile()


def main() -> None:
    global rank, world
    backend = sys.argv[sys.argv.index("--backend") + 1] if "--backend" in sys.argv else "mk"
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    start = time.monotonic()
    run("--opcheck" in sys.argv)
    dist.barrier()
    sys.stdout.write("REPORT " + json.dumps({"rank": rank, "failures": failures,
                                             "seconds": round(time.monotonic() - start, 2)}) + "\n")
    sys.stdout.flush()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
