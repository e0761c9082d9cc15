"""The fused ops in an Open MPI job: mpirun starts the ranks, mpi4py initialises MPI in each, torch's store
address is agreed over MPI_COMM_WORLD (tests/ops/mpi_launch.py), and torch.distributed runs on mk beside MPI.
The rank suites of tests/ops/test_gemm_ops.py, test_moe.py and test_ring_attention.py, against their float64
references (attention also against SDPA), with the cross-rank mismatch errors."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.ops.ops_world import HERE
from tests.transport.world import RankResult

pytestmark = pytest.mark.skipif(shutil.which("mpirun") is None, reason="Open MPI's mpirun is not installed")

# (suite, its arguments, the ops its calls trace)
SUITES = [("gemm_suite.py", ["--errors"], ("allgather_gemm", "gemm_allreduce", "gemm_reducescatter")),
          ("moe_suite.py", [], ("moe_dispatch_gemm", "moe_combine")),
          ("attention_suite.py", [], ("ring_attention",))]


@pytest.mark.parametrize("transport", ["auto", "tcp"])
@pytest.mark.parametrize("suite,args,ops", SUITES, ids=[s.split("_")[0] for s, _, _ in SUITES])
def test_fused_ops_under_mpirun(tmp_path: Path, suite: str, args: list[str], ops: tuple[str, ...],
                                transport: str) -> None:
    out = tmp_path / "out"
    # (no torchrun variables, or mpi_launch.py would take them for a torchrun launch; and the ranks load the
    # backend whatever this process set for kernels, as tests/transport/world.py's ranks do)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_")) and k != "SUPERKERNEL_FRONTEND"}
    argv = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2", "--output-filename", str(out),
            "-x", f"SUPERKERNEL_TRANSPORT={transport}", "-x", "SUPERKERNEL_OPS_TRACE=1", "-x", "OMP_NUM_THREADS=1",
            sys.executable, str(HERE / "mpi_launch.py"), str(HERE / suite), *args]
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300, check=False)
    logs = {int(d.name.split(".")[1]): ((d / "stdout").read_text(), (d / "stderr").read_text())
            for d in sorted(out.glob("*/rank.*"))}
    assert proc.returncode == 0, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:],
                                  {r: e[-2000:] for r, (_, e) in logs.items()})
    assert sorted(logs) == [0, 1], sorted(logs)
    reps = [RankResult(r, proc.returncode, *logs[r]).report() for r in (0, 1)]
    for rep in reps:
        assert rep["rank"] in (0, 1), rep
        failed = {family: problems[:5] for family, problems in rep["failures"].items() if problems}
        assert not failed, (rep["rank"], failed)
    if "digests" in reps[0]:  # (the same bytes on every rank)
        assert reps[0]["digests"] and reps[0]["digests"] == reps[1]["digests"]
    for r, (_, err) in logs.items():  # the ops ran on mk
        for op in ops:
            assert f"[mk {op} rank {r} call " in err, (op, err[-2000:])
    if suite == "gemm_suite.py":
        # over the transport asked for: one host, shared memory, whose staging slots the products are written
        # into; tcp, small arguments carried inside the agreement, which only a transport across hosts does
        for r, (_, err) in logs.items():
            in_place, carried = " in place: " in err, " carried\n" in err
            assert (in_place, carried) == ((False, True) if transport == "tcp" else (True, False)), err[-2000:]
