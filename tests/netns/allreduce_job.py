"""Worker of the two-host test: one torchrun rank; allreduces across the job and prints one JSON line.

    torchrun ... tests/netns/allreduce_job.py [--backend gloo] [--mib 4]

Exits 0 when every result is right, 1 otherwise; the printed line says what was seen.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys

import torch
import torch.distributed as dist


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", default="gloo")
    parser.add_argument("--mib", type=int, default=4, help="size of the large allreduce in MiB")
    args = parser.parse_args()
    if args.backend == "mk":
        import superkernel  # noqa: F401  (registers the backend)
    dist.init_process_group(args.backend)
    rank, n = dist.get_rank(), dist.get_world_size()
    expected = n * (n + 1) / 2
    small = torch.full((2,), float(rank + 1))
    dist.all_reduce(small)
    large = torch.full(((args.mib << 20) // 4,), float(rank + 1))
    dist.all_reduce(large)
    hosts: list[str | None] = [None] * n
    dist.all_gather_object(hosts, socket.gethostname())
    ok = bool((small == expected).all() and (large == expected).all())
    # one write() per line: the ranks of a host share torchrun's stdout, and print() writes the newline apart
    sys.stdout.write(json.dumps({"rank": rank, "world_size": n, "local_rank": int(os.environ["LOCAL_RANK"]),
                                 "hostname": socket.gethostname(), "hosts": hosts, "small": small.tolist(),
                                 "large_min": large.min().item(), "large_max": large.max().item(),
                                 "expected": expected, "ok": ok}) + "\n")
    sys.stdout.flush()
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
