"""allgather_gemm's paths against the unfused composition and its parts, call by call (not a test).

torchrun script, meant for two namespace hosts (`python bench/netns.py --rates 1gbit --script gather_paths.py
-- [options]`). Every round runs each variant once, in an order shuffled per round (the same on every rank),
each call after a barrier (and with ``--settle-ms``, after a barrier, that long an idle link and a barrier:
bench/fused_ops.py's settled_start, the cores busy or asleep with ``--settle-sleep``); a call's time is the
slowest rank's. Variants:

* ``unfused``: ``all_gather_into_tensor`` then ``@`` (the baseline);
* ``tiny+unfused``: an 8-element ``all_reduce`` first, the round trip an argument agreement costs;
* ``plain``: the op's plain path (chunks=1, ``SUPERKERNEL_OPS_RING_MIN_ROWS`` above m: no ring);
* ``ring1``, ``ring2``: the ring over the transport with 1 and 2 chunks (mk across hosts);
* ``automatic``: the chunk tuner's choice (tuned during the warm-up);
* ``product``, ``allgather``: the parts alone; ``allgather+sleep+product``: with 0.5 ms between them.

Prints the median of each and its ratio to unfused; writes JSON to --out-dir.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

import superkernel  # noqa: F401  (registers the mk backend)
import superkernel.ops as mk

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from fused_ops import interleaved_rounds  # noqa: E402
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def variants(m: int, k: int, n: int, dtype: torch.dtype) -> dict[str, Callable[[], Any]]:
    R, r = dist.get_world_size(), dist.get_rank()
    gen = torch.Generator().manual_seed(r)
    a = torch.randn(m, k, generator=gen).to(dtype)
    b = torch.randn(k, n, generator=torch.Generator().manual_seed(100)).to(dtype)
    gathered = torch.empty(R * m, k, dtype=dtype)
    tiny = torch.zeros(8)

    def unfused() -> torch.Tensor:
        dist.all_gather_into_tensor(gathered, a)
        return gathered @ b

    def tiny_unfused() -> torch.Tensor:
        dist.all_reduce(tiny)
        return unfused()

    def plain() -> torch.Tensor:
        os.environ["SUPERKERNEL_OPS_RING_MIN_ROWS"] = str(m + 1)   # read at every call, agreed across ranks
        try:
            return mk.allgather_gemm(a, b, chunks=1)
        finally:
            del os.environ["SUPERKERNEL_OPS_RING_MIN_ROWS"]

    def gather_sleep_product() -> torch.Tensor:
        dist.all_gather_into_tensor(gathered, a)
        time.sleep(0.0005)
        return gathered @ b

    return {"unfused": unfused, "tiny+unfused": tiny_unfused, "plain": plain,
            "ring1": lambda: mk.allgather_gemm(a, b, chunks=1), "ring2": lambda: mk.allgather_gemm(a, b, chunks=2),
            "automatic": lambda: mk.allgather_gemm(a, b), "product": lambda: gathered @ b,
            "allgather": lambda: dist.all_gather_into_tensor(gathered, a),
            "allgather+sleep+product": gather_sleep_product}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="1024x128x1024", help="m x k x n per rank (a: [m, k] shard, b: [k, n])")
    ap.add_argument("--dtype", default="bfloat16", choices=list(DTYPES))
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=40, help="calls of each variant first (the tuner decides then)")
    ap.add_argument("--settle-ms", type=float, default=0.0, help="idle link before each call's barrier")
    ap.add_argument("--settle-sleep", action="store_true",
                    help="sleep through the settle (the cores idle too) instead of fused_ops.py's busy wait")
    ap.add_argument("--out-dir", default=str(HERE / "results"))
    ap.add_argument("--tag", default="")
    ap.add_argument("--hosts-desc", default="")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    dist.init_process_group("mk")
    m, k, n = (int(x) for x in args.shape.split("x"))
    fns = variants(m, k, n, DTYPES[args.dtype])
    for fn in fns.values():
        for _ in range(args.warmup):
            fn()
    times = interleaved_rounds(dist, list(fns.values()), args.rounds, args.settle_ms / 1e3, args.settle_sleep)
    med = {name: statistics.median(times[j].tolist()) * 1e3 for j, name in enumerate(fns)}
    if dist.get_rank() == 0:
        print(f"# allgather_gemm {args.shape} {args.dtype}, {dist.get_world_size()} ranks"
              f"{', ' + args.hosts_desc if args.hosts_desc else ''}; {args.rounds} rounds, settle "
              f"{args.settle_ms:g} ms{' (asleep)' if args.settle_sleep else ''}; slowest rank's median")
        print(f"{'variant':>24} | {'ms':>8} | {'÷ unfused':>9}")
        for name, v in med.items():
            print(f"{name:>24} | {v:>8.3f} | {v / med['unfused']:>9.3f}")
        out = Path(args.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"gather-paths-{args.tag or 'local'}.json").write_text(json.dumps(
            {"shape": args.shape, "dtype": args.dtype, "rounds": args.rounds, "settle_ms": args.settle_ms,
             "settle_sleep": args.settle_sleep, "hosts": args.hosts_desc, "median_ms": med}, indent=1),
            encoding="utf-8")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
