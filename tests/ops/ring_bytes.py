"""Runs inside every rank of an mk job whose ranks are on two network-namespace hosts: the bytes this rank's
host sends per call of gemm_allreduce and gemm_reducescatter on the ring across hosts, and of mk's own
all_reduce and reduce_scatter_tensor of a tensor of the product's size, in each dtype (with
--collectives-only, mk's collectives alone: for several ranks per host).
The host's counters are /proc/net/dev of the rank's own namespace (every interface but loopback), read after
a barrier before and after a run of calls, so they count the ring's messages (and TCP/IP's headers, and
the barriers'). Prints one REPORT line per rank: {"rank", "bytes_per_call": {"<op> <dtype>": bytes}, "native":
{half type: multiplied as it is}, "shape": [m, k, n]}."""
from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.distributed as dist

import superkernel.ops as mk


def sent_bytes() -> int:
    """Bytes sent by every non-loopback interface of this network namespace so far."""
    total = 0
    with open("/proc/net/dev", encoding="ascii") as f:
        for line in f.readlines()[2:]:
            name, data = line.split(":", 1)
            if name.strip() != "lo":
                total += int(data.split()[8])
    return total


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--collectives-only", action="store_true")
    args = ap.parse_args()
    dist.init_process_group("mk")
    rank, world = dist.get_rank(), dist.get_world_size()
    # m rows with m / world >= 64 (SUPERKERNEL_OPS_RING_MIN_ROWS' default, which the test sets: with it set the
    # ops always ring, without it the tuner may keep the plain path); products of 256 KiB and more in a half
    # type, above what mk carries in the agreement
    m, k, n = 256, 64, 512
    out: dict[str, float] = {}
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        gen = torch.Generator().manual_seed(rank)
        a = torch.randn(m, k, generator=gen).to(dtype)
        b = torch.randn(k, n, generator=gen).to(dtype)
        c = a @ b
        block = torch.empty(m // world, n, dtype=dtype)
        calls = (("gemm_allreduce", lambda: mk.gemm_allreduce(a, b)),
                 ("gemm_reducescatter", lambda: mk.gemm_reducescatter(a, b)),
                 ("all_reduce", lambda: dist.all_reduce(c.clone())),  # (a fresh copy: no overflow)
                 ("reduce_scatter", lambda: dist.reduce_scatter_tensor(block, c)))
        for name, op in calls:
            if args.collectives_only and name.startswith("gemm_"):
                continue
            for _ in range(40):  # past the chunk tuner's calls (its choice changes message counts, not bytes)
                op()
            dist.barrier()
            before = sent_bytes()
            for _ in range(args.calls):
                op()
            dist.barrier()
            out[f"{name} {str(dtype).removeprefix('torch.')}"] = (sent_bytes() - before) / args.calls
    from superkernel import _C
    native = {t: bool(_C.half_gemm_native(t)) for t in ("float16", "bfloat16")}
    sys.stdout.write("REPORT " + json.dumps({"rank": rank, "world": world, "bytes_per_call": out,
                                             "native": native, "shape": [m, k, n]}) + "\n")
    sys.stdout.flush()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
