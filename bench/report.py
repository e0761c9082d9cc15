"""Presentation of collective benchmark results: OSU-style tables and a PNG plot.

Pure functions over the JSON document that ``bench/collectives.py`` writes, so a saved result can be
re-printed or re-plotted later:

    python bench/report.py bench/results/collectives-2r-mpirun-20261122-050000.json [--plot out.png]

Conventions (nccl-tests, "PERFORMANCE.md"):
- size: bytes of the larger buffer of the operation (allreduce/broadcast: the buffer; allgather: the gathered
  output; reduce_scatter: the input that is scattered; all_to_all: the per-rank send buffer).
- latency: average time per iteration on each rank, then the maximum over ranks (the slowest rank).
  p50 (optional column): median over iterations of the slowest rank's time for that iteration; on a busy
  2-core machine averages carry a long tail of scheduler delays, the median shows the typical call.
- algbw = size / latency; busbw = algbw * factor with factor allreduce 2(n-1)/n, allgather, reduce_scatter
  and all_to_all (n-1)/n, broadcast 1. GB/s means 1e9 bytes per second.
- ratio a/b = latency of b / latency of a: how many times faster backend a is than b (> 1: a is faster).
"""
from __future__ import annotations

import argparse
import json
from collections.abc import Iterable, Sequence
from typing import Any

BACKEND_ORDER = ("mk", "gloo", "mpi")
SIZED_OPS = ("allreduce", "allgather", "reduce_scatter", "broadcast", "all_to_all")
ALL_OPS = SIZED_OPS + ("barrier",)


def bus_factor(op: str, world_size: int) -> float:
    """nccl-tests' bus-bandwidth factor: busbw = algbw * factor."""
    n = world_size
    if op == "allreduce":
        return 2.0 * (n - 1) / n
    if op in ("allgather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    if op == "broadcast":
        return 1.0
    if op == "barrier":
        return 0.0
    raise ValueError(f"bus_factor: unknown op {op!r}")


def format_size(nbytes: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift and nbytes % (1 << shift) == 0:
            return f"{nbytes >> shift} {unit}"
    return f"{nbytes} B"


def _ratio(subject: dict[str, Any] | None, baseline: dict[str, Any] | None) -> str:
    if subject is None or baseline is None or subject["lat_us"] <= 0:
        return "-"
    return f"{baseline['lat_us'] / subject['lat_us']:.3g}x"


def ratio_pairs(backends: Sequence[str]) -> list[tuple[str, str]]:
    """(subject, baseline) pairs shown as ratio columns: mk against every baseline, else the first available
    backend against the others (so a run without mk still compares Gloo with MPI)."""
    if not backends:
        return []
    subject = backends[0]
    return [(subject, other) for other in backends[1:]]


def format_op_table(doc: dict[str, Any], op: str, p50: bool = False, sizes: set[int] | None = None) -> str:
    """One OSU-style block for ``op``: a header, then one row per size (barrier: one row). ``p50`` adds the
    median over iterations of the slowest rank's time per iteration next to the average."""
    meta = doc["meta"]
    backends = available_backends(doc)
    rows = [r for r in doc["results"] if r["op"] == op]
    if sizes is not None and op != "barrier":
        keep = _nearest_present(sorted({r["bytes"] for r in rows}), sizes)
        rows = [r for r in rows if r["bytes"] in keep]
    by_key = {(r["backend"], r["bytes"]): r for r in rows}
    sizes = sorted({r["bytes"] for r in rows})
    pairs = ratio_pairs(backends)
    n = meta["world_size"]
    lines = [f"# {op}  ({meta['dtype']}, {n} ranks, {meta.get('hosts_desc', '')}; "
             f"avg latency per iteration, max over ranks; busbw factor {bus_factor(op, n):.3g})"]
    head = f"{'size':>10} "
    sub = f"{'':>10} "
    extra = 11 if p50 else 0
    for b in backends:
        p50_head = f" {'p50(us)':>10}" if p50 else ""
        if op == "barrier":
            head += f"| {b:^{12 + extra}} "
            sub += f"| {'lat(us)':>12}{p50_head} "
        else:
            head += f"| {b:^{32 + extra}} "
            sub += f"| {'lat(us)':>12}{p50_head} {'algbw':>9} {'busbw':>9} "
    for s, o in pairs:
        head += f"| {s + '/' + o:>9} "
        sub += f"| {'(faster)':>9} "
    lines += [head.rstrip(), sub.rstrip()]
    for size in sizes:
        line = f"{format_size(size) if op != 'barrier' else '-':>10} "
        for b in backends:
            r = by_key.get((b, size))
            flag = "" if r is None or r.get("check", "ok") == "ok" else "!"
            p50_cell = f" {_lat(r, 'lat_us_p50'):>10}" if p50 else ""
            if op == "barrier":
                line += f"| {_lat(r) + flag:>12}{p50_cell} "
            else:
                line += (f"| {_lat(r) + flag:>12}{p50_cell} {_bw(r, 'algbw_GBps'):>9} {_bw(r, 'busbw_GBps'):>9} ")
        for s, o in pairs:
            line += f"| {_ratio(by_key.get((s, size)), by_key.get((o, size))):>9} "
        lines.append(line.rstrip())
    failed = [r for r in rows if r.get("check", "ok") != "ok"]
    for r in failed:
        lines.append(f"# ! {r['backend']} {op} {r['bytes']} B: wrong result: {r['check']}")
    for e in doc.get("errors", []):
        if e["op"] == op:
            lines.append(f"# ! {e['backend']} {op} failed at {format_size(e['bytes'])} on "
                         f"{e.get('failed_ranks', '?')} of {doc['meta']['world_size']} ranks: {e['error']}")
    return "\n".join(lines)


def _nearest_present(present: list[int], wanted: set[int]) -> set[int]:
    """For each wanted size the smallest measured size >= it (allgather & co. round tiny sizes up to one
    element per rank)."""
    return {next(p for p in present if p >= w) for w in wanted if present and present[-1] >= w}


def _lat(r: dict[str, Any] | None, key: str = "lat_us") -> str:
    return "-" if r is None or key not in r else f"{r[key]:.2f}"


def _bw(r: dict[str, Any] | None, key: str) -> str:
    return "-" if r is None else f"{r[key]:.3f}"


def available_backends(doc: dict[str, Any]) -> list[str]:
    info = doc["meta"]["backends"]
    return [b for b in BACKEND_ORDER if info.get(b, {}).get("available")]


def format_header(doc: dict[str, Any]) -> str:
    meta = doc["meta"]
    lines = [f"# superkernel collectives benchmark: {meta['world_size']} ranks "
             f"({meta.get('hosts_desc', '')}), launcher {meta['launcher']}, dtype {meta['dtype']}, "
             f"torch {meta.get('torch_version', '?')}"]
    for b in BACKEND_ORDER:
        info = meta["backends"].get(b, {"available": False, "reason": "not requested"})
        if info.get("available"):
            lines.append(f"#   {b:5}: {info.get('detail', 'available')}")
        else:
            lines.append(f"#   {b:5}: unavailable ({info.get('reason', '?')})")
    mc = meta.get("memcpy")
    if mc:
        lines.append(f"#   memcpy (single thread, {format_size(mc['bytes'])}, rank 0): "
                     f"{mc['best_GBps']:.2f} GB/s best, {mc['median_GBps']:.2f} GB/s median "
                     f"-- ceiling of one rank's shm copy")
    lines.append("#   ratio a/b = latency(b)/latency(a): how many times faster a is; '!' marks a wrong result")
    return "\n".join(lines)


def _verdict(x: float, want: float) -> str:
    if x >= want:
        return "met"
    return "NOT met, within 5%" if x >= 0.95 * want else "NOT met"


def format_targets(doc: dict[str, Any]) -> str:
    """mk against the targets of issue 2 (reported, not asserted): on 2 ranks of one host the 16 MiB
    allreduce bus bandwidth (>= 5x Gloo, >= MPI) and the 8 B allreduce latency (<= Gloo/10, <= MPI); across
    hosts the largest allreduce's bandwidth (>= Gloo); everywhere the (op, size) points where mk is slower
    than Gloo."""
    backends = available_backends(doc)
    if "mk" not in backends or len(backends) < 2:
        return ""
    by = {(r["op"], r["backend"], r["bytes"]): r for r in doc["results"]}
    lines = ["# targets (issue 2; x = how many times faster mk is):"]

    def speedup(op: str, size: int, base: str) -> float | None:
        mk, other = by.get((op, "mk", size)), by.get((op, base, size))
        return None if mk is None or other is None else other["lat_us"] / mk["lat_us"]

    one_host = len(set(doc["meta"].get("hosts") or [None])) == 1
    if not one_host:
        sizes = sorted(b for (op, be, b) in by if op == "allreduce" and be == "mk")
        x = speedup("allreduce", sizes[-1], "gloo") if sizes else None
        if x is not None:
            lines.append(f"#   between hosts, allreduce {format_size(sizes[-1])} bandwidth vs gloo {x:.3g}x "
                         f"(want >= 1x: {_verdict(x, 1.0)})")
    elif doc["meta"]["world_size"] == 2:
        for size, label, goal in ((16 << 20, "allreduce 16 MiB bus bandwidth", {"gloo": 5.0, "mpi": 1.0}),
                                  (8, "allreduce 8 B latency", {"gloo": 10.0, "mpi": 1.0})):
            parts = []
            for base, want in goal.items():
                x = speedup("allreduce", size, base)
                if x is not None:
                    parts.append(f"vs {base} {x:.3g}x (want >= {want:g}x: {_verdict(x, want)})")
            if parts:
                lines.append(f"#   {label}: " + ", ".join(parts))
    if "gloo" in backends:
        slower = [(r["op"], r["bytes"]) for r in doc["results"] if r["backend"] == "mk"
                  and (x := speedup(r["op"], r["bytes"], "gloo")) is not None and x < 1.0]
        if slower:
            lines.append(f"#   mk slower than gloo at {len(slower)} point(s): "
                         + ", ".join(f"{op} {format_size(b) if op != 'barrier' else ''}".strip()
                                     for op, b in slower))
        else:
            lines.append("#   mk is never slower than gloo here")
    return "\n".join(lines)


def format_report(doc: dict[str, Any], ops: Iterable[str] | None = None, p50: bool = False,
                  sizes: set[int] | None = None) -> str:
    present = {r["op"] for r in doc["results"]}
    chosen = [op for op in (ops or ALL_OPS) if op in present]
    parts = [format_header(doc)] + [format_op_table(doc, op, p50, sizes) for op in chosen]
    targets = format_targets(doc)
    return "\n\n".join(parts + ([targets] if targets else []))


def plot(doc: dict[str, Any], path: str) -> None:
    """Latency (top) and bus bandwidth (bottom) against size, one column per sized op, one line per backend;
    the memcpy bandwidth is drawn as a dashed ceiling in the bandwidth panels."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ops = [op for op in SIZED_OPS if any(r["op"] == op for r in doc["results"])]
    if not ops:
        return
    backends = available_backends(doc)
    fig, axes = plt.subplots(2, len(ops), figsize=(4.2 * len(ops), 7.5), squeeze=False)
    memcpy = doc["meta"].get("memcpy")
    for col, op in enumerate(ops):
        lat_ax, bw_ax = axes[0][col], axes[1][col]
        for b in backends:
            rows = sorted((r for r in doc["results"] if r["op"] == op and r["backend"] == b),
                          key=lambda r: r["bytes"])
            if not rows:
                continue
            xs = [r["bytes"] for r in rows]
            lat_ax.plot(xs, [r["lat_us"] for r in rows], marker="o", markersize=3, label=b)
            bw_ax.plot(xs, [r["busbw_GBps"] for r in rows], marker="o", markersize=3, label=b)
        lat_ax.set_title(op)
        lat_ax.set_xscale("log", base=2)
        lat_ax.set_yscale("log")
        lat_ax.set_ylabel("latency (us)")
        bw_ax.set_xscale("log", base=2)
        bw_ax.set_ylabel("bus bandwidth (GB/s)")
        bw_ax.set_xlabel("size")
        sizes = [r["bytes"] for r in doc["results"] if r["op"] == op and r["bytes"] > 0]
        if sizes:
            lo, hi = min(sizes).bit_length() - 1, max(sizes).bit_length()
            step = max(1, (hi - lo + 5) // 6)
            ticks = [1 << k for k in range(lo, hi, step)]
            for ax in (lat_ax, bw_ax):
                ax.set_xticks(ticks, [format_size(t).replace(" ", "") for t in ticks], fontsize=8)
        if memcpy:
            bw_ax.axhline(memcpy["best_GBps"], linestyle="--", color="grey", linewidth=1, label="memcpy")
        for ax in (lat_ax, bw_ax):
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
    barrier = {r["backend"]: r["lat_us"] for r in doc["results"] if r["op"] == "barrier"}
    meta = doc["meta"]
    title = (f"{meta['world_size']} ranks ({meta.get('hosts_desc', '')}), {meta['dtype']}, "
             f"launcher {meta['launcher']}")
    if barrier:
        title += "; barrier " + ", ".join(f"{b} {barrier[b]:.1f} us" for b in backends if b in barrier)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _parse_size(text: str) -> int:
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(float(text[:-1] if mult != 1 else text) * mult)


def main() -> None:
    parser = argparse.ArgumentParser(description="Re-print (and re-plot) a saved collectives benchmark.")
    parser.add_argument("json_path")
    parser.add_argument("--plot", metavar="PNG", help="also write the plot to this path")
    parser.add_argument("--p50", action="store_true", help="show the median latency beside the average")
    parser.add_argument("--ops", help="comma-separated ops to show (default: all)")
    parser.add_argument("--sizes", help="comma-separated sizes to show, e.g. 8,1K,1M,16M (default: all)")
    args = parser.parse_args()
    with open(args.json_path, encoding="utf-8") as f:
        doc = json.load(f)
    sizes = {_parse_size(x) for x in args.sizes.split(",")} if args.sizes else None
    print(format_report(doc, args.ops.split(",") if args.ops else None, args.p50, sizes))
    if args.plot:
        plot(doc, args.plot)
        print(f"# plot: {args.plot}")


if __name__ == "__main__":
    main()


__all__ = ["bus_factor", "format_report", "format_op_table", "format_targets", "plot", "format_size", "ALL_OPS",
           "SIZED_OPS",
           "BACKEND_ORDER"]
