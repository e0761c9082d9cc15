"""The probe's text output: the hardware section, OSU-style tables, and the verdict table.

OSU micro-benchmarks print ``# Size  Latency (us)`` and ``# Size  Bandwidth (MB/s)`` columns (MB = 1e6 B);
the tables here keep that layout, one block per test and route. The verdict condenses them into one line
per kind of link: what carries the bytes, how fast, and what is absent.
"""
from __future__ import annotations

from dataclasses import dataclass

from superkernel.byte_sizes import format_bytes
from superkernel.probe.measure import PROVIDER_NAMES, Series
from superkernel.probe.report import ProbeReport

OSU_TITLES = {
    "latency": "OSU MPI Latency Test (osu_latency method)",
    "bw": "OSU MPI Bandwidth Test (osu_bw method)",
    "put_latency": "OSU MPI_Put Latency Test (one-sided, superkernel Window)",
    "get_latency": "OSU MPI_Get Latency Test (one-sided, superkernel Window)",
    "put_bw": "OSU MPI_Put Bandwidth Test (one-sided, superkernel Window)",
    "get_bw": "OSU MPI_Get Bandwidth Test (one-sided, superkernel Window)",
    "allreduce": "OSU MPI Allreduce Latency Test (+ bus bandwidth, nccl-tests factor)",
}


def gbps(mbps: float) -> str:
    return f"{mbps / 1e3:.2f} GB/s" if mbps < 10e3 else f"{mbps / 1e3:.1f} GB/s"


def micro(us: float) -> str:
    return f"{us:.2f} µs" if us < 10 else f"{us:.0f} µs"


def format_hardware(report: ProbeReport) -> str:
    lines = [f"# hardware: {len(report.hosts)} host(s), {report.world_size} rank(s), backend {report.backend}, "
             f"launcher {report.launcher}"]
    for h in report.hosts:
        ranks = report.ranks_per_host.get(h.host, [])
        lines.append(f"{h.host}: ranks {_ranks(ranks)} ({len(ranks)} on this host), {h.cpus} CPUs, "
                     f"{format_bytes(h.memory_bytes)} RAM")
        numa = ", ".join(f"node{n.node} cpus {n.cpus or '-'} {format_bytes(n.memory_bytes)}"
                         + (" (memory only)" if n.memory_only else "") for n in h.numa)
        lines.append(f"  NUMA: {len(h.numa)} node(s): {numa or 'not reported'}")
        if h.gpus:
            lines.append("  GPUs: " + "; ".join(f"{g.index}: {g.name} {format_bytes(g.memory_bytes)}" for g in h.gpus))
            if h.gpu_topology:
                lines.append("  peer links (nvidia-smi topo -m):")
                lines += ["    " + t for t in h.gpu_topology.splitlines()]
        else:
            lines.append(f"  GPUs: none ({h.gpu_source})")
        lines.append(f"  RDMA: {_rdma(h)}")
        lines.append(f"  CXL: {_cxl(h)}")
    return "\n".join(lines)


def _ranks(ranks: list[int]) -> str:
    if ranks and ranks == list(range(ranks[0], ranks[-1] + 1)) and len(ranks) > 2:
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(map(str, ranks))


def _rdma(h) -> str:  # noqa: ANN001 - HostHardware
    verbs = h.ibverbs_devices
    verbs_txt = ("libibverbs not installed" if verbs is None
                 else f"libibverbs lists {len(verbs)} device(s)" + (f": {', '.join(verbs)}" if verbs else ""))
    if not h.rdma:
        return f"not present ({h.rdma_source}; {verbs_txt})"
    devs = "; ".join(f"{d.name} " + ", ".join(f"port {p.port} {p.state} {p.rate} {p.link_layer}".strip()
                                               for p in d.ports) for d in h.rdma)
    return f"{devs} ({verbs_txt})"


def _cxl(h) -> str:  # noqa: ANN001 - HostHardware
    mem_only = [n for n in h.numa if n.memory_only]
    extra = (f"; memory-only NUMA node(s) {', '.join(f'node{n.node} {format_bytes(n.memory_bytes)}' for n in mem_only)}"
             if mem_only else "; no memory-only NUMA node")
    if not h.cxl:
        return f"not present ({h.cxl_source}{extra})"
    return f"{', '.join(h.cxl)}{extra}"


def format_series(s: Series) -> str:
    where = s.route.label if s.route else "all ranks"
    lines = [f"# {OSU_TITLES.get(s.test, s.test)}", f"# {where}"]
    if s.test == "allreduce":
        lines.append(f"# {'Size':<12}{'Avg Latency(us)':>18}{'busbw (MB/s)':>16}")
        lines += [f"{z:<14d}{lat:>16.2f}{bw:>16.2f}" for z, lat, bw in zip(s.sizes, s.latency_us, s.bandwidth_MBps)]
    elif s.test.endswith("latency"):
        lines.append(f"# {'Size':<12}{'Latency (us)':>16}")
        lines += [f"{z:<14d}{lat:>16.2f}" for z, lat in zip(s.sizes, s.latency_us)]
    else:
        lines.append(f"# {'Size':<12}{'Bandwidth (MB/s)':>20}")
        lines += [f"{z:<14d}{bw:>20.2f}" for z, bw in zip(s.sizes, s.bandwidth_MBps)]
    return "\n".join(lines)


@dataclass
class VerdictRow:
    link: str
    provider: str
    latency: str
    bandwidth: str
    one_sided: str

    def cells(self) -> list[str]:
        return [self.link, self.provider, self.latency, self.bandwidth, self.one_sided]


def _route_row(report: ProbeReport, scope: str) -> VerdictRow | None:
    lat = next((s for s in report.series if s.test == "latency" and s.route and s.route.scope == scope), None)
    if lat is None:
        return None
    prov = lat.route.provider  # type: ignore[union-attr]
    bw = report.find("bw", prov, scope)
    peak = max(bw.bandwidth_MBps) if bw and bw.bandwidth_MBps else 0.0
    one = []
    for test in ("put", "get"):
        b = report.find(f"{test}_bw", prov, scope)
        lt = report.find(f"{test}_latency", prov, scope)
        if b and lt and b.bandwidth_MBps:
            one.append(f"{test} {gbps(max(b.bandwidth_MBps))}, {micro(lt.latency_us[0])}")
    return VerdictRow(scope, f"{PROVIDER_NAMES.get(prov, prov)} (mk {prov})" if report.backend == "mk"
                      else PROVIDER_NAMES.get(prov, prov),
                      f"{micro(lat.latency_us[0])} ({format_bytes(lat.sizes[0])})",
                      f"{gbps(peak)} (peak)" if peak else "-", "; ".join(one) or "not measured")


def verdict_rows(report: ProbeReport) -> list[VerdictRow]:
    rows = []
    for scope in ("intra-host", "inter-host"):
        row = _route_row(report, scope)
        if row is not None:
            rows.append(row)
        elif scope == "intra-host":
            rows.append(VerdictRow(scope, "not measured", "-", "-",
                                   "no two ranks share a host" if report.world_size > 1 else "a single rank"))
        else:
            rows.append(VerdictRow(scope, "not measured", "-", "-", f"all ranks on {len(report.hosts)} host"
                                   if len(report.hosts) == 1 else "no route to another host"))
    rdma = [h for h in report.hosts if h.rdma or h.ibverbs_devices]
    if rdma:
        names = sorted({d.name for h in rdma for d in h.rdma} | {n for h in rdma for n in (h.ibverbs_devices or [])})
        rows.append(VerdictRow("RDMA", f"present: {', '.join(names)}", "-", "-",
                               "not used by mk (no ibverbs provider in this build)"))
    else:
        rows.append(VerdictRow("RDMA", "not present", "-", "-", "-"))
    cxl = [c for h in report.hosts for c in h.cxl_memory]
    mem_only = [f"{h.host}:node{n.node}" for h in report.hosts for n in h.numa if n.memory_only]
    rows.append(VerdictRow("CXL memory", f"present: {', '.join(cxl or mem_only)}" if cxl or mem_only
                           else "not present", "-", "-", "-"))
    gpus = sum(len(h.gpus) for h in report.hosts)
    rows.append(VerdictRow("GPU peers", f"{gpus} GPU(s), see nvidia-smi topo -m above" if gpus else "no GPU",
                           "-", "-", "-"))
    ar = report.find("allreduce")
    if ar and ar.sizes:
        rows.append(VerdictRow("allreduce", f"{report.world_size} ranks, {report.backend}",
                               f"{micro(ar.latency_us[0])} ({format_bytes(ar.sizes[0])})",
                               f"{gbps(max(ar.bandwidth_MBps))} busbw", "-"))
    if report.memcpy_GBps:
        rows.append(VerdictRow("memcpy", "one core, rank 0 (shm ceiling)", "-", f"{report.memcpy_GBps:.2f} GB/s",
                               "-"))
    return rows


def verdict_line(report: ProbeReport) -> str:
    """One sentence: "intra-host: shared memory, 9.8 GB/s, 0.4 µs; inter-host: ...; RDMA: not present"."""
    parts = []
    for r in verdict_rows(report):
        if r.link in ("intra-host", "inter-host"):
            if r.provider == "not measured":
                parts.append(f"{r.link}: not measured ({r.one_sided})")
            else:
                one = f" (one-sided {r.one_sided.split(';')[0]})" if r.one_sided.startswith("put ") else ""
                parts.append(f"{r.link}: {r.provider.split(' (mk')[0]}, {r.bandwidth.split(' (')[0]}, "
                             f"{r.latency.split(' (')[0]}{one}")
        elif r.link in ("RDMA", "CXL memory"):
            parts.append(f"{r.link}: {r.provider}")
    return "; ".join(parts)


def format_verdict(report: ProbeReport) -> str:
    head = ["link", "provider", "latency", "bandwidth", "one-sided (Window)"]
    rows = [r.cells() for r in verdict_rows(report)]
    width = [max(len(head[i]), *(len(r[i]) for r in rows)) for i in range(len(head))]
    out = ["# verdict", "  ".join(h.ljust(w) for h, w in zip(head, width)).rstrip(),
           "  ".join("-" * w for w in width)]
    out += ["  ".join(c.ljust(w) for c, w in zip(r, width)).rstrip() for r in rows]
    out.append(verdict_line(report))
    return "\n".join(out)


def format_report(report: ProbeReport, tables: bool = True) -> str:
    parts = [format_hardware(report)]
    if tables:
        parts += [format_series(s) for s in report.series]
    parts += [f"# note: {n}" for n in report.notes]
    parts.append(format_verdict(report))
    parts.append(f"# probe took {report.seconds:.1f} s ({report.date})")
    return "\n\n".join(parts)
