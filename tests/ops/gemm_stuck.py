"""Runs inside every rank of a 2-rank mk world: rank 0 calls gemm_allreduce, rank 1 never does. With
``--mode timeout`` the group's 2 s timeout must end rank 0's wait with an error naming the op; with
``--mode cancel`` an interrupt (superkernel.backend.cancel_waits from another thread, as the notebook worker
does) must end it at once. With ``--mode oom`` both ranks call it (``--dtype``: a half type this processor
multiplies on operands widened to float32, in place on one host), and rank 1's address space is capped so
that its own work fails in the middle of the op (converting a chunk of a to float32 for the GEMM): rank 1
must report the allocation failure and rank 0, inside the collective by then, must get an error at once
instead of waiting out the group timeout. Prints one REPORT line per rank: the
error text and how long the call took."""
from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import sys
import threading
import time

import torch
import torch.distributed as dist

import superkernel.ops as mk
from superkernel.backend import cancel_waits


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["timeout", "cancel", "oom"], required=True)
    ap.add_argument("--dtype", choices=["float16", "bfloat16"], default="float16")
    args = ap.parse_args()
    timeout = 2 if args.mode == "timeout" else 60
    dist.init_process_group("mk", timeout=datetime.timedelta(seconds=timeout))
    rank = dist.get_rank()
    report: dict = {"rank": rank}
    if args.mode == "oom":
        # rows of 8 products fit a staging slot; chunks=2 takes the in-place path. Each chunk's GEMM
        # converts its 32 x 2^20 rows of a to float32 (128 MiB) inside the collective.
        k = 1 << 20
        dtype = getattr(torch, args.dtype)
        a, b = torch.ones(64, k, dtype=dtype), torch.ones(k, 8, dtype=dtype)
        dist.barrier()
        if rank == 1:  # room for b in float32 (32 MiB) before the collective, not for a chunk of a
            with open("/proc/self/status") as f:
                vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
            resource.setrlimit(resource.RLIMIT_AS, (vm + (96 << 20), resource.RLIM_INFINITY))
        t0 = time.monotonic()
        try:
            mk.gemm_allreduce(a, b, chunks=2)
            report["error"] = None
        except RuntimeError as e:
            report["error"] = str(e)
        report["seconds"] = time.monotonic() - t0
    elif rank == 0:
        if args.mode == "cancel":
            threading.Timer(1.0, cancel_waits).start()
        t0 = time.monotonic()
        try:
            mk.gemm_allreduce(torch.ones(64, 32), torch.ones(32, 16), chunks=2)
            report["error"] = None
        except RuntimeError as e:
            report["error"] = str(e)
        report["seconds"] = time.monotonic() - t0
    else:
        time.sleep(timeout + 3 if args.mode == "timeout" else 4)
    sys.stdout.write("REPORT " + json.dumps(report) + "\n")
    sys.stdout.flush()
    os._exit(0)  # the communicator is aborted by design: skip the orderly shutdown


if __name__ == "__main__":
    main()
