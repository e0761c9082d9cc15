"""The MPI flavour: an mpirun pool (Open MPI + mpi4py), its namespace, a dead rank, restart and clean shutdown."""
from __future__ import annotations

import os
import re
import shutil
import signal
import time

import psutil
import pytest

from conftest import KernelSession

pytestmark = pytest.mark.skipif(shutil.which("mpirun") is None, reason="Open MPI's mpirun is not installed")


def mpi_processes(before: set[int]) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter(["cmdline", "name"]):
        if p.pid in before:
            continue
        cmd = " ".join(p.info["cmdline"] or [])
        if "superkernel.worker" in cmd:  # the workers and the mpirun that launched them
            out.append(p)
    return out


def test_mpi_pool(kernel_prefix):
    before = {p.pid for p in psutil.process_iter()}
    k = KernelSession("sk-test-mpi-2")
    try:
        r = k.ok("print(type(comm).__name__, size)\ncomm.allreduce(rank + 1, op=MPI.SUM)", timeout=120)
        assert "[ranks 0,1] Intracomm 2" in r.stream()
        assert r.result == "[ranks 0,1] 3"
        text = k.ok("import os\nos.getpid()").result or ""
        pids = {int(a): int(b) for a, b in re.findall(r"\[rank (\d+)\] (\d+)", text)}
        msg_id = k.execute("import time\ntime.sleep(60)")
        time.sleep(1.0)
        t0 = time.monotonic()
        os.kill(pids[1], signal.SIGKILL)
        r = k.collect(msg_id, timeout=30, t0=t0)
        assert r.status == "error" and r.elapsed < 3.0, r.elapsed
        assert r.reply["evalue"].startswith(f"rank 1 (pid {pids[1]}") and "SIGKILL" in r.reply["evalue"]
        r = k.ok("%restart\nrank", timeout=120)
        assert r.result == "[rank 0] 0\n[rank 1] 1"
    finally:
        k.shutdown()
    deadline = time.monotonic() + 10
    while mpi_processes(before) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not mpi_processes(before), [p.info["cmdline"] for p in mpi_processes(before)]
