"""Runs inside every rank of an mk world on one host (tests/ops/test_caller_runs.py): which thread runs a
collective, read from ``superkernel.backend.collective_runs`` before and after each step. Collectives up to
SUPERKERNEL_INLINE_BYTES run on the caller, larger ones on the backend's worker; a fused op's last
collective, which the op waits for at once, runs on the caller whatever its size (ProcessGroupMK::CallerWaits).

Steps (each result checked against float64; ``wrong`` lists the failures), each reporting its runs as
[on the caller, on the worker]:
  ``large``: one 1 MiB all_reduce; ``small``: one 1 KiB all_reduce; ``after_async``: a 1 MiB all_reduce with
  async_op=True, waited, then a 1 KiB one (the worker is idle once the first is over: the second runs here);
  ``op_one_chunk``: gemm_allreduce with chunks=1 on a 1 MiB product (m not divisible by the world size: no
  ring), ``op_two_chunks``: the same with chunks=2 (the first chunk's allreduce from the op's lane, the last
  from the op's thread); ``mixed``: on rank 0 a 1 MiB all_reduce with async_op=True that rank 1 joins 0.3 s
  late, then gemm_allreduce on every rank (the op's collectives queue behind it where it still runs): both
  results are checked. Prints one REPORT line."""
from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

import superkernel.ops as mk
from superkernel.backend import collective_runs

M, K, N = 257, 64, 1024  # fp32 product 1 MiB (beyond SUPERKERNEL_INLINE_BYTES, 256 KiB); m odd: no ring


def operands(rank: int, call: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * call + rank)
    return torch.randn(M, K, generator=g), torch.randn(K, N, generator=g)


def main() -> None:
    dist.init_process_group("mk")
    rank, world = dist.get_rank(), dist.get_world_size()
    runs: dict[str, list[int]] = {}
    wrong: list[str] = []

    def step(name: str, fn: Callable[[], None]) -> None:
        dist.barrier()
        before = collective_runs()
        fn()
        after = collective_runs()
        runs[name] = [after["caller"] - before["caller"], after["worker"] - before["worker"]]

    def allreduce(elems: int, async_op: bool = False, late: float = 0.0) -> tuple[torch.Tensor, dist.Work | None]:
        t = torch.full((elems,), float(rank + 1))
        if late:
            time.sleep(late)
        work = dist.all_reduce(t, async_op=async_op)
        return t, work

    def check_sum(name: str, t: torch.Tensor) -> None:
        want = float(sum(range(1, world + 1)))
        if not bool((t == want).all()):
            wrong.append(f"{name}: all_reduce gave {t.unique().tolist()[:4]}, want {want}")

    def check_op(name: str, out: torch.Tensor, call: int) -> None:
        ref = torch.zeros(M, N, dtype=torch.float64)
        for r in range(world):
            a, b = operands(r, call)
            ref += a.double() @ b.double()
        err = ((out.double() - ref).abs().max() / ref.abs().max()).item()
        if err > 1e-5:
            wrong.append(f"{name}: gemm_allreduce relative error {err:.2e}")

    step("large", lambda: check_sum("large", allreduce(M * N)[0]))
    step("small", lambda: check_sum("small", allreduce(256)[0]))

    def after_async() -> None:
        t, work = allreduce(M * N, async_op=True)
        work.wait()
        check_sum("after_async (1 MiB)", t)
        check_sum("after_async (1 KiB)", allreduce(256)[0])

    step("after_async", after_async)
    for call, (name, chunks) in enumerate([("op_one_chunk", 1), ("op_two_chunks", 2)]):
        a, b = operands(rank, call)
        step(name, lambda: check_op(name, mk.gemm_allreduce(a, b, chunks=chunks), call))

    def mixed() -> None:
        t, work = allreduce(M * N, async_op=True, late=0.3 if rank == 1 else 0.0)
        a, b = operands(rank, 7)
        out = mk.gemm_allreduce(a, b, chunks=1)
        work.wait()
        check_sum("mixed", t)
        check_op("mixed", out, 7)

    step("mixed", mixed)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.write("REPORT " + json.dumps({"rank": rank, "runs": runs, "wrong": wrong}) + "\n")


if __name__ == "__main__":
    main()
