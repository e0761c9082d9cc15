"""Runs inside every rank of a world: the default group is made, used, destroyed and made again under the same
store, three times, on ``--backend`` (mk, or gloo with the fused ops' mk side channel), as a notebook user does
to get a group back after an interrupt aborted its communicator. Each time an all_reduce and a fused op must
give the right sums. The second group is made 0.3 s later by every rank but rank 0, the third 0.3 s later by
rank 0, so that ranks look for peers' keys (shared-memory segments, listen addresses, the job secret) before
those peers have published them again. Prints one REPORT line: per round, the sums or the error."""
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", choices=["mk", "gloo"], required=True)
    args = ap.parse_args()
    rounds = []
    me = int(os.environ["RANK"])
    for n in range(3):
        if (n == 1 and me > 0) or (n == 2 and me == 0):  # (see the docstring)
            time.sleep(0.3)
        try:
            dist.init_process_group(args.backend, timeout=datetime.timedelta(seconds=30))
            rank, world = dist.get_rank(), dist.get_world_size()
            t = torch.full((1 << 16,), float(rank + 1))
            dist.all_reduce(t)
            a = torch.full((world * 4, 8), float(rank + 1))
            b = torch.ones(8, 2)
            c = mk.gemm_allreduce(a, b)  # every entry: 8 * (1 + ... + world)
            rounds.append({"all_reduce": t.unique().tolist(), "gemm_allreduce": c.unique().tolist()})
            dist.destroy_process_group()
        except Exception as e:  # noqa: BLE001 - reported to the test
            rounds.append({"error": f"{type(e).__name__}: {e}"})
            break
    sys.stdout.write("REPORT " + json.dumps({"rounds": rounds}) + "\n")


if __name__ == "__main__":
    main()
