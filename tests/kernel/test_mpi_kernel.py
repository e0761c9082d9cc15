"""The MPI flavour: an mpirun pool (Open MPI + mpi4py), its namespace, a dead rank, restart and clean shutdown."""
from __future__ import annotations

import os
import re
import shutil
import signal
import stat
import sys
import threading
import time

import psutil
import pytest

from conftest import KernelSession
from superkernel.pool import Death, Pool, PoolSpec
from superkernel.protocol import Event

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
        assert r.status == "error" and r.elapsed < 4.0, r.elapsed  # (mpirun reports after 1-2 s)
        assert r.reply["evalue"].startswith(f"rank 1 (pid {pids[1]}") and "SIGKILL" in r.reply["evalue"]
        r = k.ok("%restart\nrank", timeout=120)
        assert r.result == "[rank 0] 0\n[rank 1] 1"
    finally:
        k.shutdown()
    deadline = time.monotonic() + 10
    while mpi_processes(before) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not mpi_processes(before), [p.info["cmdline"] for p in mpi_processes(before)]


class Deaths:
    """A pool listener that only records deaths."""

    def __init__(self) -> None:
        self.deaths: list[Death] = []
        self.reported = threading.Event()

    def on_event(self, event: Event) -> None:
        pass

    def on_death(self, deaths: list[Death]) -> None:
        self.deaths.extend(deaths)
        self.reported.set()

    def on_tick(self) -> None:
        pass


# mpirun, but every line naming a dead rank's signal comes 0.5 s late, as on a loaded machine: Open MPI
# prints it after its 1 s odls_base_sigkill_timeout (1.0 s after the kill, sometimes 2.0 s), so it now
# lands 1.5-2.5 s after the kill
SLOW_MPIRUN = """#!/bin/sh
{real} "$@" 2>&1 | {python} -u -c '
import sys, time
for line in sys.stdin:
    if "exited on signal" in line:
        time.sleep(0.5)
    sys.stdout.write(line)
    sys.stdout.flush()
'
"""


def test_late_mpirun_report_still_names_the_signal(tmp_path, monkeypatch):
    """A rank killed under mpirun is reported with its signal even when mpirun's line naming it comes after
    the first 1.2 s (its "the job has been aborted" block arrived at once; the kernel waits for the rest)."""
    real = shutil.which("mpirun")
    wrapper = tmp_path / "mpirun"
    wrapper.write_text(SLOW_MPIRUN.format(real=real, python=sys.executable))
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    listener = Deaths()
    pool = Pool(PoolSpec(flavor="mpi", nranks=2), listener)
    try:
        pool.start()
        pool.wait_ready(timeout=120)
        victim = pool.ranks[1].pid
        t0 = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        assert listener.reported.wait(10), "no death reported"
        elapsed = time.monotonic() - t0
        first = listener.deaths[0]
        assert first.rank == 1 and first.pid == victim, [d.describe() for d in listener.deaths]
        assert "SIGKILL" in first.describe(), f"{first.describe()}\nlauncher:\n{pool.launcher_tail()}"
        assert 1.3 < elapsed < 3.5, elapsed  # it did wait for the late line, and not much longer
    finally:
        pool.close()
