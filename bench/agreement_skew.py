"""What a fused op's argument agreement costs when the ranks arrive at different times (not a test).

torchrun script, every rank on one host, where the agreement runs on the shared-memory board
(csrc/kernels/agreement_board.h). Rank 1 enters each call a random 0..S microseconds after rank 0 (a busy
wait after a barrier); rank 0 times its call. The call is an empty gemm_allreduce (m = 0): the op's set-up
and the agreement, no transfer, so only the board's wait differs between the variants:

* ``spin <default>``: a group whose board spins as long as the shm transport before it sleeps (50 us when
  the host's ranks fit on its cores; $SUPERKERNEL_SPIN_US when set);
* ``spin 3 us``: a second group, made in the same run, whose board was created with SUPERKERNEL_SPIN_US=3
  (about the old fixed spin of 256 pauses): a late peer then finds rank 0 asleep on the futex.

The board reads the spin when the group's first fused op creates it, so both groups share everything else.
Ideal = the call at S = 0 plus the mean delay S/2. Prints a table; writes JSON to bench/results/.

    torchrun --nproc-per-node 2 bench/agreement_skew.py [--backend mk|gloo] [--calls 600]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import time
from pathlib import Path

import torch
import torch.distributed as dist

import superkernel  # noqa: F401  (registers the mk backend)
import superkernel.ops as mk

HERE = Path(__file__).resolve().parent
SKEWS_US = (0, 20, 60, 200)


def busy_wait(us: float) -> None:
    end = time.perf_counter() + us * 1e-6
    while time.perf_counter() < end:
        pass


def measure(pg: dist.ProcessGroup, skew_us: float, calls: int, seed: int) -> tuple[float, float]:
    """Rank 0's median and p90 call time (microseconds) with rank 1 late by uniform(0, skew_us)."""
    a, b = torch.empty(0, 8), torch.empty(8, 8)
    rng = random.Random(seed)  # the same delays on every rank (only rank 1 uses them)
    times = []
    for _ in range(calls):
        delay = rng.uniform(0, skew_us)
        dist.barrier(group=pg)
        if dist.get_rank() == 1:
            busy_wait(delay)
        t0 = time.perf_counter()
        mk.gemm_allreduce(a, b, pg)
        times.append(time.perf_counter() - t0)
    times = sorted(times[calls // 6:])  # the first calls warm up
    return times[len(times) // 2] * 1e6, times[int(len(times) * 0.9)] * 1e6


def group_with_spin(backend: str, spin_us: str | None) -> dist.ProcessGroup:
    pg = dist.new_group(backend=backend)
    old = os.environ.get("SUPERKERNEL_SPIN_US")
    if spin_us is not None:
        os.environ["SUPERKERNEL_SPIN_US"] = spin_us
    try:
        for _ in range(4):  # call 0 creates the board (and reads the spin); from call 2 on it is in use
            mk.gemm_allreduce(torch.empty(0, 8), torch.empty(8, 8), pg)
    finally:
        if spin_us is not None:
            if old is None:
                del os.environ["SUPERKERNEL_SPIN_US"]
            else:
                os.environ["SUPERKERNEL_SPIN_US"] = old
    return pg


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="mk", choices=["mk", "gloo"])
    ap.add_argument("--calls", type=int, default=600, help="timed calls per (variant, skew)")
    ap.add_argument("--out-dir", default=str(HERE / "results"))
    args = ap.parse_args()
    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    if world < 2:
        raise SystemExit("agreement_skew.py needs 2 or more ranks (torchrun --nproc-per-node 2)")
    default_label = f"spin {os.environ.get('SUPERKERNEL_SPIN_US', 'default')}"
    variants = {default_label: group_with_spin(args.backend, None), "spin 3 us": group_with_spin(args.backend, "3")}
    rows = []
    for rnd in range(2):  # two passes, variants alternating, to see the run's own noise
        for skew in SKEWS_US:
            for label, pg in (variants.items() if rnd == 0 else reversed(variants.items())):
                p50, p90 = measure(pg, skew, args.calls, seed=skew)
                rows.append({"pass": rnd, "skew_us": skew, "variant": label, "p50_us": p50, "p90_us": p90})
    if rank == 0:
        stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        print(f"# agreement under skew: {world} ranks, {args.backend}, one host, empty gemm_allreduce; {stamp}")
        print("# rank 0's call in us (p50 / p90) when rank 1 is late by uniform(0, S) us; two passes")
        labels = list(variants)
        print(f"{'S us':>5} | {'ideal p50':>9} | " + " | ".join(f"{lab + ' (pass 1, 2)':>36}" for lab in labels))
        base = {r["variant"]: r["p50_us"] for r in rows if r["skew_us"] == 0 and r["pass"] == 0}
        for skew in SKEWS_US:
            cells = []
            for lab in labels:
                got = [r for r in rows if r["skew_us"] == skew and r["variant"] == lab]
                cells.append(", ".join(f"{r['p50_us']:6.1f} / {r['p90_us']:6.1f}" for r in got))
            print(f"{skew:5d} | {base[labels[0]] + skew / 2:9.1f} | " + " | ".join(f"{c:>36}" for c in cells))
        out = Path(args.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        path = out / f"agreement-skew-{world}r-{args.backend}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}.json"
        path.write_text(json.dumps({"backend": args.backend, "world": world, "when": stamp, "rows": rows}, indent=1))
        print(f"wrote {path}")
    for pg in variants.values():
        dist.destroy_process_group(pg)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
