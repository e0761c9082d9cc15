"""The probe's plot: latency and bandwidth against message size, one line per test and route (PNG)."""
from __future__ import annotations

from superkernel.probe.report import ProbeReport

STYLE = {"latency": "-", "bw": "-", "put_latency": "--", "get_latency": ":", "put_bw": "--", "get_bw": ":",
         "allreduce": "-."}


def plot(report: ProbeReport, path: str) -> str:
    """Write the PNG to ``path`` and return it."""
    from matplotlib.figure import Figure  # no pyplot: no GUI backend, no global figure state

    fig = Figure(figsize=(11, 4.2), dpi=100)
    ax_lat, ax_bw = fig.subplots(1, 2)
    for s in report.series:
        if not s.sizes:
            continue
        where = f"{s.route.scope} {s.route.provider}" if s.route else f"{report.world_size} ranks"
        name = {"latency": "pt2pt", "bw": "pt2pt", "allreduce": "allreduce"}.get(s.test, s.test.split("_")[0])
        label = f"{name} {where}"
        if s.test.endswith("latency") or s.test == "allreduce":
            ax_lat.plot(s.sizes, s.latency_us, STYLE.get(s.test, "-"), marker=".", label=label)
        if s.test.endswith("bw") or s.test == "allreduce":
            ax_bw.plot(s.sizes, [b / 1e3 for b in s.bandwidth_MBps], STYLE.get(s.test, "-"), marker=".",
                       label=label + (" busbw" if s.test == "allreduce" else ""))
    if report.memcpy_GBps:
        ax_bw.axhline(report.memcpy_GBps, color="grey", linestyle="--", linewidth=1, label="memcpy (1 core)")
    for ax, title, unit in ((ax_lat, "latency", "µs"), (ax_bw, "bandwidth", "GB/s")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("message size (bytes)")
        ax.set_ylabel(unit)
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7)
    hosts = len(report.hosts)
    fig.suptitle(f"superkernel probe: {report.world_size} ranks on {hosts} host{'s' if hosts > 1 else ''}, "
                 f"{report.backend} ({report.date})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    return path
