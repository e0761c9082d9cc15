"""Runs inside every rank of a world on one host (Gloo, or mk with ``--backend mk``): the fused ops' argument
agreement on the shared-memory board (csrc/kernels/agreement_board.h) once the first agreements have set it
up. Between two namespace hosts (tests/ops/test_side_channel.py), Gloo's agreement on its side channel
(csrc/kernels/side_channel.h) instead.

``--mode agree``: six gemm_allreduce calls checked against float64; then shapes that differ between ranks,
then ranks at different ops (rank 0 calls allgather_gemm, the others gemm_allreduce), each of which must
raise on every rank; then a correct call again (the group stays usable). ``--mode timeout`` / ``cancel`` /
``exit``: after the board is in use, rank 0 calls the op while rank 1 does not: the group's 2 s timeout, an
interrupt (cancel_waits from another thread) or rank 1's exit must end rank 0's wait with an error naming
the op. ``--mode groups``: 30 times a new group, enough fused calls on it to use the board, and its
destruction; the open file descriptors and the threads are counted after each round (a destroyed group's
board must not keep its memfd and pidfds; its backend's threads, Gloo's run loops or mk's progress threads,
must end with destroy_process_group, and its communication lane with the next group's first op). The test
reads the op trace (SUPERKERNEL_OPS_TRACE=1) for which calls used the board. Prints one REPORT line per
rank."""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import threading
import time

import torch
import torch.distributed as dist

import superkernel.ops as mk
from superkernel.backend import cancel_waits

WARM_CALLS = 6


def product_sum(world: int, m: int, k: int, n: int) -> torch.Tensor:
    """The float64 reference of gemm_allreduce when rank r passes a = full(r + 1), b = full(1)."""
    return torch.full((m, n), float(k * sum(r + 1 for r in range(world))), dtype=torch.float64)


def call(rank: int, m: int = 8, k: int = 4, n: int = 5) -> torch.Tensor:
    return mk.gemm_allreduce(torch.full((m, k), float(rank + 1)), torch.ones(k, n))


def thread_names() -> list[str]:
    """Names of this process's threads (/proc/self/task/*/comm)."""
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except FileNotFoundError:  # ended meanwhile
            pass
    return names


def error_of(fn) -> str | None:
    try:
        fn()
    except RuntimeError as e:
        return str(e)
    return None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["agree", "timeout", "cancel", "exit", "groups"], default="agree")
    ap.add_argument("--backend", choices=["gloo", "mk"], default="gloo")
    args = ap.parse_args()
    timeout = 2 if args.mode == "timeout" else 60
    if args.backend == "mk":
        import superkernel  # noqa: F401  (registers the mk backend)
    dist.init_process_group(args.backend, timeout=datetime.timedelta(seconds=timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    report: dict = {"rank": rank, "wrong": []}
    for i in range(WARM_CALLS):
        got = call(rank)
        if not torch.equal(got.double(), product_sum(world, 8, 4, 5)):
            report["wrong"].append(i)
    if args.mode == "groups":
        import gc

        fds, threads, names = [], [], []
        report["threads_before"] = len(thread_names())
        for _ in range(30):
            pg = dist.new_group(backend=args.backend)
            for _ in range(WARM_CALLS):
                mk.gemm_allreduce(torch.full((8, 4), float(rank + 1)), torch.ones(4, 5), pg)
            # chunked and not in place: on mk, all but the last chunk's allreduce go through the group's lane
            os.environ["SUPERKERNEL_OPS_IN_PLACE"] = "0"
            got = mk.gemm_allreduce(torch.full((64, 4), float(rank + 1)), torch.ones(4, 5), pg, chunks=4)
            del os.environ["SUPERKERNEL_OPS_IN_PLACE"]
            if not torch.equal(got.double(), product_sum(world, 64, 4, 5)):
                report["wrong"].append("chunked")
            dist.destroy_process_group(pg)
            del pg
            gc.collect()
            fds.append(len(os.listdir("/proc/self/fd")))
            names = thread_names()
            threads.append(len(names))
        report["fds"] = fds
        report["threads"] = threads
        report["thread_names"] = sorted(names)
        dist.barrier()
    elif args.mode == "agree":
        report["shape_error"] = error_of(lambda: call(rank, m=8 + rank))
        if rank == 0:
            report["order_error"] = error_of(lambda: mk.allgather_gemm(torch.ones(8, 4), torch.ones(4, 5)))
        else:
            report["order_error"] = error_of(lambda: call(rank))
        got = call(rank, m=3, k=1, n=7)
        report["after_ok"] = bool(torch.equal(got.double(), product_sum(world, 3, 1, 7)))
        dist.barrier()
    elif rank == 0:
        dist.barrier()
        if args.mode == "cancel":
            threading.Timer(1.0, cancel_waits).start()
        t0 = time.monotonic()
        report["error"] = error_of(lambda: call(rank))
        report["seconds"] = time.monotonic() - t0
    else:
        dist.barrier()
        if args.mode == "exit":
            time.sleep(0.5)
            sys.stdout.write("REPORT " + json.dumps(report) + "\n")
            sys.stdout.flush()
            os._exit(0)
        time.sleep(timeout + 3 if args.mode == "timeout" else 4)
    sys.stdout.write("REPORT " + json.dumps(report) + "\n")
    sys.stdout.flush()
    os._exit(0)  # a peer may be gone or stuck by design: skip the orderly shutdown


if __name__ == "__main__":
    main()
