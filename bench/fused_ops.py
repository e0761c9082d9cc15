"""Fused compute+communication operators (torch.ops.mk.*) against their unfused composition, in one run.

    torchrun --nproc-per-node 2 bench/fused_ops.py                       # every registered case, mk backend
    torchrun --nproc-per-node 2 bench/fused_ops.py --ops gemm_allreduce --shapes 1024x1024x1024
    torchrun --nproc-per-node 2 bench/fused_ops.py --backend gloo        # the same ops over Gloo
    python bench/netns.py --rates 1gbit --script fused_ops.py -- --shapes 1024x768x1024   # two hosts

For each case (an op at one shape): the fused op; the unfused composition (the same backend's collective
and ATen's matmul back to back); the computation alone; the communication alone; and both at once (the
communication on a helper thread while this thread computes, independent of each other). ideal =
max(compute, comm) is what perfect overlap would reach on a machine where communication costs no CPU;
"both at once" is what overlapping two independent pieces of work reaches on this one (on a small VM the
communication's CPU work, the kernel's network stack included, slows the computation), so it bounds what
any pipelining can do. Columns: op, shape, fused ms, unfused ms, speedup (unfused / fused), ideal ms,
fused/ideal, both ms, fused/both; with --machine-cpu (netns.py sets it) also cpu bound ms = max(ideal,
(compute's + comm's busy CPU time of the whole machine) / its cores), what no overlap beats where the two
share the cores (netns "hosts" share this machine's), and fused/cpu bound. Each case is measured in two
passes. The first times the fused op against the unfused composition, each in two slots of every round
(fused, fused again, unfused, unfused again): a call runs faster when its code is warm in the caches, and a
pass where four of six variants ran the unfused code (unfused, its A/A copy, the compute and the
communication alone) left the fused op's code the coldest; at 256^3 that alone moved the speedup from
1.03-1.07x to 0.97x (bench/README.md). The second pass times the computation alone, the communication alone
and both at once. Within a pass the variants are interleaved, one call each per round, in a new random order
every round; with --blocks N the two passes alternate in N blocks (the detail then gives fused/ideal per
block: how far the machine drifted); each call starts after a barrier; a call's time is the maximum over
ranks (the slowest rank decides) and the table shows the median over the rounds. The detail gives A/A for
both: unfused / unfused again and fused / fused again (the noise a speedup must exceed), and the speedup's
95% interval (a paired bootstrap over the first pass's rounds, bench/speedup_interval.py); a closing line
names the rows whose interval lies below 1, slower than unfused beyond the run's noise. Each row's detail
also gives the median minor page faults per call of the fused and unfused variants (the maximum over ranks;
whole process). Results go to bench/results/fused-<tag>.json and .png.

Cases come from a registry (bench/fused_registry.py): every module bench/fused_cases_*.py registers
factories with ``@register`` (see bench/fused_cases_gemm.py); a factory receives the Context and returns Case
objects. Adding an op family means adding one such module; this file needs no change. A benchmark, not a
test: it asserts nothing.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import importlib
import json
import os
import platform
import random
import resource
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from fused_registry import REGISTRY, Context  # noqa: E402
from speedup_interval import paired_ratio_interval  # noqa: E402


def load_case_modules() -> list[str]:
    """Import every bench/fused_cases_*.py (each registers its factories)."""
    names = sorted(p.stem for p in HERE.glob("fused_cases_*.py"))
    for name in names:
        importlib.import_module(name)
    return names


def parse_shapes(text: str) -> list[tuple[int, ...]]:
    """'1024x512x256,64x64x64' -> [(1024, 512, 256), (64, 64, 64)]."""
    return [tuple(int(v) for v in s.split("x")) for s in text.split(",") if s.strip()]


# ------------------------------------------------------------------------------------------------ timing
def _barrier(dist: Any) -> None:
    dist.barrier()


def _max_over_ranks(dist: Any, torch: Any, value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


class Concurrently:
    """``compute()`` on the calling thread while ``comm()`` runs on a helper thread (kept for the case, so a
    call costs two semaphore hand-offs, not a thread start). The two share no ordering: where they touch the
    same tensor its values are meaningless, which does not matter for timing."""

    def __init__(self, compute: Callable[[], Any], comm: Callable[[], Any]) -> None:
        self.compute, self.comm = compute, comm
        self._go, self._done = threading.Semaphore(0), threading.Semaphore(0)
        self._error: BaseException | None = None
        threading.Thread(target=self._serve, name="bench-comm", daemon=True).start()

    def _serve(self) -> None:
        while True:
            self._go.acquire()
            try:
                self.comm()
            except BaseException as e:  # noqa: BLE001 - re-raised on the calling thread
                self._error = e
            self._done.release()

    def __call__(self) -> None:
        self._go.release()
        try:
            self.compute()
        finally:
            self._done.acquire()
        if self._error is not None:
            raise self._error


def settled_start(dist: Any, seconds: float, sleep: bool = False) -> None:
    """Before a timed call: every rank done with the previous call (a barrier), ``seconds`` of idle link
    (``settle``), then a barrier. Returns when the call may start; with ``seconds`` 0, one barrier.

    The first barrier is what makes the busy settle fair where the ranks share cores (the namespace hosts):
    without it the rank that finished first spun through its settle while the other was still finishing, and
    the threads that other rank's call still needed (Gloo's, mk's progress) waited for a core behind the spin.
    A 384 B Gloo send/recv exchange between 2 namespace hosts (unshaped veth, 60 calls, the slower rank):
    median 1.87 ms (p75 2.39) after a settle with no barrier before it, 0.16 ms (p75 0.18) with one, 0.14
    (p75 0.16) with the two barriers and no settle (bench/README.md, "A barrier before the settle")."""
    if seconds > 0:
        _barrier(dist)
        settle(seconds, sleep)
    _barrier(dist)


def interleaved_rounds(dist: Any, fns: Sequence[Callable[[], Any]], rounds: int, seconds: float,
                       sleep: bool = False) -> Any:
    """Time every function of ``fns`` once per round, in an order shuffled per round (the same on every rank:
    seeded by the round), each call after ``settled_start(dist, seconds, sleep)``. Returns a float64 tensor
    [len(fns), rounds] of seconds, each the slowest rank's (an allreduce MAX at the end)."""
    import torch

    times = torch.zeros(len(fns), rounds, dtype=torch.float64)
    order = list(enumerate(fns))
    for i in range(rounds):
        random.Random(i).shuffle(order)
        for j, fn in order:
            settled_start(dist, seconds, sleep)
            t0 = time.perf_counter()
            fn()
            times[j, i] = time.perf_counter() - t0
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    return times


def settle(seconds: float, sleep: bool = False) -> None:
    """Leave the link idle for ``seconds`` before a timed call, the cores busy (a spin; ``sleep``: asleep).

    A sleep measured the VM waking from idle, not the op: 2 namespace hosts at 1 Gbit/s, bf16 1024x128x1024
    allgather_gemm, 10 ms before each call (bench/gather_paths.py, two runs each, slowest rank's median),
    the product alone took 4.21 and 4.26 ms after a sleep against 2.88 and 2.90 after a spin, and unfused
    4.63 and 5.15 against 3.24 and 3.28; every variant with the product in it 1.3-2.2 ms slower, by
    different amounts (the allgather alone 0.1-0.2 ms)."""
    if sleep:
        time.sleep(seconds)
        return
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def measure(fns: dict[str, Callable[[], Any]], seconds: float, min_iters: int, max_iters: int, dist: Any,
            torch: Any, chunks: int = 0, settle_s: float = 0.0, machine_cpu: bool = False,
            tune: bool = True) -> dict[str, list[float]]:
    """Per-round samples of each variant, the same on every rank: ``out[k]`` the call times in seconds (the
    maximum over ranks), ``out[k + "_faults"]`` its minor page faults, with ``machine_cpu`` also
    ``out[k + "_cpu"]`` the machine's busy CPU seconds. Summarise them with ``summarise``.

    The variants are interleaved (one call of each per round), so drifting load from other processes on this
    shared VM hits them alike, and every round runs them in a new order (a permutation seeded by the round
    number, the same on every rank). A call's time depends on the call before it: the first call after the
    previous round's last variant measured 30-60 us slower at 256^3 (allgather_gemm on 2 ranks, same op in
    two slots of one round). A fixed order, even rotated each round, gives every variant the same
    predecessor (fused always ran after "both", whose communication runs on a helper thread); a random one
    spreads whatever the predecessor costs over every variant. Every call
    starts after a barrier; a call's time is the maximum over ranks; the median over rounds, not the mean,
    since other processes add a long tail to some calls. ``settle_s`` seconds of idle link (untimed, the
    cores kept busy, every rank done with the call before: see ``settled_start``) precede every call: over
    a ``tc tbf`` link the shaper's token bucket then refills, so each variant starts from the same link state
    (without it, the variant that follows an idle one gets a burst the others do not).
    ``machine_cpu``: also the mean busy CPU time of the whole machine per call (every core, the kernel's
    network stack included; /proc/stat, read after the barrier and after the call, outside the timing): where
    the "hosts" share one machine, what communication costs the cores the computation needs. /proc/stat
    counts in ticks (10 ms), so only the mean over many calls means anything."""
    for fn in fns.values():  # warm-up (first-call costs: allocations, the op's link/compute estimates)
        fn()
    if tune and "fused" in fns and chunks == 0:
        # the automatic chunk count times up to most_candidates on the calls first (csrc/kernels/pipeline.h,
        # Tuner: 4 chunk counts, and the GEMM ops' plain path across hosts): measure the steady state a
        # training loop sees, not the tuning
        # (after the same idle link as every timed call: over a tc tbf link the tuner otherwise times calls
        # that start from an empty token bucket, and picks for a link the timed calls never see)
        from superkernel import _C
        # (and after the barrier every timed call starts after: tuned on calls back to back, mk's
        # gemm_allreduce once kept 2 chunks that were 0.96x of unfused in the timed calls, bench/README.md)
        for _ in range(_C.tuner_limits()["most_calls"]):
            settled_start(dist, settle_s)
            fns["fused"]()
    _barrier(dist)
    t0 = time.perf_counter()
    for fn in fns.values():
        fn()
    one = _max_over_ranks(dist, torch, time.perf_counter() - t0)
    iters = int(min(max_iters, max(min_iters, len(fns) * seconds / max(one, 1e-6))))
    times = torch.zeros(len(fns), iters, dtype=torch.float64)
    faults = torch.zeros(len(fns), iters, dtype=torch.float64)
    busy = torch.zeros(len(fns), iters, dtype=torch.float64)
    order = list(enumerate(fns.values()))
    for i in range(iters):
        random.Random(i).shuffle(order)  # seeded by the round: every rank runs the same order
        for j, fn in order:
            settled_start(dist, settle_s)
            b0 = _machine_busy() if machine_cpu else 0.0
            f0 = _minor_faults()
            t0 = time.perf_counter()
            fn()
            times[j, i] = time.perf_counter() - t0
            faults[j, i] = _minor_faults() - f0
            if machine_cpu:
                busy[j, i] = _machine_busy() - b0
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    dist.all_reduce(faults, op=dist.ReduceOp.MAX)
    out = ({k: times[j].tolist() for j, k in enumerate(fns)}
           | {f"{k}_faults": faults[j].tolist() for j, k in enumerate(fns)})
    if machine_cpu:  # every rank reads its own machine's counter: the busiest machine
        dist.all_reduce(busy, op=dist.ReduceOp.MAX)
        out |= {f"{k}_cpu": busy[j].tolist() for j, k in enumerate(fns)}
    return out


def summarise(samples: dict[str, list[float]]) -> dict[str, float]:
    """Median of each variant's call times and page faults over its rounds; mean of the machine CPU times
    (counted in 10 ms ticks: only a mean over many calls means anything)."""
    return {k: statistics.mean(v) if k.endswith("_cpu") else statistics.median(v) for k, v in samples.items()}


def merge(into: dict[str, list[float]], more: dict[str, list[float]]) -> None:
    """Append ``more``'s samples to ``into``'s, variant by variant."""
    for k, v in more.items():
        into.setdefault(k, []).extend(v)


def _machine_busy() -> float:
    """Seconds of busy CPU time of the whole machine so far (every core; /proc/stat's first line minus idle
    and iowait)."""
    with open("/proc/stat", encoding="ascii") as f:
        ticks = [int(v) for v in f.readline().split()[1:9]]
    return (sum(ticks) - ticks[3] - ticks[4]) / _TICKS


_TICKS = float(os.sysconf("SC_CLK_TCK"))
MACHINE_CPUS = os.cpu_count() or 1  # the cores /proc/stat's first line counts (the machine's, whatever the affinity)


def _minor_faults() -> int:
    """This process's minor page faults so far (every thread): a call's fresh pages, which cost 1-2 us
    each on a small VM and depend on the allocator's state (see bench/README.md, the malloc item)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


# ------------------------------------------------------------------------------------------------ report
COLUMNS = ("op", "shape", "fused ms", "unfused ms", "speedup", "ideal ms", "fused/ideal", "both ms", "fused/both")
CPU_BOUND_COLUMNS = ("cpu bound ms", "fused/cpu bound")  # with --machine-cpu


def format_table(doc: dict[str, Any]) -> str:
    meta = doc["meta"]
    lines = [f"# fused ops: {meta['world_size']} ranks, backend {meta['backend']}, {meta['dtype']}, "
             f"{meta['hosts_desc']}; {meta['date']}; median per call of the max over ranks",
             f"# compute alone / comm alone give ideal = max(compute, comm); both = the two at once, independent "
             f"(comm on a helper thread): what overlap reaches on this machine"]
    cpu_bound = bool(doc["results"]) and all("cpu_bound_ms" in r for r in doc["results"])
    if cpu_bound:
        lines.append(f"# cpu bound = max(ideal, (compute CPU + comm CPU) / {meta.get('machine_cpus', '?')} cores): the "
                     f"machine's busy CPU time of each alone, spread over every core: no overlap of those two beats "
                     f"it here (a fused op whose own transfers cost less CPU than the collective can)")
    rows = [[r["op"], r["shape"], f"{r['fused_ms']:.3f}", f"{r['unfused_ms']:.3f}",
             f"{r['unfused_ms'] / r['fused_ms']:.2f}x", f"{r['ideal_ms']:.3f}",
             f"{r['fused_ms'] / r['ideal_ms']:.2f}", f"{r['both_ms']:.3f}", f"{r['fused_ms'] / r['both_ms']:.2f}"]
            + ([f"{r['cpu_bound_ms']:.3f}", f"{r['fused_ms'] / r['cpu_bound_ms']:.2f}"] if cpu_bound else [])
            for r in doc["results"]]
    columns = COLUMNS + (CPU_BOUND_COLUMNS if cpu_bound else ())
    widths = [max(len(columns[i]), *(len(row[i]) for row in rows)) if rows else len(columns[i])
              for i in range(len(columns))]
    lines.append(" | ".join(c.rjust(w) for c, w in zip(columns, widths)))
    lines.append("-+-".join("-" * w for w in widths))
    for row, r in zip(rows, doc["results"]):
        faults = (f"; page faults per call fused {r['fused_faults']:.0f}, unfused {r['unfused_faults']:.0f}"
                  if "fused_faults" in r else "")
        aa = f", A/A {r['unfused_ms'] / r['unfused_again_ms']:.2f}" if "unfused_again_ms" in r else ""
        if "fused_again_ms" in r:
            aa += f", fused A/A {r['fused_ms'] / r['fused_again_ms']:.2f}"
        cpu = ("; machine CPU ms per call: " + ", ".join(f"{k} {r[k + '_cpu'] * 1e3:.1f}" for k in
                                                         ("fused", "unfused", "compute", "comm", "both"))
               if "fused_cpu" in r else "")
        if "speedup_ci95" in r:
            aa += f", speedup 95% CI {r['speedup_ci95'][0]:.2f}-{r['speedup_ci95'][1]:.2f}"
        by_block = r.get("fused_ideal_by_block", [])
        if len(by_block) > 1:
            aa += f", fused/ideal by block {min(by_block):.2f}-{max(by_block):.2f}"
        detail = (f"   (compute {r['compute_ms']:.3f}, comm {r['comm_ms']:.3f}{aa}{faults}{cpu}"
                  f"{'; ' + r['note'] if r['note'] else ''})")
        lines.append(" | ".join(v.rjust(w) for v, w in zip(row, widths)) + detail)
    aas = [r[f"{k}_ms"] / r[f"{k}_again_ms"] for r in doc["results"] for k in ("unfused", "fused")
           if f"{k}_again_ms" in r]
    if aas:
        lines.append(f"# A/A = unfused / the same unfused composition in a second slot of every round (and fused / "
                     f"fused again): {min(aas):.2f}-{max(aas):.2f} over these rows, this run's noise for a speedup")
    if any("speedup_ci95" in r for r in doc["results"]):
        slower = [f"{r['op']} {r['shape']}" for r in doc["results"]
                  if "speedup_ci95" in r and r["speedup_ci95"][1] < 1]
        lines.append("# speedup 95% CI: paired bootstrap over the rounds (bench/speedup_interval.py); slower than "
                     f"unfused beyond noise (CI below 1): {', '.join(slower) or 'none'}")
    return "\n".join(lines)


def plot(doc: dict[str, Any], path: Path) -> None:
    """Grouped bars per case: fused, unfused, ideal, both at once (ms)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = doc["results"]
    if not res:
        return
    fig, ax = plt.subplots(figsize=(max(6.0, 1.3 * len(res)), 4.5))
    xs = range(len(res))
    w = 0.2
    ax.bar([x - 1.5 * w for x in xs], [r["fused_ms"] for r in res], w, label="fused")
    ax.bar([x - 0.5 * w for x in xs], [r["unfused_ms"] for r in res], w, label="unfused")
    ax.bar([x + 0.5 * w for x in xs], [r["ideal_ms"] for r in res], w, label="ideal = max(compute, comm)")
    ax.bar([x + 1.5 * w for x in xs], [r["both_ms"] for r in res], w, label="compute and comm at once")
    if all("cpu_bound_ms" in r for r in res):
        ax.scatter([x + 0.5 * w for x in xs], [r["cpu_bound_ms"] for r in res], marker="_", s=300, color="black",
                   zorder=3, label="cpu bound: (compute + comm CPU) / cores")
    ax.set_xticks(list(xs), [f"{r['op']}\n{r['shape']}" for r in res], fontsize=7, rotation=20, ha="right")
    ax.set_ylabel("ms per call")
    meta = doc["meta"]
    ax.set_title(f"fused ops, {meta['world_size']} ranks, {meta['backend']}, {meta['hosts_desc']}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -------------------------------------------------------------------------------------------------- main
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="mk", help="backend the ops and the baseline run on (mk | gloo)")
    ap.add_argument("--families", default="", help="comma-separated case families (default: all registered)")
    ap.add_argument("--ops", default="", help="comma-separated op names to keep (default: all)")
    ap.add_argument("--shapes", default="", help="shapes for every selected family, e.g. 1024x1024x1024,512x256x512")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--chunks", type=int, default=0, help="chunk count for the fused ops (0 = automatic)")
    ap.add_argument("--time", type=float, default=1.0, help="seconds of timed calls per variant of a case")
    ap.add_argument("--settle-ms", type=float, default=0.0,
                    help="idle link (cores busy) before every timed call (bench/netns.py sets it on shaped links)")
    ap.add_argument("--machine-cpu", action="store_true",
                    help="also report the whole machine's busy CPU time per call (bench/netns.py sets it)")
    ap.add_argument("--blocks", type=int, default=1,
                    help="alternate the speedup pass and the bounds pass in this many blocks (each gets its share "
                         "of --time and at least --min-iters rounds)")
    ap.add_argument("--min-iters", type=int, default=3)
    ap.add_argument("--max-iters", type=int, default=200)
    ap.add_argument("--out-dir", default=str(HERE / "results"))
    ap.add_argument("--tag", default="")
    ap.add_argument("--hosts-desc", default="")
    ap.add_argument("--pin", action="store_true",
                    help="pin each rank, with every thread it starts, to one CPU (its global rank modulo the CPUs it "
                         "may use): between namespace hosts on one machine, each host then has a core of its own, "
                         "which its product's threads fill and its transport threads must share")
    args = ap.parse_args()
    if args.blocks < 1:
        ap.error(f"--blocks must be at least 1, got {args.blocks}")

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from collectives import detect_launch

    launch = detect_launch()
    if args.pin:  # (before torch and the backend start their threads: they inherit it)
        cpus = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpus[launch.rank % len(cpus)]})
    import torch
    import torch.distributed as dist

    import superkernel  # noqa: F401  (registers mk and torch.ops.mk.*)

    dist.init_process_group(args.backend, timeout=_dt.timedelta(seconds=600))
    families = load_case_modules()
    ctx = Context(rank=launch.rank, world_size=launch.world_size, group=dist.group.WORLD, backend=args.backend,
                  dtype=getattr(torch, args.dtype), shapes=parse_shapes(args.shapes) if args.shapes else None,
                  chunks=args.chunks)
    wanted_families = [f for f in args.families.split(",") if f] or list(REGISTRY)
    wanted_ops = {o for o in args.ops.split(",") if o}
    hosts = {platform.node()}
    hosts_desc = args.hosts_desc or f"1 host ({os.environ.get('SUPERKERNEL_TRANSPORT', 'auto')} transport)"
    if args.pin:
        hosts_desc += ", each rank pinned to one CPU"
    results = []
    for fam in wanted_families:
        for case in REGISTRY[fam](ctx):
            if wanted_ops and case.op not in wanted_ops:
                continue
            row: dict[str, Any] = {"family": fam, "op": case.op, "shape": case.shape, "note": case.note, **case.extra}
            # pass 1, the speedup: fused against unfused, each in two slots of every round (equally warm; an
            # A/A control for each); pass 2, the bounds: compute alone, comm alone, both at once
            pair = {"fused": case.fused, "fused_again": case.fused, "unfused": case.unfused,
                    "unfused_again": case.unfused}
            bounds = {"compute": case.compute, "comm": case.comm, "both": Concurrently(case.compute, case.comm)}
            # The passes alternate in --blocks blocks (pair, bounds, pair, bounds, ...), each with its share of
            # --time, so that the machine's speed drifting during a case (this VM's product of one shape took
            # 31.6-47.1 ms in runs minutes apart) moves the speedup's and the ideal's samples alike.
            samples: dict[str, list[float]] = {}
            per_block = []
            for blk in range(args.blocks):
                got = measure(pair, args.time / args.blocks, args.min_iters, args.max_iters, dist, torch,
                              args.chunks, args.settle_ms / 1e3, args.machine_cpu, tune=blk == 0)
                got_b = measure(bounds, args.time / args.blocks, args.min_iters, args.max_iters, dist, torch,
                                args.chunks, args.settle_ms / 1e3, args.machine_cpu, tune=False)
                med = summarise(got | got_b)
                per_block.append(med["fused"] / max(med["compute"], med["comm"]))
                merge(samples, got)
                merge(samples, got_b)
            secs = summarise(samples)
            row.update({f"{k}_ms": v * 1e3 for k, v in secs.items() if not k.endswith(("_faults", "_cpu"))})
            row.update({k: v for k, v in secs.items() if k.endswith(("_faults", "_cpu"))})
            row["iters"] = len(samples["fused"])
            row["iters_bounds"] = len(samples["compute"])
            # (the pair pass's rounds, in the same order for every variant: fused[i] and unfused[i] shared round i)
            row["speedup_ci95"] = list(paired_ratio_interval(samples["unfused"], samples["fused"]))
            row["ideal_ms"] = max(row["compute_ms"], row["comm_ms"])
            if args.machine_cpu:
                # what no overlap of the two can beat on cores that they share: the computation's and the
                # communication's CPU work spread over every core of the machine (the "hosts" of netns.py share
                # one), or ideal where that is larger (a fused op whose transfers cost less CPU than the
                # collective does, a ring of sends for mk's reduce-scatter, can be below it)
                row["cpu_bound_ms"] = max(row["ideal_ms"],
                                          (row["compute_cpu"] + row["comm_cpu"]) * 1e3 / MACHINE_CPUS)
            row["fused_ideal_by_block"] = per_block
            results.append(row)
            if launch.rank == 0:
                print(f"  measured {case.op} {case.shape}: fused {row['fused_ms']:.3f} ms, unfused "
                      f"{row['unfused_ms']:.3f} ms, ideal {row['ideal_ms']:.3f} ms, both {row['both_ms']:.3f} ms",
                      flush=True)
    cpus_by_rank: list[Any] = [None] * launch.world_size  # (the CPUs each rank may run on: --pin shows here)
    dist.all_gather_object(cpus_by_rank, sorted(os.sched_getaffinity(0)))
    doc = {"meta": {"world_size": launch.world_size, "backend": args.backend, "dtype": args.dtype,
                    "chunks": args.chunks, "blocks": args.blocks, "settle_ms": args.settle_ms,
                    "hosts_desc": hosts_desc, "cpus_by_rank": cpus_by_rank,
                    "launcher": launch.launcher, "machine_cpus": MACHINE_CPUS,
                    "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                    "host": sorted(hosts), "load": os.getloadavg(), "families": families,
                    "torch": torch.__version__, "time_per_measurement_s": args.time,
                    # glibc malloc tuning changes these numbers (see bench/README.md): record it
                    "malloc_env": {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")}},
           "results": results}
    if launch.rank == 0:
        print(format_table(doc), flush=True)
        out = Path(args.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        tag = args.tag or f"{launch.world_size}r-{args.backend}-{_dt.datetime.now().strftime('%Y%m%d-%H%M%S')}"
        (out / f"fused-{tag}.json").write_text(json.dumps(doc, indent=1), encoding="utf-8")
        plot(doc, out / f"fused-{tag}.png")
        print(f"wrote {out / f'fused-{tag}.json'} and .png", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
