"""Runs inside every rank of a world: the fused ops on CUDA tensors over the nccl backend (one GPU per rank),
each checked against the float64 CPU reference of the CPU suites: allgather_gemm, gemm_allreduce and
gemm_reducescatter (rank_tensors.py), mk.moe_dispatch_gemm + mk.moe_combine (moe_suite.py: uneven routings,
ranks receiving no tokens) and mk.ring_attention (attention_suite.py), and some backward cases of the
last two. Prints one REPORT line: per family, the failures (empty when all passed). Started by
test_nccl_ops.py only when the host has >= 2 GPUs.

Usage: nccl_suite.py
"""
from __future__ import annotations

import json
import sys
import time
import traceback

import torch
import torch.distributed as dist

import attention_suite  # siblings in tests/ops (the script's directory is on sys.path)
import moe_suite
import superkernel.ops as mk
from rank_tensors import mismatch, rank_tensor

failures: dict[str, list[str]] = {"gemm": [], "moe": [], "attention": []}


def gemm_cases(rank: int, world: int, device: torch.device) -> None:
    for m, k, n in ((8, 16, 12), (33, 64, 40)):
        for dtype in (torch.float32, torch.bfloat16):
            for chunks in (1, 3):
                name = f"{m}x{k}x{n} {dtype} chunks={chunks}"
                a = [rank_tensor(f"nccl/{m}/{k}/{n}/a", r, (m * world, k), dtype) for r in range(world)]
                b = [rank_tensor(f"nccl/{m}/{k}/{n}/b", r, (k, n), dtype) for r in range(world)]
                try:
                    c = mk.allgather_gemm(a[rank][:m].to(device), b[0].to(device), chunks=chunks).cpu()
                    ref = torch.cat([x[:m].double() for x in a]) @ b[0].double()
                    ar = mk.gemm_allreduce(a[rank].to(device), b[rank].to(device), chunks=chunks).cpu()
                    full = sum(x.double() @ y.double() for x, y in zip(a, b))
                    rs = mk.gemm_reducescatter(a[rank].to(device), b[rank].to(device), chunks=chunks).cpu()
                    for what, got, want in (("allgather_gemm", c, ref), ("gemm_allreduce", ar, full),
                                            ("gemm_reducescatter", rs, full[rank * m:(rank + 1) * m])):
                        if problem := mismatch(got, want, dtype):
                            failures["gemm"].append(f"{what} {name}: {problem}")
                except Exception:
                    failures["gemm"].append(f"{name}: {traceback.format_exc(limit=4)[-1500:]}")


def main() -> None:
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    for suite in (moe_suite, attention_suite):
        suite.rank, suite.world, suite.device = rank, world, device
    start = time.monotonic()
    gemm_cases(rank, world, device)
    for dtype in (torch.float32, torch.bfloat16):
        for case in moe_suite.CASES:
            try:
                moe_suite.check_case(case, dtype)
            except Exception:
                failures["moe"].append(f"{case} {dtype}: {traceback.format_exc(limit=4)[-1500:]}")
        for shape in attention_suite.SHAPES:
            for causal, zigzag in ((False, False), (True, False), (True, True)):
                if zigzag and shape[3] % 2:
                    continue
                try:
                    attention_suite.check_case(shape, dtype, causal, zigzag, None)
                except Exception:
                    failures["attention"].append(f"{shape} {dtype}: {traceback.format_exc(limit=4)[-1500:]}")
        for case in ("uniform", "empty-and-single-token", "all-to-rank-0"):   # backward (moe_grad.py)
            try:
                moe_suite.grad_case(case, dtype, True, True, True)
            except Exception:
                failures["moe"].append(f"grad {case} {dtype}: {traceback.format_exc(limit=4)[-1500:]}")
        for causal, zigzag in ((False, False), (True, True)):                   # backward (attention_grad.py)
            try:
                attention_suite.grad_case(attention_suite.SHAPES[1], dtype, causal, zigzag, None, True, True)
            except Exception:
                failures["attention"].append(f"grad {dtype}: {traceback.format_exc(limit=4)[-1500:]}")
    failures["moe"] += sum((moe_suite.failures.get(f, []) for f in ("dispatch", "combine", "grad")), [])
    failures["attention"] += attention_suite.failures.get("attention", []) + attention_suite.failures.get("grad", [])
    torch.cuda.synchronize()
    dist.barrier()
    sys.stdout.write("REPORT " + json.dumps({"rank": rank, "failures": failures,
                                             "seconds": round(time.monotonic() - start, 2)}) + "\n")
    sys.stdout.flush()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
