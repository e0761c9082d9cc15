"""Runs inside every rank of a 2-rank mk world (tests/transport/test_worker_release.py): collectives handed to
ProcessGroupMK's worker thread whose tensors only the worker still holds (the Python tensor and its Work are
dropped at once), while this thread keeps calling into the backend with the GIL held
(superkernel.backend.collective_runs takes the group's lock). The worker releases each task's tensors when
it is done with it, and releasing a tensor Python made may need the GIL: it must not do that while it holds
the lock this thread is waiting for. Prints one REPORT line: the final sum and how many ran on the worker."""
from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

import superkernel  # noqa: F401  (registers the mk backend)
from superkernel.backend import collective_runs

ELEMS = 1 << 18  # 1 MiB of fp32: beyond SUPERKERNEL_INLINE_BYTES (256 KiB), so each runs on the worker
CALLS = 300


def main() -> None:
    dist.init_process_group("mk")
    rank, world = dist.get_rank(), dist.get_world_size()
    before = collective_runs()
    polls = 0
    for i in range(CALLS):
        # neither the tensor nor the Work is kept: the worker's task is the last owner of both
        dist.all_reduce(torch.full((ELEMS,), float(rank + i)), async_op=True)
        for _ in range(20):
            collective_runs()
            polls += 1
    last = torch.full((4,), float(rank + 1))
    dist.all_reduce(last)  # after every queued one (collectives run in issue order)
    after = collective_runs()
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.write("REPORT " + json.dumps({
        "rank": rank, "world": world, "sum": last.tolist(), "polls": polls,
        "worker_runs": after["worker"] - before["worker"]}) + "\n")


if __name__ == "__main__":
    main()
