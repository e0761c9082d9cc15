"""Which job this process runs in (torchrun, mpirun, srun, or none), and joining it with torch.distributed.

Follows the launchers' own environment conventions: torchrun's RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/PORT;
Open MPI's OMPI_COMM_WORLD_* (or PMI_RANK/PMI_SIZE of MPICH/Hydra), with MASTER_ADDR/PORT for torch's
store agreed through MPI_COMM_WORLD; Slurm's SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID inside an ``srun`` step,
with MASTER_ADDR the first host of the step (``scontrol show hostnames``) and MASTER_PORT derived from
the job id unless set.
"""
from __future__ import annotations

import datetime as _dt
import os
import shutil
import socket
import subprocess


def launcher() -> str | None:
    """'torchrun', 'mpirun', 'srun' when this process is one rank of such a job, else None."""
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return "torchrun"
    if "OMPI_COMM_WORLD_RANK" in env or ("PMI_RANK" in env and "PMI_SIZE" in env):
        return "mpirun"
    if "SLURM_PROCID" in env and "SLURM_STEP_ID" in env and int(env.get("SLURM_NTASKS", "1")) >= 1:
        return "srun"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        return int(s.getsockname()[1])


def _mpi_environment() -> None:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    env = os.environ
    hosts = comm.allgather(socket.gethostname())
    chosen = None
    if comm.Get_rank() == 0:
        addr = env.get("MASTER_ADDR") or ("127.0.0.1" if len(set(hosts)) == 1
                                          else socket.gethostbyname(socket.gethostname()))
        chosen = (addr, env.get("MASTER_PORT") or str(_free_port()))
    addr, port = comm.bcast(chosen, root=0)
    me = socket.gethostname()
    env.update(RANK=str(comm.Get_rank()), WORLD_SIZE=str(comm.Get_size()), MASTER_ADDR=addr, MASTER_PORT=port,
               LOCAL_RANK=env.get("OMPI_COMM_WORLD_LOCAL_RANK", str(hosts[:comm.Get_rank()].count(me))),
               LOCAL_WORLD_SIZE=env.get("OMPI_COMM_WORLD_LOCAL_SIZE", str(hosts.count(me))))


def _slurm_environment() -> None:
    env = os.environ
    if "MASTER_ADDR" not in env:
        nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST", "")
        first = ""
        if shutil.which("scontrol") and nodes:
            out = subprocess.run(["scontrol", "show", "hostnames", nodes], capture_output=True, text=True,
                                 timeout=30)
            first = out.stdout.split()[0] if out.returncode == 0 and out.stdout.split() else ""
        if not first:
            raise RuntimeError("superkernel probe under srun: set MASTER_ADDR (scontrol could not expand "
                               f"the node list {nodes!r})")
        env["MASTER_ADDR"] = first
    env.setdefault("MASTER_PORT", str(20000 + int(env.get("SLURM_JOB_ID", "0")) % 20000))
    env.update(RANK=env["SLURM_PROCID"], WORLD_SIZE=env.get("SLURM_NTASKS", "1"),
               LOCAL_RANK=env.get("SLURM_LOCALID", "0"))


def join(backend: str = "mk", timeout: float = 300.0) -> str:
    """Initialise torch.distributed's default group for the job this process runs in; returns the launcher."""
    import torch.distributed as dist

    import superkernel  # noqa: F401  (registers mk)

    kind = launcher()
    if kind == "mpirun":
        _mpi_environment()
    elif kind == "srun":
        _slurm_environment()
    elif kind is None:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(_free_port()))
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=_dt.timedelta(seconds=timeout))
    return kind or "single process"
