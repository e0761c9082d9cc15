"""The default group made again in the same torchrun job (destroy_process_group, then init_process_group):
torchrun's agent store outlives the groups, so mk's bootstrap must not read the keys the group before it left
there (the peers' old listen addresses, shared-memory segments and job secret). It did: "rank 0 accepting
connections from peers: timed out with 0 of 2 connections" over TCP, "cannot open peer 1's segment ... No such
file" over shared memory."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.transport.world import HERE, free_port

CASES = [("tcp", 2), ("shm", 2), ("shm", 3)]


@pytest.mark.parametrize("transport,world", CASES, ids=[f"{t}-{w}ranks" for t, w in CASES])
def test_the_default_group_made_again(transport: str, world: int) -> None:
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world), "--master-port",
            str(free_port()), str(HERE / "reinit_world.py"), "--backend", "mk"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SUPERKERNEL_TRANSPORT": transport}
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=180, check=False)
    reports = [json.loads(line[len("REPORT "):]) for line in proc.stdout.splitlines() if line.startswith("REPORT ")]
    assert len(reports) == world, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    total = world * (world + 1) / 2
    for rep in reports:
        assert rep["rounds"] == [{"all_reduce": [total], "gemm_allreduce": [8 * total]}] * 3, rep["rounds"]
