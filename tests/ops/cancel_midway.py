"""Runs inside every rank of a 2-rank Gloo world: both ranks call ring_attention over and over; its blocks
travel as Gloo send/recv (works that never report completion, so the op waits inside Gloo), and so does its
argument agreement when the test sets SUPERKERNEL_OPS_BOARD=0. Rank 0 stops rank 1 (SIGSTOP) at some moment; rank 0, then waiting for
rank 1 (most often for its next argument descriptor, sometimes for a block in a Gloo send/recv), is
interrupted (cancel_waits from another thread, as the notebook worker does) and must get an error at once
instead of waiting out the 60 s group timeout. Rank 0 prints a REPORT line (the error text and how long the call took after the interrupt), then
kills rank 1, which would wait out the timeout in its own send."""
from __future__ import annotations

import datetime
import json
import os
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist

import superkernel.ops as mk
from superkernel.backend import cancel_waits


def main() -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    pids: list[int] = [0, 0]
    dist.all_gather_object(pids, os.getpid())
    q = torch.randn(1, 4, 4096, 64)
    mk.ring_attention(q, q, q)
    mk.ring_attention(q, q, q)
    dist.barrier()
    report: dict = {"rank": rank}  # (only rank 0 gets to print it)
    cancelled_at: list[float] = []
    if rank == 0:
        threading.Timer(0.5, os.kill, (pids[1], signal.SIGSTOP)).start()

        def interrupt() -> None:
            cancelled_at.append(time.monotonic())
            cancel_waits()

        threading.Timer(1.5, interrupt).start()
    t0 = time.monotonic()
    try:
        for _ in range(200):  # until the interrupt (rank 1 is stopped after 0.5 s)
            mk.ring_attention(q, q, q)
        report["error"] = None
    except RuntimeError as e:
        report["error"] = str(e)
    end = time.monotonic()
    report["seconds"] = end - (cancelled_at[0] if cancelled_at else t0)
    sys.stdout.write("REPORT " + json.dumps(report) + "\n")
    sys.stdout.flush()
    os.kill(pids[1], signal.SIGKILL)
    os._exit(0)  # the group was interrupted mid-op: skip the orderly shutdown


if __name__ == "__main__":
    main()
