"""Runs inside every rank of a Gloo world: fused ops whose collectives go to Gloo's worker threads, then the
interpreter exits at once (no destroy_process_group), as a short script does. Gloo's worker drops its
references to a collective's tensors after the op has returned; if those referenced the op's output (now
owned by a Python object), that release needs the GIL, which no thread gets during interpreter shutdown:
std::terminate. Prints one REPORT line (checksums, so the ops ran) before exiting."""
from __future__ import annotations

import json

import torch
import torch.distributed as dist

import superkernel.ops as mk


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    a = torch.randn(64, 48, generator=torch.Generator().manual_seed(rank))
    b = torch.randn(48, 32, generator=torch.Generator().manual_seed(1234))  # the same on every rank
    sums = []
    for chunks in (1, 2, 3):  # several chunks: each collective works on a view of the output
        sums.append(float(mk.gemm_allreduce(a, b, chunks=chunks).sum()))
        sums.append(float(mk.gemm_reducescatter(a, b, chunks=chunks).sum()))
        sums.append(float(mk.allgather_gemm(a, b, chunks=chunks).sum()))
    y = mk.gemm_allreduce(a, b, chunks=2)  # the last op's output stays alive until the interpreter exits
    print("REPORT " + json.dumps({"rank": rank, "world": world, "sums": sums, "last": float(y.sum())}), flush=True)


if __name__ == "__main__":
    main()
