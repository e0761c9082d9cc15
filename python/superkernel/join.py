"""Pools that span several hosts: the join file and ``superkernel join``.

A kernel whose torchrun arguments name several nodes (``--nnodes=2 --rdzv-endpoint=HOST:PORT``, set with
``SUPERKERNEL_LAUNCHER_ARGS``) and whose channels listen on a reachable address (``SUPERKERNEL_BIND``)
starts its own host's node and writes a *join file*: the pool's connection info (including the signing
key, so the file is created 0600 and must be copied like an ssh key), the torchrun arguments and the
number of ranks per node. On every other host, ``superkernel join FILE`` starts that host's node of the
same torchrun job; its ranks connect back to the kernel, and the cell waits until the whole world is up.

The rendezvous is torchrun's own (c10d or static); nothing here invents one.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field

from superkernel.protocol import ConnectionInfo

MULTI_NODE_FLAGS = ("--nnodes", "--rdzv-endpoint", "--rdzv_endpoint")


def spans_hosts(launcher_args: list[str]) -> bool:
    """Do these torchrun arguments describe a job of several nodes?"""
    for i, a in enumerate(launcher_args):
        name, _, value = a.partition("=")
        if name in ("--rdzv-endpoint", "--rdzv_endpoint"):
            return True
        if name == "--nnodes":
            value = value or (launcher_args[i + 1] if i + 1 < len(launcher_args) else "1")
            if value.split(":")[-1] != "1":
                return True
    return False


@dataclass
class JoinSpec:
    connection: ConnectionInfo
    launcher_args: list[str]
    nproc_per_node: int
    backend: str | None = None
    env: dict[str, str] = field(default_factory=dict)  # SUPERKERNEL_* settings the ranks need

    def write(self, path: str) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(asdict(self), f)

    @classmethod
    def read(cls, path: str) -> "JoinSpec":
        with open(path) as f:
            raw = json.load(f)
        raw["connection"] = ConnectionInfo(**raw["connection"])
        return cls(**raw)


def _override(args: list[str], flag: str, value: str) -> list[str]:
    """``args`` with ``flag`` set to ``value`` (replacing ``--flag=x`` or ``--flag x``)."""
    out: list[str] = []
    skip = False
    for a in args:
        if skip:
            skip = False
            continue
        if a == flag:
            skip = True
            continue
        if a.startswith(flag + "="):
            continue
        out.append(a)
    return [*out, f"{flag}={value}"]


def torchrun_command(spec: JoinSpec, connection_file: str, node_rank: int | None = None) -> list[str]:
    args = list(spec.launcher_args)
    if node_rank is not None:
        args = _override(args, "--node-rank", str(node_rank))
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={spec.nproc_per_node}",
            "--monitor-interval=0.1", *args, "-m", "superkernel.worker", "--connection-file", connection_file,
            "--flavor", "torch"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("join_file", help="the join file the kernel wrote (copy it from the kernel's host)")
    p.add_argument("--node-rank", type=int, default=None,
                   help="this host's node rank (only for a static rendezvous; c10d assigns it)")


def run(args: argparse.Namespace) -> int:
    spec = JoinSpec.read(args.join_file)
    with tempfile.TemporaryDirectory(prefix="superkernel-join-") as tmp:
        conn = os.path.join(tmp, "connection.json")
        spec.connection.write(conn)
        env = dict(os.environ, **spec.env)
        env["SUPERKERNEL_FRONTEND"] = "1"
        env.setdefault("PYTHONUNBUFFERED", "1")
        env.setdefault("OMP_NUM_THREADS", "1")
        if spec.backend:
            env["SUPERKERNEL_BACKEND"] = spec.backend
        cmd = torchrun_command(spec, conn, args.node_rank)
        print(f"superkernel join: starting {spec.nproc_per_node} rank(s) of the pool of "
              f"{spec.connection.kernel_host} ({spec.connection.requests})", file=sys.stderr, flush=True)
        proc = subprocess.Popen(cmd, env=env, start_new_session=True)

        def forward(signum: int, _frame: object) -> None:
            try:
                os.killpg(proc.pid, signum)
            except ProcessLookupError:
                pass

        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, forward)
        return proc.wait()
