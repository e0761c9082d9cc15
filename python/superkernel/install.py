"""Kernelspecs "SuperKernel (torch)" and "SuperKernel (MPI)" (``superkernel install`` / ``python -m superkernel.install``).

The kernelspec starts ``python -m superkernel.kernel`` with ``SUPERKERNEL_FRONTEND=1`` (the kernel process
never imports torch) and the pool settings in its environment. Interrupts are sent as messages
(``interrupt_mode: message``) so they reach the ranks even while the kernel waits on them.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from typing import Any

from jupyter_client.kernelspec import KernelSpecManager

FLAVORS = {
    "torch": ("superkernel", "SuperKernel (torch)"),
    "mpi": ("superkernel-mpi", "SuperKernel (MPI)"),
}


def kernel_json(flavor: str, ranks: int | None, display_name: str, backend: str | None = None,
                python: str | None = None, launcher_args: str | None = None,
                bind: str | None = None, launcher: str | None = None) -> dict[str, Any]:
    env = {"SUPERKERNEL_FRONTEND": "1", "SUPERKERNEL_FLAVOR": flavor}
    if launcher:
        env["SUPERKERNEL_LAUNCHER"] = launcher
    if launcher_args:
        env["SUPERKERNEL_LAUNCHER_ARGS"] = launcher_args
    if bind:
        env["SUPERKERNEL_BIND"] = bind
    if ranks:
        env["SUPERKERNEL_RANKS"] = str(ranks)
    if backend:
        env["SUPERKERNEL_BACKEND"] = backend
    return {
        "argv": [python or sys.executable, "-m", "superkernel.kernel", "-f", "{connection_file}"],
        "display_name": display_name,
        "language": "python",
        "interrupt_mode": "message",
        "env": env,
        "metadata": {"debugger": False, "superkernel": {"flavor": flavor, "ranks": ranks}},
    }


def install(flavor: str = "torch", name: str | None = None, ranks: int | None = None, *, user: bool = False,
            prefix: str | None = None, display_name: str | None = None, backend: str | None = None,
            launcher_args: str | None = None, bind: str | None = None, launcher: str | None = None) -> str:
    """Write one kernelspec; returns the directory it was installed to."""
    if flavor not in FLAVORS:
        raise ValueError(f"unknown flavor {flavor!r} (torch|mpi)")
    default_name, default_display = FLAVORS[flavor]
    name = name or default_name
    display = display_name or (default_display if ranks is None else f"{default_display}, {ranks} ranks")
    with tempfile.TemporaryDirectory() as td:
        with open(os.path.join(td, "kernel.json"), "w") as f:
            json.dump(kernel_json(flavor, ranks, display, backend, launcher_args=launcher_args, bind=bind,
                                  launcher=launcher), f,
                      indent=1)
        return KernelSpecManager().install_kernel_spec(td, name, user=user, prefix=prefix)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--name", help="kernelspec name (default: superkernel / superkernel-mpi)")
    p.add_argument("--display-name", help="name shown in Jupyter")
    p.add_argument("--ranks", type=int, default=None, help="ranks in the pool (default: one per GPU, else 2)")
    p.add_argument("--flavor", choices=sorted(FLAVORS) + ["both"], default="both",
                   help="torch (torchrun pool), mpi (mpirun pool) or both (default)")
    p.add_argument("--backend", default=None, help="torch.distributed backend for the ranks (default: mk, else gloo)")
    p.add_argument("--launcher", choices=["torchrun", "srun"], default=None,
                   help="how the torch flavour starts its ranks: torchrun (default) or srun (in or for a Slurm job)")
    p.add_argument("--launcher-args", default=None,
                   help="extra torchrun/mpirun arguments, e.g. \"--nnodes=2 --rdzv-backend=c10d "
                        "--rdzv-endpoint=HOST:29400\" for a pool spanning hosts (then `superkernel join` on the others)")
    p.add_argument("--bind", default=None,
                   help="address the kernel's rank channels listen on (default 127.0.0.1; a pool spanning hosts "
                        "needs one the other hosts reach)")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--user", action="store_true", help="install for the current user")
    where.add_argument("--sys-prefix", action="store_true", help="install into sys.prefix (e.g. the virtualenv)")
    where.add_argument("--prefix", help="install under PREFIX/share/jupyter/kernels")


def run(args: argparse.Namespace) -> int:
    prefix = sys.prefix if args.sys_prefix else args.prefix
    flavors = ["torch", "mpi"] if args.flavor == "both" else [args.flavor]
    if args.name and len(flavors) > 1:
        print("--name needs --flavor torch or --flavor mpi", file=sys.stderr)
        return 2
    for flavor in flavors:
        path = install(flavor, args.name, args.ranks, user=args.user, prefix=prefix,
                       display_name=args.display_name, backend=args.backend,
                       launcher_args=args.launcher_args, bind=args.bind,
                       launcher=args.launcher if flavor == "torch" else None)
        print(f"Installed kernelspec {os.path.basename(path)} ({flavor}) in {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m superkernel.install", description="Install SuperKernel kernelspecs")
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
