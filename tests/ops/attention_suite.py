"""Runs inside every rank of a world (tests/transport/world.py): mk.ring_attention for many shapes, dtypes
and options, each checked against torch.nn.functional.scaled_dot_product_attention over the whole sequence
in float64 (every rank regenerates the global q, k, v from a shared seed and takes its own positions), plus
the log-sum-exp against a float64 reference, gradients (of out and lse) against float64 autograd of the
reference, mismatched calls that must fail on every rank, and (with
--opcheck) torch.library.opcheck. Prints one REPORT line: per family, the failures (empty when all passed).

Usage: attention_suite.py [--backend mk|gloo] [--opcheck] [--tune-path CALLS]
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
import traceback
import zlib
from collections import defaultdict

import torch
import torch.distributed as dist
import torch.nn.functional as F

import superkernel  # noqa: F401  (registers "mk")
from superkernel.backend import network_peers
from superkernel.ops import attention_grad
from superkernel.ops.attention import ring_attention, zigzag_positions
from rank_tensors import path_rules_changed

TOL = {torch.float32: 1e-5, torch.bfloat16: 1.5e-2, torch.float16: 2e-3}
# Gradients go through the rounded output (D = rowsum(dout * out)), one more rounding than the forward.
GRAD_TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 4e-3}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (batch, query heads, kv heads, local sequence, head_dim); the last one's packed K/V is 128 KiB a rank in
# float32, above the 64 KiB carry rule, so across hosts it is gathered after the agreement instead, and 64 KiB
# in the half types: carried (from 3 ranks on, more than 64 KiB in all)
SHAPES = [(1, 1, 1, 1, 4), (2, 4, 2, 5, 8), (1, 6, 2, 7, 16), (2, 3, 1, 13, 5), (1, 4, 4, 6, 8), (1, 2, 1, 10, 3),
          (1, 4, 4, 32, 128)]

rank = world = 0
device = torch.device("cpu")  # where the op runs (nccl_suite.py sets cuda); references stay on the CPU
failures: dict[str, list[str]] = defaultdict(list)


def generator(key: str) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(key.encode()))


def positions(r: int, s: int, zigzag: bool) -> torch.Tensor:
    return zigzag_positions(r, world, s) if zigzag else torch.arange(r * s, (r + 1) * s)


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
              scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Over the whole sequence, in float64: SDPA (GQA by repeating kv heads) and the log-sum-exp."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
    sc = scale if scale is not None else 1 / math.sqrt(q.shape[-1])
    scores = q @ k.transpose(-1, -2) * sc
    if causal:
        n = q.shape[2]
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return out, torch.logsumexp(scores, dim=-1)


def close(got: torch.Tensor, want: torch.Tensor, tol: float) -> str:
    if got.shape != want.shape:
        return f"shape {tuple(got.shape)} != {tuple(want.shape)}"
    if got.numel() == 0:
        return ""
    err = (got.double() - want).abs().max().item()
    bound = tol * (1 + want.abs().max().item())
    return "" if err <= bound else f"max abs error {err:.3g} > {bound:.3g}"


def check_case(shape: tuple, dtype: torch.dtype, causal: bool, zigzag: bool, scale: float | None) -> None:
    b, hq, hkv, s, d = shape
    name = f"{shape} {dtype} causal={causal} zigzag={zigzag} scale={scale}"
    gen = generator(f"attn/{shape}/{dtype}")
    n = world * s
    q, k, v = (torch.randn(b, h, n, d, generator=gen, dtype=torch.float64).to(dtype) for h in (hq, hkv, hkv))
    pos = positions(rank, s, zigzag)
    out, lse = ring_attention(*(t[:, :, pos].contiguous().to(device) for t in (q, k, v)),
                              causal=causal, scale=scale, zigzag=zigzag)
    out, lse = out.cpu(), lse.cpu()
    want_out, want_lse = reference(q.double(), k.double(), v.double(), causal, scale)
    if out.dtype != dtype or lse.dtype != torch.float32:
        failures["attention"].append(f"{name}: dtypes {out.dtype}, {lse.dtype}")
    for what, got, want in (("out", out, want_out[:, :, pos]), ("lse", lse, want_lse[:, :, pos])):
        if problem := close(got, want, TOL[dtype]):
            failures["attention"].append(f"{name}: {what}: {problem}")


def grad_case(shape: tuple, dtype: torch.dtype, causal: bool, zigzag: bool, scale: float | None,
              use_lse: bool, kv_grad: bool) -> None:
    """Gradients of the sum over ranks of L_p = sum(out_p * W_p) (+ sum(lse_p * U_p)) against float64
    autograd through the reference over the whole sequence."""
    b, hq, hkv, s, d = shape
    name = f"{shape} {dtype} causal={causal} zigzag={zigzag} scale={scale} lse={use_lse} kv_grad={kv_grad}"
    gen = generator(f"attn-grad/{shape}/{dtype}")
    n = world * s
    q, k, v, w = (torch.randn(b, h, n, d, generator=gen, dtype=torch.float64).to(dtype) for h in (hq, hkv, hkv, hq))
    u = torch.randn(b, hq, n, generator=gen, dtype=torch.float64)
    Q, K, V = (t.double().requires_grad_() for t in (q, k, v))
    want_out, want_lse = reference(Q, K, V, causal, scale)
    ((want_out * w.double()).sum() + ((want_lse * u).sum() if use_lse else 0)).backward()
    pos = positions(rank, s, zigzag)
    mine = [t[:, :, pos].contiguous().to(device) for t in (q, k, v)]
    lq, lk, lv = mine[0].requires_grad_(), mine[1].requires_grad_(kv_grad), mine[2].requires_grad_(kv_grad)
    out, lse = ring_attention(lq, lk, lv, causal=causal, scale=scale, zigzag=zigzag)
    loss = (out * w[:, :, pos].to(device)).sum()
    if use_lse:
        loss = loss + (lse * u[:, :, pos].float().to(device)).sum()
    loss.backward()
    for what, leaf, ref in (("dq", lq, Q.grad), ("dk", lk, K.grad), ("dv", lv, V.grad)):
        if not leaf.requires_grad:
            if leaf.grad is not None:
                failures["grad"].append(f"{name}: {what} set on a tensor that does not require grad")
            continue
        if leaf.grad is None or leaf.grad.dtype != dtype:
            failures["grad"].append(f"{name}: {what} {'missing' if leaf.grad is None else leaf.grad.dtype}")
        elif problem := close(leaf.grad.cpu(), ref[:, :, pos], GRAD_TOL[dtype]):
            failures["grad"].append(f"{name}: {what}: {problem}")


def expect_error(family: str, name: str, fn, needle: str) -> None:
    try:
        fn()
    except RuntimeError as e:
        if needle not in str(e):
            failures[family].append(f"{name}: error without {needle!r}: {e}")
        return
    failures[family].append(f"{name}: no error")


def check_errors() -> None:
    x = torch.randn(1, 2, 4, 8)
    # one rank passes a different local sequence length: every rank must raise
    s = 5 if rank == world - 1 else 4
    q = torch.randn(1, 2, s, 8)
    if world > 1:
        expect_error("errors", "sequence length differs", lambda: ring_attention(q, q, q), "local sequence")
    bad_heads = torch.randn(1, 3, 4, 8) if rank == 0 else x
    expect_error("errors", "query heads not a multiple", lambda: ring_attention(bad_heads, x[:, :2], x[:, :2]),
                 "rank 0")
    if world > 1:
        expect_error("errors", "causal differs", lambda: ring_attention(x, x, x, causal=rank == 0), "causal")
    if world > 1 and os.environ.get("SUPERKERNEL_TRANSPORT") == "tcp":
        check_rule_errors()
    # the group stays usable after errors
    check_case((1, 2, 1, 3, 4), torch.float32, True, False, None)


def check_rule_errors() -> None:
    """Across hosts (tcp): SUPERKERNEL_OPS_ATTENTION_RING_MIN_SEQ invalid on rank 0, or different between
    ranks, is an error on every rank (the ring and the gather are different exchanges); a carry limit that
    differs is not (every rank takes its usual path and the results stay right)."""
    var, carry = "SUPERKERNEL_OPS_ATTENTION_RING_MIN_SEQ", "SUPERKERNEL_OPS_CARRY_BYTES"
    x = torch.randn(1, 2, 4, 8)
    with path_rules_changed(var, carry):
        if rank == 0:
            os.environ[var] = "zero"
        expect_error("errors", "invalid ring threshold", lambda: ring_attention(x, x, x),
                     f"{var} must be a positive integer, got 'zero'" if rank == 0 else "rank 0 rejected its arguments")
        os.environ[var] = "1" if rank == 0 else "100000"
        expect_error("errors", "ring threshold differs", lambda: ring_attention(x, x, x), f"{var} differs")
        os.environ.pop(var)
        os.environ[carry] = "0" if rank == 0 else "65536"
        for causal in (False, True):
            check_case((1, 2, 1, 3, 4), torch.float32, causal, False, None)


def check_opcheck() -> None:
    q = torch.randn(1, 4, 6, 8)
    k = torch.randn(1, 2, 6, 8)
    name = dist.distributed_c10d._get_default_group().group_name
    for causal, zigzag, grad in ((False, False, False), (True, True, False), (False, False, True),
                                 (True, True, True)):
        # with inputs that require grad, opcheck also checks the autograd registration
        args = (q.requires_grad_(grad), k.requires_grad_(grad), k.detach().requires_grad_(grad))
        try:
            torch.library.opcheck(torch.ops.mk.ring_attention.default, (*args, name, causal, None, zigzag))
        except Exception:
            failures["opcheck"].append(f"causal={causal} zigzag={zigzag} grad={grad}: "
                                       f"{traceback.format_exc(limit=3)}")


def run(opcheck: bool) -> None:
    families = {"attention": [], "grad": [], "errors": [], "opcheck": []}
    for dtype in DTYPES:
        for shape in SHAPES:
            for causal in (False, True):
                for zigzag in ((False, True) if shape[3] % 2 == 0 else (False,)):
                    scale = 0.3 if shape[4] == 5 else None
                    try:
                        check_case(shape, dtype, causal, zigzag, scale)
                    except Exception:
                        failures["attention"].append(f"{shape} {dtype} causal={causal} zigzag={zigzag}: "
                                                     f"{traceback.format_exc(limit=4)}")
    for shape, dtype in ((SHAPES[1], torch.float32), (SHAPES[2], torch.float32), (SHAPES[3], torch.bfloat16),
                         (SHAPES[4], torch.float16), (SHAPES[0], torch.float32)):
        for causal, zigzag in ((False, False), (True, False), (True, True)):
            if zigzag and shape[3] % 2:
                continue
            for use_lse, kv_grad in ((True, True), (False, True), (True, False)):
                scale = 0.3 if shape[4] == 5 else None
                try:
                    grad_case(shape, dtype, causal, zigzag, scale, use_lse, kv_grad)
                except Exception:
                    failures["grad"].append(f"{shape} {dtype} causal={causal} zigzag={zigzag} lse={use_lse}: "
                                            f"{traceback.format_exc(limit=4)}")
    # The tiled products (taken when the loss uses lse, as here) with several tiles of query rows per key
    # block (the default tile holds every row of these small shapes): the smallest tile, 8 rows, cuts
    # across query heads and leaves a short last tile.
    saved, attention_grad._TILE_ELEMENTS = attention_grad._TILE_ELEMENTS, 1
    before = len(failures["grad"])
    try:
        for shape, dtype in ((SHAPES[3], torch.float32), (SHAPES[2], torch.float32), (SHAPES[2], torch.bfloat16)):
            for causal in (False, True):
                try:
                    grad_case(shape, dtype, causal, False, None, True, True)
                except Exception:
                    failures["grad"].append(f"{shape} {dtype} causal={causal}: {traceback.format_exc(limit=4)}")
    finally:
        attention_grad._TILE_ELEMENTS = saved
    failures["grad"][before:] = [f"[8-row tiles] {f}" for f in failures["grad"][before:]]
    # Which backward the group takes: the overlapped one where a peer is reached over the network (mk's tcp,
    # any other backend), the one-call one where every peer shares memory.
    transport = os.environ.get("SUPERKERNEL_TRANSPORT", "auto")
    if dist.get_backend() != "mk" or transport != "auto":
        want = dist.get_backend() != "mk" or (world > 1 and transport == "tcp")
        if network_peers(None) != want:
            failures["grad"].append(f"network_peers() is {not want} on {dist.get_backend()} over {transport}")
    # The own key block split in two halves around the collectives (taken where a peer is reached over the
    # network, i.e. over tcp and Gloo here, from 512 keys a half): from one key a half, through ATen's kernel
    # (no lse gradient) and the tiled products (with one).
    saved, attention_grad._SPLIT_MIN_KEYS = attention_grad._SPLIT_MIN_KEYS, 1
    before = len(failures["grad"])
    try:
        for shape, dtype in ((SHAPES[1], torch.float32), (SHAPES[3], torch.bfloat16), (SHAPES[4], torch.float16)):
            for causal, zigzag in ((False, False), (True, False), (True, True)):
                if zigzag and shape[3] % 2:
                    continue
                for use_lse in (False, True):
                    try:
                        grad_case(shape, dtype, causal, zigzag, None, use_lse, True)
                    except Exception:
                        failures["grad"].append(f"{shape} {dtype} causal={causal} zigzag={zigzag} lse={use_lse}: "
                                                f"{traceback.format_exc(limit=4)}")
    finally:
        attention_grad._SPLIT_MIN_KEYS = saved
    failures["grad"][before:] = [f"[own block split] {f}" for f in failures["grad"][before:]]
    check_errors()
    if opcheck:
        check_opcheck()
    for f in families:
        failures.setdefault(f, [])


def run_tune_path(calls: int) -> None:
    """One unmasked shape at the default ring threshold (256 positions per rank), called `calls` times: across
    hosts the chunk tuner tries the ring and the gather on these calls; every call is checked."""
    for i in range(calls):
        try:
            check_case((1, 2, 1, 256, 8), torch.float32, False, False, None)
        except Exception:
            failures["attention"].append(f"call {i}: {traceback.format_exc(limit=4)}")
    for f in ("attention", "grad", "errors", "opcheck"):
        failures.setdefault(f, [])


def main() -> None:
    global rank, world
    backend = sys.argv[sys.argv.index("--backend") + 1] if "--backend" in sys.argv else "mk"
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    start = time.monotonic()
    if "--tune-path" in sys.argv:
        run_tune_path(int(sys.argv[sys.argv.index("--tune-path") + 1]))
    else:
        run("--opcheck" in sys.argv)
    dist.barrier()
    sys.stdout.write("REPORT " + json.dumps({"rank": rank, "failures": failures,
                                             "seconds": round(time.monotonic() - start, 2)}) + "\n")
    sys.stdout.flush()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
