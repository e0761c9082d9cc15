"""Why a tiny fused op on Gloo lands in Gloo's slow mode more often than the unfused composition (not a test).

Gloo's small collectives on the 2-core development VM are bimodal (bench/README.md: ~0.3 ms, or ~4 ms while
Gloo's TCP loop thread spins on data that arrived before its receive was posted). A fused op first agrees on
its arguments with the other ranks; on one host that agreement is the shared-memory board, which leaves the
ranks synchronised when they issue the collective. This script separates the synchronisation from the rest
of the op. Variants, each a 2-rank call timed on every rank:

* ``unfused``: ``a @ b`` then ``dist.all_reduce`` (Gloo);
* ``board+unfused``: an empty fused op first (``gemm_allreduce`` with m = 0: the op's set-up and the board
  agreement, no transfer), then the same ``a @ b`` and ``dist.all_reduce``: the unfused composition with the
  fused op's synchronisation in front of it;
* ``fused``: ``superkernel.ops.gemm_allreduce(a, b)``.

Two timings: back-to-back calls (``loop``), and a barrier before every call (``barrier``); the variants run
interleaved, one call each per round in a new random order every round. Prints rank 0's p10/p50/p90 and the
share of calls slower than --slow-us per variant; writes JSON to bench/results/.

    torchrun --nproc-per-node 2 bench/gloo_arrival.py [--rounds 400] [--shape 8x8x8]
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import superkernel  # noqa: F401  (registers the fused ops)
import superkernel.ops as mk

HERE = Path(__file__).resolve().parent


def quantile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[int(q * (len(s) - 1))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=400)
    ap.add_argument("--shape", default="8x8x8")
    ap.add_argument("--slow-us", type=float, default=750.0, help="a call slower than this is in the slow mode")
    ap.add_argument("--out-dir", default=str(HERE / "results"))
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    m, k, n = (int(v) for v in args.shape.split("x"))
    a, b = torch.randn(m, k), torch.randn(k, n)
    empty = torch.empty(0, k)

    def unfused() -> Any:
        c = a @ b
        dist.all_reduce(c)
        return c

    def board_then_unfused() -> Any:
        mk.gemm_allreduce(empty, b)
        return unfused()

    variants: dict[str, Callable[[], Any]] = {
        "unfused": unfused, "board+unfused": board_then_unfused, "fused": lambda: mk.gemm_allreduce(a, b)}
    for fn in variants.values():  # the board is in use from a group's third fused-op call
        for _ in range(3):
            fn()
    results: dict[str, dict[str, list[float]]] = {}
    for timing in ("loop", "barrier"):
        times: dict[str, list[float]] = {name: [] for name in variants}
        for i in range(args.rounds):
            order = list(variants)
            random.Random(i).shuffle(order)  # the same order on every rank
            for name in order:
                if timing == "barrier":
                    dist.barrier()
                t0 = time.perf_counter()
                variants[name]()
                times[name].append((time.perf_counter() - t0) * 1e6)
        results[timing] = times
    if rank == 0:
        stamp = _dt.datetime.now(_dt.timezone.utc)
        print(f"# Gloo, 2 ranks, gemm_allreduce {args.shape} float32; {stamp:%Y-%m-%d %H:%M} UTC; rank 0's calls, "
              f"{args.rounds} rounds; slow = over {args.slow_us:.0f} us")
        head = f"{'timing':>7} | {'variant':>13} | {'p10 us':>7} | {'p50 us':>7} | {'p90 us':>7} | {'slow':>5}"
        print(head)
        print("-" * len(head))
        for timing, times in results.items():
            for name, v in times.items():
                slow = sum(t > args.slow_us for t in v) / len(v)
                print(f"{timing:>7} | {name:>13} | {quantile(v, 0.1):7.0f} | {quantile(v, 0.5):7.0f} | "
                      f"{quantile(v, 0.9):7.0f} | {slow:5.0%}")
        out = Path(args.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        path = out / f"gloo-arrival-{stamp:%Y%m%d-%H%M%S}.json"
        path.write_text(json.dumps({"utc": stamp.isoformat(), "shape": args.shape, "slow_us": args.slow_us,
                                    "times_us": results}, indent=1))
        print(f"wrote {path}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
