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

from tests.netns.hosts import TwoHosts, run_mpi_job, unavailable_reason
from tests.ops.ops_world import HERE
from tests.transport.world import RankResult

pytestmark = pytest.mark.skipif(shutil.which("mpirun") is None, reason="Open MPI's mpirun is not installed")
NETNS_REASON = unavailable_reason()

# (suite, its arguments, the ops its calls trace)
SUITES = [("gemm_suite.py", ["--errors"], ("allgather_gemm", "gemm_allreduce", "gemm_reducescatter")),
          ("moe_suite.py", [], ("moe_dispatch_gemm", "moe_combine")),
          ("attention_suite.py", [], ("ring_attention",))]


def _check_job(proc_rc: int | None, proc_out: str, proc_err: str, out: Path, suite: str, ops: tuple[str, ...],
               carried_only: bool) -> None:
    """The ranks' logs (``--output-filename out``): both ranks ran the suite without a failure, on mk, with
    the same bytes; the GEMM suite over shared memory wrote its products in place, across a link it carried
    small arguments inside the agreement (``carried_only``)."""
    logs = {int(d.name.split(".")[1]): ((d / "stdout").read_text(), (d / "stderr").read_text())
            for d in sorted(out.glob("*/rank.*"))}
    assert proc_rc == 0, (proc_rc, proc_out[-2000:], proc_err[-2000:], {r: e[-2000:] for r, (_, e) in logs.items()})
    assert sorted(logs) == [0, 1], sorted(logs)
    reps = [RankResult(r, proc_rc, *logs[r]).report() for r in (0, 1)]
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
            assert (in_place, carried) == ((False, True) if carried_only else (True, False)), err[-2000:]


def _rank_env() -> dict[str, str]:
    # (no torchrun variables, or mpi_launch.py would take them for a torchrun launch; and the ranks load the
    # backend whatever this process set for kernels, as tests/transport/world.py's ranks do)
    return {k: v for k, v in os.environ.items()
            if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_")) and k != "SUPERKERNEL_FRONTEND"}


@pytest.mark.parametrize("transport", ["auto", "tcp"])
@pytest.mark.parametrize("suite,args,ops", SUITES, ids=[s.split("_")[0] for s, _, _ in SUITES])
def test_fused_ops_under_mpirun(tmp_path: Path, suite: str, args: list[str], ops: tuple[str, ...],
                                transport: str) -> None:
    out = tmp_path / "out"
    argv = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2", "--output-filename", str(out),
            "-x", f"SUPERKERNEL_TRANSPORT={transport}", "-x", "SUPERKERNEL_OPS_TRACE=1", "-x", "OMP_NUM_THREADS=1",
            sys.executable, str(HERE / "mpi_launch.py"), str(HERE / suite), *args]
    proc = subprocess.run(argv, env=_rank_env(), capture_output=True, text=True, timeout=300, check=False)
    _check_job(proc.returncode, proc.stdout, proc.stderr, out, suite, ops, carried_only=transport == "tcp")


@pytest.mark.skipif(NETNS_REASON is not None, reason=f"two namespace hosts: {NETNS_REASON}")
@pytest.mark.parametrize("suite,args,ops", SUITES, ids=[s.split("_")[0] for s, _, _ in SUITES])
def test_fused_ops_under_mpirun_between_hosts(tmp_path: Path, suite: str, args: list[str],
                                              ops: tuple[str, ...]) -> None:
    """One rank in each of two network-namespace hosts, started as a user starts a multi-host Open MPI job:
    mpirun in host a, host b's daemon through an rsh agent (ssh's place), Open MPI on the veth, torch's store
    at host a's address; mk reaches the other rank over tcp."""
    out = tmp_path / "out"
    with TwoHosts(rate="1gbit") as hosts:
        res = run_mpi_job(hosts, [sys.executable, str(HERE / "mpi_launch.py"), str(HERE / suite), *args], tmp_path,
                          timeout=300, env={"SUPERKERNEL_OPS_TRACE": "1", "OMP_NUM_THREADS": "1"},
                          mpirun_args=["--output-filename", str(out)])
    assert not res.timed_out, res.describe()
    _check_job(res.returncode, res.stdout, res.stderr, out, suite, ops, carried_only=True)
