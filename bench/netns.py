"""bench/collectives.py between two "hosts": network namespaces joined by a veth pair shaped with tc tbf.

As root (it creates namespaces; see tests/netns/hosts.py):

    python bench/netns.py                                   # 1gbit and 10gbit, 1 rank per host, gloo + mk
    python bench/netns.py --rates 1gbit,10gbit,none --nproc-per-host 2 -- --ops allreduce --max-bytes 64M

For each rate, one torch job of 2 × N ranks (torchrun in each namespace, static rendezvous at host a's veth
address) runs bench/collectives.py with the given options (after ``--``); the table printed by rank 0 is
shown as it comes, JSON/PNG land in bench/results/ (tag ``netns-<rate>-2x<N>``), and a summary compares the
backends per rate. MPI is not measured here (no mpirun across the namespaces); mk is measured when
``import superkernel`` provides it (SUPERKERNEL_TRANSPORT is passed through). "none" means an unshaped veth.
With SUPERKERNEL_OPS_TRACE=1 (passed through like every variable) the fused ops' trace lines of every rank
("[mk <op> rank R call N] ... chunks=C ...": the chunk count each call used) are printed after the table.
This is a benchmark: it prints numbers and asserts nothing.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from report import format_size  # noqa: E402


def _load_harness() -> Any:
    """tests/netns/hosts.py, loaded by path (this file is itself named netns.py)."""
    path = HERE.parent / "tests" / "netns" / "hosts.py"
    spec = importlib.util.spec_from_file_location("superkernel_netns_hosts", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load the two-host harness from {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


hosts_mod = _load_harness()
TwoHosts, run_torch_job, unavailable_reason = hosts_mod.TwoHosts, hosts_mod.run_torch_job, hosts_mod.unavailable_reason

DEFAULT_ARGS = ["--max-bytes", "16M", "--factor", "4", "--time", "0.2"]


# the benchmarks this runs on the two hosts, and the prefix of the JSON each writes
SCRIPTS = {"collectives.py": "collectives", "fused_ops.py": "fused", "op_entry.py": "op-entry",
           "carry_room.py": "carry-room", "gather_paths.py": "gather-paths",
           "exchange_channel.py": "exchange-channel"}

SETTLE_MS = 10.0
FUSED_BLOCKS = 4


def run_rate(rate: str | None, nproc: int, bench_args: list[str], out_dir: Path, timeout: float,
             script: str = "collectives.py") -> Path | None:
    label = rate or "none"
    tag = f"netns-{label}-2x{nproc}"
    desc = f"2 netns hosts x {nproc}, veth {'tbf ' + rate if rate else 'unshaped'}"
    args = [*bench_args, "--out-dir", str(out_dir), "--tag", tag, "--hosts-desc", desc]
    if script == "collectives.py":
        args += ["--backends", "mk,gloo"]
    if script == "fused_ops.py" and rate and "--settle-ms" not in bench_args:
        # the tbf bucket (4 ms of traffic, tests/netns/hosts.py) refills before every timed call, so the
        # fused op, the unfused one and the communication alone all start from a full bucket
        args += ["--settle-ms", str(SETTLE_MS)]
    if script == "fused_ops.py" and "--machine-cpu" not in bench_args:
        args += ["--machine-cpu"]  # the two "hosts" share this machine's cores: what does communication cost them
    if script == "fused_ops.py" and "--blocks" not in bench_args:
        # the product's speed on this VM drifted by a third within minutes: the speedup pass and the bounds
        # pass alternate in blocks so the drift hits fused and ideal alike, and each row shows its size
        args += ["--blocks", str(FUSED_BLOCKS)]
    print(f"\n######## {desc}", flush=True)
    with TwoHosts(rate=rate) as hosts:
        results = run_torch_job(hosts, str(HERE / script), args, nproc_per_host=nproc, timeout=timeout)
    head = results[0]
    print(head.stdout, end="", flush=True)
    if os.environ.get("SUPERKERNEL_OPS_TRACE") == "1":
        for r in results:
            print("".join(line + "\n" for line in r.stderr.splitlines() if line.startswith("[mk ")), end="")
    if any(r.timed_out or r.returncode != 0 for r in results):
        for r in results:
            print(r.describe(), file=sys.stderr)
        print(f"######## {desc}: FAILED (see stderr)", flush=True)
        return None
    return out_dir / f"{SCRIPTS[script]}-{tag}.json"


def summary(paths: dict[str, Path]) -> str:
    """Per rate: 8-byte allreduce latency and largest-size allreduce bus bandwidth of each backend."""
    lines = ["", "# summary: allreduce between the two namespace hosts",
             f"{'link':>8} | {'backend':>7} | {'lat 8 B (us)':>12} | {'largest':>9} | {'busbw (GB/s)':>12} | "
             f"{'busbw Gbit/s':>12}"]
    for label, path in paths.items():
        doc: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
        rows = [r for r in doc["results"] if r["op"] == "allreduce"]
        for backend in sorted({r["backend"] for r in rows}):
            mine = sorted((r for r in rows if r["backend"] == backend), key=lambda r: r["bytes"])
            small, big = mine[0], mine[-1]
            lines.append(f"{label:>8} | {backend:>7} | {small['lat_us']:>12.1f} | {format_size(big['bytes']):>9} | "
                         f"{big['busbw_GBps']:>12.3f} | {big['busbw_GBps'] * 8:>7.2f}")
        for b, info in doc["meta"]["backends"].items():
            if not info["available"] and b != "mpi":
                lines.append(f"{label:>8} | {b:>7} | unavailable: {info['reason']}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", default="1gbit,10gbit", help="comma-separated tbf rates; 'none' = unshaped")
    parser.add_argument("--nproc-per-host", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per rate before the job is killed")
    parser.add_argument("--out-dir", default=str(HERE / "results"))
    parser.add_argument("--script", default="collectives.py", choices=list(SCRIPTS),
                        help="benchmark to run on the two hosts (fused_ops.py: fused ops vs unfused; op_entry.py: "
                             "the fused ops' fixed cost per call, with --carry with and without carrying; "
                             "carry_room.py: what a large carried call costs the small ones after it; gather_paths.py: "
                             "allgather_gemm's paths against unfused and its parts; no summary)")
    parser.add_argument("bench_args", nargs="*", help="options for bench/collectives.py (after --); default: "
                        + " ".join(DEFAULT_ARGS))
    args = parser.parse_args()
    reason = unavailable_reason()
    if reason:
        print(f"bench/netns.py: cannot make two hosts: {reason}", file=sys.stderr)
        return 2
    bench_args = args.bench_args or (DEFAULT_ARGS if args.script == "collectives.py" else [])
    out_dir = Path(args.out_dir)
    done: dict[str, Path] = {}
    for rate in [r.strip() for r in args.rates.split(",") if r.strip()]:
        path = run_rate(None if rate == "none" else rate, args.nproc_per_host, bench_args, out_dir, args.timeout,
                        args.script)
        if path is not None:
            done[rate] = path
    if done and args.script == "collectives.py":
        print(summary(done), flush=True)
    return 0 if len(done) == len([r for r in args.rates.split(",") if r.strip()]) else 1


if __name__ == "__main__":
    sys.exit(main())
