"""Runs inside every rank of a 2-rank mk world: rank 0 calls gemm_allreduce, rank 1 never does. With
``--mode timeout`` the group's 2 s timeout must end rank 0's wait with an error naming the op; with
``--mode cancel`` an interrupt (superkernel.backend.cancel_waits from another thread, as the notebook worker
does) must end it at once. Prints one REPORT line: the error text and how long the call took."""
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["timeout", "cancel"], required=True)
    args = ap.parse_args()
    timeout = 2 if args.mode == "timeout" else 60
    dist.init_process_group("mk", timeout=datetime.timedelta(seconds=timeout))
    rank = dist.get_rank()
    report: dict = {"rank": rank}
    if rank == 0:
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
