"""What calling a fused op costs at tiny shapes, where the call is all fixed cost (not a test).

torchrun script. For each GEMM op at small shapes, three ways to the same result, timed in one run:

* ``entry``: the ``superkernel.ops`` wrapper as shipped (``superkernel.ops.dispatch.call``, which goes
  through ``superkernel._C.eager_call``: arguments converted in C++, the operator called below autograd);
* ``overload``: the wrapper's former path, kept here as the baseline: the same checks in Python, then the
  ``torch.ops.mk.<op>.default`` OpOverload called inside ``torch._C._AutoDispatchBelowAutograd()``;
* ``unfused``: the same backend's collective and ATen's matmul back to back (as bench/fused_ops.py);
* with ``--carry``, also ``no-carry``: the entry with SUPERKERNEL_OPS_CARRY_BYTES=0 around the call, so the
  payload does not travel inside the argument agreement (csrc/kernels/gemm_collectives.cc, CarryLimit): the
  agreement's round trip, then mk's collective. Only differs from ``entry`` across hosts (mk over TCP), e.g.
  ``python bench/netns.py --rates 1gbit --script op_entry.py -- --carry``.

Two timings per case: ``loop``, back-to-back calls (rank 0's mean per call over --calls calls, after a
barrier), and ``barrier``, a barrier before every call with the three variants in a new random order every
round (a call's time is the maximum over ranks, the table shows the median over rounds): the way
bench/fused_ops.py times, where a call starts with colder caches. Prints a table; writes JSON to
bench/results/.

    torchrun --nproc-per-node 2 bench/op_entry.py [--backend mk|gloo] [--shapes 8x8x8,64x64x64] [--carry]
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import superkernel  # noqa: F401  (registers the mk backend)
import superkernel.ops as mk
from superkernel.ops.group_names import group_name

HERE = Path(__file__).resolve().parent


def overload_call(op: torch._ops.OpOverload, *args: Any) -> Any:
    """superkernel.ops.dispatch.call before the eager entry (2026-11-25): the baseline."""
    if torch.compiler.is_compiling() or (torch.is_grad_enabled() and torch._C._any_requires_grad(*args)):
        return op(*args)
    with torch._C._AutoDispatchBelowAutograd():
        return op(*args)


def without_carry(fn: Callable[[], Any]) -> Callable[[], Any]:
    """fn with SUPERKERNEL_OPS_CARRY_BYTES=0 (the ops read it at every call)."""
    def call() -> Any:
        os.environ["SUPERKERNEL_OPS_CARRY_BYTES"] = "0"
        try:
            return fn()
        finally:
            del os.environ["SUPERKERNEL_OPS_CARRY_BYTES"]
    return call


def variants(op: str, m: int, k: int, n: int, carry: bool) -> dict[str, Callable[[], Any]]:
    vs = _variants(op, m, k, n)
    if carry:
        vs["no-carry"] = without_carry(vs["entry"])
    return vs


def _variants(op: str, m: int, k: int, n: int) -> dict[str, Callable[[], Any]]:
    world = dist.get_world_size()
    a, b = torch.randn(m, k), torch.randn(k, n)
    if op == "allgather_gemm":
        gathered = torch.empty(world * m, k)

        def unfused() -> Any:
            dist.all_gather_into_tensor(gathered, a)
            return gathered @ b

        return {
            "entry": lambda: mk.allgather_gemm(a, b),
            "overload": lambda: overload_call(torch.ops.mk.allgather_gemm.default, a, b, group_name(None), False, 0)[0],
            "unfused": unfused,
        }
    if op == "gemm_allreduce":
        def unfused_ar() -> Any:
            c = a @ b
            dist.all_reduce(c)
            return c

        return {
            "entry": lambda: mk.gemm_allreduce(a, b),
            "overload": lambda: overload_call(torch.ops.mk.gemm_allreduce.default, a, b, group_name(None), 0),
            "unfused": unfused_ar,
        }
    out = torch.empty(m // world, n)

    def unfused_rs() -> Any:
        dist.reduce_scatter_tensor(out, a @ b)
        return out

    return {
        "entry": lambda: mk.gemm_reducescatter(a, b),
        "overload": lambda: overload_call(torch.ops.mk.gemm_reducescatter.default, a, b, group_name(None), 0),
        "unfused": unfused_rs,
    }


def max_over_ranks(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def loop_us(fn: Callable[[], Any], calls: int) -> float:
    for _ in range(min(calls, 200)):
        fn()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e6


def barrier_us(vs: dict[str, Callable[[], Any]], rounds: int, seed: int) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in vs}
    for fn in vs.values():
        fn()
    for i in range(rounds):
        order = list(vs)
        random.Random(seed * 100003 + i).shuffle(order)  # the same order on every rank
        for name in order:
            dist.barrier()
            t0 = time.perf_counter()
            vs[name]()
            times[name].append(max_over_ranks(time.perf_counter() - t0) * 1e6)
    return {name: statistics.median(v) for name, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="mk")
    ap.add_argument("--ops", default="allgather_gemm,gemm_allreduce,gemm_reducescatter")
    ap.add_argument("--shapes", default="8x8x8,64x64x64")
    ap.add_argument("--calls", type=int, default=3000, help="back-to-back calls per variant (loop)")
    ap.add_argument("--rounds", type=int, default=400, help="barrier-separated rounds (barrier)")
    ap.add_argument("--carry", action="store_true", help="also the entry without carrying (no-carry)")
    ap.add_argument("--out-dir", default=str(HERE / "results"))
    ap.add_argument("--tag", default="", help="file name tag (bench/netns.py passes one)")
    ap.add_argument("--hosts-desc", default="", help="where the ranks run, for the header (bench/netns.py)")
    args = ap.parse_args()
    if args.carry:
        os.environ.pop("SUPERKERNEL_OPS_CARRY_BYTES", None)  # (entry: the default limit)
    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = []
    for shape in args.shapes.split(","):
        m, k, n = (int(v) for v in shape.split("x"))
        for i, op in enumerate(args.ops.split(",")):
            vs = variants(op, m, k, n, args.carry)
            ref = vs["unfused"]()
            for name in vs:  # they give the same numbers (up to summation order)
                if name == "unfused":
                    continue
                torch.testing.assert_close(vs[name](), ref, rtol=1e-4, atol=1e-4)
            loop = {name: max_over_ranks(loop_us(fn, args.calls)) for name, fn in vs.items()}
            barrier = barrier_us(vs, args.rounds, seed=i)
            rows.append({"op": op, "shape": shape, "loop_us": loop, "barrier_us": barrier})
    if rank == 0:
        stamp = _dt.datetime.now(_dt.timezone.utc)
        where = f", {args.hosts_desc}" if args.hosts_desc else ""
        print(f"# fused-op entry: {world} ranks, backend {args.backend}, float32{where}; {stamp:%Y-%m-%d %H:%M} UTC")
        print("# loop: back-to-back calls, mean per call (max over ranks); barrier: a barrier before each call, "
              "median over rounds of the max over ranks")
        print("# entry = superkernel.ops wrapper (eager_call); overload = the former OpOverload path; "
              "unfused = collective + matmul" + ("; no-carry = entry, payload not carried in the agreement"
                                                 if args.carry else ""))
        others = [name for name in rows[0]["loop_us"] if name != "entry"]
        head = f"{'op':>18} | {'shape':>11} | {'timing':>7} | {'entry us':>8} | " + " | ".join(
            f"{name + ' us':>11}" for name in others) + " | " + " | ".join(f"{name + '/entry':>16}" for name in others)
        print(head)
        print("-" * len(head))
        for r in rows:
            for timing in ("loop", "barrier"):
                t = r[f"{timing}_us"]
                print(f"{r['op']:>18} | {r['shape']:>11} | {timing:>7} | {t['entry']:8.1f} | "
                      + " | ".join(f"{t[name]:11.1f}" for name in others) + " | "
                      + " | ".join(f"{t[name] / t['entry']:15.2f}x" for name in others))
        out = Path(args.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        tag = args.tag or f"{world}r-{args.backend}-{stamp:%Y%m%d-%H%M%S}"
        path = out / f"op-entry-{tag}.json"
        path.write_text(json.dumps({"backend": args.backend, "world": world, "utc": stamp.isoformat(),
                                    "host": os.uname().nodename, "hosts": args.hosts_desc, "rows": rows}, indent=1))
        print(f"wrote {path}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
