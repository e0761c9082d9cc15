"""``superkernel probe``: measure what the hardware offers between ranks.

    superkernel probe [--ranks N]      start a local pool of N ranks (torchrun --standalone) and probe it
    torchrun --nproc-per-node 4 -m superkernel.probe      probe inside an existing job
    mpirun -np 4 python -m superkernel.probe              (also srun; the launcher is detected)

Run inside a torchrun/mpirun/srun job (RANK/WORLD_SIZE, OMPI_COMM_WORLD_RANK, SLURM_PROCID in the
environment), ``superkernel probe`` runs in place instead of starting a pool. Rank 0 prints the hardware
section, OSU-style tables, the verdict, and writes the plot (PNG) and optionally the JSON report.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from typing import TYPE_CHECKING

from superkernel.byte_sizes import parse_bytes

if TYPE_CHECKING:
    from superkernel.probe.run import ProbeOptions


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ranks", type=int, default=2, help="ranks of the local pool (default 2; ignored inside a job)")
    p.add_argument("--quick", action="store_true", help="messages up to 1 MiB, shorter timing")
    p.add_argument("--max-bytes", default=None, help="largest message, e.g. 4M (default 4M, quick 1M)")
    p.add_argument("--time", type=float, default=None, help="seconds of timed iterations per point (default 0.02)")
    p.add_argument("--plot", default="superkernel-probe.png", help="PNG path (default ./superkernel-probe.png; "
                   "'' for none)")
    p.add_argument("--json", default="", help="also write the report as JSON to this path")
    p.add_argument("--no-tables", action="store_true", help="only the hardware section and the verdict")
    p.add_argument("--no-one-sided", action="store_true", help="skip the one-sided (Window) measurements")
    p.add_argument("--transport", choices=["auto", "shm", "tcp"], default=None,
                   help="force mk's provider between ranks of one host (SUPERKERNEL_TRANSPORT)")
    p.add_argument("--backend", default="mk", help="torch.distributed backend to probe (default mk)")


def probe_options(args: argparse.Namespace, launcher: str) -> "ProbeOptions":
    """The probe's options from the flags ``superkernel probe`` and ``%probe`` share."""
    from superkernel.probe.run import ProbeOptions

    opts = ProbeOptions.quick() if args.quick else ProbeOptions()
    opts.launcher = launcher
    if args.max_bytes:
        opts.max_bytes = parse_bytes(args.max_bytes)
    if args.time is not None:
        opts.budget = args.time
    opts.one_sided = not args.no_one_sided
    return opts


def _forward(args: argparse.Namespace) -> list[str]:
    out = []
    if args.quick:
        out.append("--quick")
    if args.max_bytes:
        out += ["--max-bytes", args.max_bytes]
    if args.time is not None:
        out += ["--time", str(args.time)]
    out += ["--plot", os.path.abspath(args.plot) if args.plot else ""]
    if args.json:
        out += ["--json", os.path.abspath(args.json)]
    if args.no_tables:
        out.append("--no-tables")
    if args.no_one_sided:
        out.append("--no-one-sided")
    out += ["--backend", args.backend]
    return out


def run(args: argparse.Namespace) -> int:
    from superkernel.probe.job import launcher

    if args.transport:
        os.environ["SUPERKERNEL_TRANSPORT"] = args.transport
    if launcher() is not None or args.ranks <= 1:
        return run_in_job(args)
    if args.ranks < 1:
        raise SystemExit("--ranks must be at least 1")
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.pop("SUPERKERNEL_FRONTEND", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.ranks}",
           "--monitor-interval=0.1", "-m", "superkernel.probe", *_forward(args)]
    print(f"# superkernel probe: starting a local pool of {args.ranks} ranks (torchrun --standalone)", flush=True)
    return subprocess.run(cmd, env=env).returncode


def run_in_job(args: argparse.Namespace) -> int:
    import torch.distributed as dist

    from superkernel.probe import job
    from superkernel.probe.run import run_probe
    from superkernel.probe.verdict import format_report

    kind = job.join(args.backend)
    report = run_probe(None, probe_options(args, kind))
    if report is not None:
        print(format_report(report, tables=not args.no_tables), flush=True)
        if args.plot:
            from superkernel.probe.plot import plot

            print(f"# plot: {plot(report, args.plot)}", flush=True)
        if args.json:
            with open(args.json, "w", encoding="utf-8") as f:
                f.write(report.dumps() + "\n")
            print(f"# json: {args.json}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m superkernel.probe", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    args = p.parse_args(argv)
    if args.transport:
        os.environ["SUPERKERNEL_TRANSPORT"] = args.transport
    return run_in_job(args)
