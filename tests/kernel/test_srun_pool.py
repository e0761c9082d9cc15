"""The srun launcher against a real (private, one-node) Slurm cluster: the kernel's pool is one Slurm job
step, cells run on every rank with the mk backend, a rank SIGKILLed mid-cell is reported at once with rank
and signal, %restart brings a new step, and shutdown leaves no rank and no job behind."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from typing import Iterator

import psutil
import pytest

from conftest import KernelSession
from slurm_cluster import SlurmCluster, unavailable_reason
from superkernel import install

REASON = unavailable_reason()


@pytest.fixture(scope="module")
def slurm() -> Iterator[SlurmCluster]:
    with SlurmCluster() as cluster:
        yield cluster


def _pids(k: KernelSession) -> dict[int, int]:
    text = k.ok("import os\nos.getpid()").result or ""
    return {int(r): int(p) for r, p in re.findall(r"\[rank (\d+)\] (\d+)", text)}


@pytest.mark.skipif(REASON is not None, reason=f"no Slurm here: {REASON}")
def test_srun_pool(slurm: SlurmCluster, kernel_prefix: str) -> None:
    install.install("torch", "sk-test-srun", 2, prefix=kernel_prefix, launcher="srun")
    k = KernelSession("sk-test-srun", env={**slurm.env, "SUPERKERNEL_INTERRUPT_GRACE": "1.5"})
    pids: dict[int, int] = {}
    new: dict[int, int] = {}
    try:
        r = k.ok("import os\nprint(os.environ['SLURM_JOB_ID'], os.environ['SLURM_NTASKS'], world_size)", timeout=180)
        m = re.fullmatch(r"\[ranks 0,1\] (\d+) 2 2\n", r.stream())
        assert m, r.stream()  # both ranks in the same Slurm job
        job = m.group(1)
        squeue = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], env={**os.environ, **slurm.env},
                                capture_output=True, text=True)
        assert squeue.stdout.strip() == "RUNNING", (squeue.stdout, squeue.stderr)
        r = k.ok("t = torch.arange(4.) + rank\ndist.all_reduce(t)\nprint(t.tolist(), dist.get_backend())")
        assert "[ranks 0,1] [1.0, 3.0, 5.0, 7.0] mk" in r.stream(), r.stream()
        pids = _pids(k)
        msg_id = k.execute("import time\nprint('working')\ntime.sleep(60)")
        time.sleep(1.0)
        t0 = time.monotonic()
        os.kill(pids[1], signal.SIGKILL)
        r = k.collect(msg_id, timeout=30, t0=t0)
        assert r.elapsed < 3.0, r.elapsed
        assert r.status == "error" and r.reply["ename"] == "RankDied", r.reply
        assert f"rank 1 (pid {pids[1]}" in r.reply["evalue"] and "SIGKILL" in r.reply["evalue"], r.reply["evalue"]
        r = k.ok("%restart", timeout=120)
        assert "pool restarted: 2 ranks" in r.stream()
        new = _pids(k)
        assert len(new) == 2 and not set(new.values()) & set(pids.values())
    finally:
        tree = k.process_tree()
        k.shutdown()
        psutil.wait_procs([p for p in tree if p.is_running()], timeout=15)
    left = [p for p in tree if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not left, [p.cmdline() for p in left]
    deadline = time.monotonic() + 15
    while True:
        q = subprocess.run(["squeue", "-h", "-o", "%i %T"], env={**os.environ, **slurm.env}, capture_output=True,
                           text=True)
        if not q.stdout.strip() or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    assert not q.stdout.strip(), f"Slurm jobs left after shutdown: {q.stdout}"
    for pid in list(pids.values()) + list(new.values()):
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, pid
