"""The ``superkernel`` command. Each subcommand is one entry in SUBCOMMANDS: (help, add_arguments, run)."""
from __future__ import annotations

import argparse
import sys
from typing import Callable

from superkernel import install, join
from superkernel.probe import command as probe_command

Subcommand = tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]

SUBCOMMANDS: dict[str, Subcommand] = {
    "install": ("install the Jupyter kernelspecs", install.add_arguments, install.run),
    "join": ("start this host's ranks of a kernel's pool that spans hosts", join.add_arguments, join.run),
}
SUBCOMMANDS["probe"] = ("measure latency/bandwidth between ranks and detect RDMA/CXL/GPU links",
                        probe_command.add_arguments, probe_command.run)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="superkernel")
    sub = p.add_subparsers(dest="command", required=True)
    for name, (help_text, add_arguments, _) in SUBCOMMANDS.items():
        add_arguments(sub.add_parser(name, help=help_text))
    args = p.parse_args(argv)
    return SUBCOMMANDS[args.command][2](args)


if __name__ == "__main__":
    sys.exit(main())
