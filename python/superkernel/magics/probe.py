"""``%probe [--quick] [--max-bytes 4M] [--no-tables] [--no-one-sided]``: measure the pool's links.

Runs :func:`superkernel.probe.run.run_probe` on every rank (collective over the default group); rank 0
prints the hardware section, OSU-style tables and the verdict, and displays the plot (PNG).
"""
from __future__ import annotations

import argparse
import os
import shlex
import tempfile

from IPython.core.magic import Magics, line_magic, magics_class


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="%probe", add_help=False, exit_on_error=False)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--max-bytes", default=None)
    p.add_argument("--time", type=float, default=None)
    p.add_argument("--no-tables", action="store_true")
    p.add_argument("--no-one-sided", action="store_true")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--json", default="")
    return p


@magics_class
class ProbeMagics(Magics):
    @line_magic
    def probe(self, line: str) -> None:
        """Detect GPUs/RDMA/CXL/NUMA and measure latency and bandwidth per provider, one-sided put/get and
        allreduce between the ranks; rank 0 prints the tables and the verdict and shows the plot."""
        ns = self.shell.user_ns
        d = ns.get("dist")
        if d is None or not d.is_initialized():
            print("%probe needs torch.distributed (the torch flavour of the kernel); from a shell: superkernel probe")
            return
        try:
            args = _parser().parse_args(shlex.split(line))
        except (argparse.ArgumentError, SystemExit) as e:
            raise ValueError(f"%probe: {e or 'usage: %probe [--quick] [--max-bytes 4M] [--no-tables]'}") from e
        from superkernel.probe.command import probe_options
        from superkernel.probe.run import run_probe
        from superkernel.probe.verdict import format_report

        report = run_probe(None, probe_options(args, "superkernel pool"))
        if report is None:
            return
        ns["probe_report"] = report
        print(format_report(report, tables=not args.no_tables), flush=True)
        if args.json:
            with open(args.json, "w", encoding="utf-8") as f:
                f.write(report.dumps() + "\n")
        if not args.no_plot:
            from IPython.display import Image, display

            from superkernel.probe.plot import plot

            fd, path = tempfile.mkstemp(prefix="superkernel-probe-", suffix=".png")
            os.close(fd)
            try:
                plot(report, path)
                display(Image(filename=path))
            finally:
                os.unlink(path)
