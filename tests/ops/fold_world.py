"""Runs inside every rank of a Gloo or mk world across two namespace hosts (tests/ops/test_fold.py): the folded
agreement (Pipeline::fold_note in csrc/kernels/pipeline.h) of gemm_allreduce, and on mk of gemm_reducescatter
and allgather_gemm.
Products large enough to travel by one collective (not inside the agreement), one chunk, so that consecutive
alike calls arm the group and later ones ride their collective without agreeing. On mk the test sets
SUPERKERNEL_OPS_RING_MIN_ROWS above m, so the calls take the op's one collective rather than its ring.

``--mode fold``: phases, each result checked against float64 (``wrong`` lists the failures):
  ``fp32``: 10 alike float32 calls; ``bf16``: 8 alike bfloat16 calls (two ranks: the half-type allreduce);
  ``shape``: rank 1 passes another m (must raise on every rank); ``rearm``: 8 alike calls; ``both``: every
  rank passes another n (must work); ``rearm2``: 8 alike calls; ``order``: rank 0 calls allgather_gemm,
  rank 1 gemm_allreduce (must raise on every rank); ``rearm3``: 8 alike calls; ``args``: rank 1 passes b of
  another dtype (must raise on every rank); ``after``: one more alike call; ``flip``: 8 calls alternating
  between two shapes (must never arm). A disarming makes the run of alike calls that arms 4, so each phase of
  8 alike calls after one ends with 4 calls that ride. ``--backend mk`` adds gemm_reducescatter's phases:
  ``rs``: 8 alike calls; ``rs_shape``: rank 1 passes another m (must raise on every rank: the armed
  reduce-scatter carries its veto); ``rs_after``: 12 alike calls (the last 8 ride); then allgather_gemm's
  ``ag``, ``ag_shape`` and ``ag_after`` alike (its shards gathered with their words). Last, ``vary``: 8
  gemm_allreduce calls alike but for the chunk count that ranks other than 0 ask for (1 or 2 in turn; rank 0's
  proposal decides the path, so the group still arms).
``--mode timeout`` / ``exit``: 8 alike calls, then rank 0 calls again while rank 1 does not: the group's 2 s
timeout, or rank 1's exit, must end rank 0's wait with an error naming the op.
The test reads the op trace (SUPERKERNEL_OPS_TRACE=1) for which calls rode. Prints one REPORT line per rank."""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import torch
import torch.distributed as dist

import superkernel.ops as mk
from board_world import error_of  # (same directory: the script's own, first on sys.path)

M, K, N = 256, 16, 1024  # fp32 product 1 MiB, bf16 512 KiB per half: beyond what rides inside an agreement
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def operands(rank: int, m: int, k: int, n: int, dtype: torch.dtype, call: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * call + rank)
    return torch.randn(m, k, generator=g).to(dtype), torch.randn(k, n, generator=g).to(dtype)


def reference(world: int, m: int, k: int, n: int, dtype: torch.dtype, call: int) -> torch.Tensor:
    out = torch.zeros(m, n, dtype=torch.float64)
    for r in range(world):
        a, b = operands(r, m, k, n, dtype, call)
        out += a.double() @ b.double()
    return out


class World:
    def __init__(self) -> None:
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.calls = 0
        self.wrong: list[str] = []

    def run(self, phase: str, times: int, m: int = M, k: int = K, n: int = N,
            dtype: torch.dtype = torch.float32, op: str = "gemm_allreduce", vary: bool = False) -> None:
        """``times`` alike calls of ``op`` (gemm_allreduce, gemm_reducescatter or allgather_gemm; new operands
        each), each checked. ``vary``: ranks other than 0 ask for 1 or 2 chunks in turn (rank 0's 1 decides)."""
        for _ in range(times):
            self.calls += 1
            a, b = operands(self.rank, m, k, n, dtype, self.calls)
            want = reference(self.world, m, k, n, dtype, self.calls)
            if op == "gemm_allreduce":
                chunks = 1 + self.calls % 2 if vary and self.rank != 0 else 1
                got = mk.gemm_allreduce(a, b, chunks=chunks)
            elif op == "allgather_gemm":
                got = mk.allgather_gemm(a, b, chunks=1)
                shards = [operands(q, m, k, n, dtype, self.calls)[0].double() for q in range(self.world)]
                want = torch.cat(shards) @ b.double()
            else:
                got = mk.gemm_reducescatter(a, b, chunks=1)
                rows = m // self.world
                want = want[self.rank * rows:(self.rank + 1) * rows]
            scale = want.abs().max().item()
            if got.dtype != dtype or tuple(got.shape) != tuple(want.shape) or \
                    (got.double() - want).abs().max().item() > TOL[dtype] * max(scale, 1.0):
                self.wrong.append(f"{phase} call {self.calls}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["fold", "timeout", "exit"], default="fold")
    ap.add_argument("--backend", choices=["gloo", "mk"], default="gloo")
    args = ap.parse_args()
    timeout = 2 if args.mode == "timeout" else 60
    dist.init_process_group(args.backend, timeout=datetime.timedelta(seconds=timeout))
    w = World()
    rank = w.rank
    report: dict = {"rank": rank}
    w.run("fp32", 10)
    if args.mode == "fold":
        w.run("bf16", 8, m=2 * M, dtype=torch.bfloat16)  # (1 MiB of bf16 products: Gloo's half-type allreduce)
        report["shape_error"] = error_of(lambda: w.run("shape", 1, m=M + 8 * rank))
        w.run("rearm", 8)
        w.run("both", 1, n=N // 2)
        w.run("rearm2", 8)
        if rank == 0:
            w.calls += 1  # (rank 1's run counts this call: the operands stay in step)
            report["order_error"] = error_of(lambda: mk.allgather_gemm(torch.ones(M, K), torch.ones(K, N)))
        else:
            report["order_error"] = error_of(lambda: w.run("order", 1))
        w.run("rearm3", 8)
        a, b = operands(rank, M, K, N, torch.float32, 0)
        report["args_error"] = error_of(lambda: mk.gemm_allreduce(a, b.double() if rank == 1 else b, chunks=1))
        w.run("after", 1)
        for i in range(8):
            w.run("flip", 1, m=M if i % 2 else 2 * M)
        if args.backend == "mk":
            w.run("rs", 8, op="gemm_reducescatter")
            report["rs_shape_error"] = error_of(
                lambda: w.run("rs_shape", 1, m=M + 8 * w.world * rank, op="gemm_reducescatter"))
            w.run("rs_after", 12, op="gemm_reducescatter")
            w.run("ag", 8, op="allgather_gemm")
            report["ag_shape_error"] = error_of(lambda: w.run("ag_shape", 1, m=M + 8 * rank, op="allgather_gemm"))
            w.run("ag_after", 12, op="allgather_gemm")
        w.run("vary", 8, vary=True)
        dist.barrier()
    elif rank == 0:
        dist.barrier()
        t0 = time.monotonic()
        report["error"] = error_of(lambda: w.run("alone", 1))
        report["seconds"] = time.monotonic() - t0
    else:
        dist.barrier()
        if args.mode == "exit":
            time.sleep(0.5)
            report["wrong"] = w.wrong
            sys.stdout.write("REPORT " + json.dumps(report) + "\n")
            sys.stdout.flush()
            os._exit(0)
        time.sleep(timeout + 3)
    report["wrong"] = w.wrong
    sys.stdout.write("REPORT " + json.dumps(report) + "\n")
    sys.stdout.flush()
    os._exit(0)  # a peer may be gone or stuck by design: skip the orderly shutdown


if __name__ == "__main__":
    main()
