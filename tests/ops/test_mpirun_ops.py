"""The GEMM+collective ops in an Open MPI job: mpirun starts the ranks, mpi4py initialises MPI in each, torch's
store address is agreed over MPI_COMM_WORLD (tests/ops/mpi_launch.py), and torch.distributed runs on mk beside
MPI. The same rank suite as tests/ops/test_gemm_ops.py, against the float64 reference, with the cross-rank
mismatch errors."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.ops.ops_world import HERE

pytestmark = pytest.mark.skipif(shutil.which("mpirun") is None, reason="Open MPI's mpirun is not installed")

FAMILIES = ("allgather_gemm", "gemm_allreduce", "gemm_reducescatter", "empty", "grad", "errors")


def report_of(text: str, rank: int) -> dict:
    for line in reversed(text.splitlines()):
        if line.startswith("REPORT "):
            return json.loads(line[len("REPORT "):])
    raise AssertionError(f"rank {rank} printed no report:\n{text[-3000:]}")


@pytest.mark.parametrize("transport", ["auto", "tcp"])
def test_gemm_ops_under_mpirun(tmp_path: Path, transport: str) -> None:
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_"))}
    argv = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2", "--output-filename", str(out),
            "-x", f"SUPERKERNEL_TRANSPORT={transport}", "-x", "SUPERKERNEL_OPS_TRACE=1", "-x", "OMP_NUM_THREADS=1",
            sys.executable, str(HERE / "mpi_launch.py"), str(HERE / "gemm_suite.py"), "--errors"]
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300, check=False)
    ranks = sorted(out.glob("*/rank.*"))
    logs = {int(d.name.split(".")[1]): ((d / "stdout").read_text(), (d / "stderr").read_text()) for d in ranks}
    assert proc.returncode == 0, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:],
                                  {r: e[-2000:] for r, (_, e) in logs.items()})
    assert sorted(logs) == [0, 1], sorted(logs)
    reps = [report_of(logs[r][0], r) for r in (0, 1)]
    for rep in reps:
        assert rep["world"] == 2, rep["world"]
        assert not rep["failures"], {f: v[:5] for f, v in rep["failures"].items()}
        assert set(FAMILIES) <= set(rep["timings"]), rep["timings"]
    assert reps[0]["digests"] and reps[0]["digests"] == reps[1]["digests"]
    for r, (_, err) in logs.items():  # the ops ran on mk, over the transport asked for
        assert f"[mk gemm_allreduce rank {r} call " in err, err[-2000:]
        # (one host: shared memory, whose staging slots the products are written into; tcp: small arguments
        # carried inside the agreement, which only a transport across hosts does)
        in_place, carried = " in place: " in err, err.count(" carried\n") > 0
        assert (in_place, carried) == ((False, True) if transport == "tcp" else (True, False)), err[-2000:]
