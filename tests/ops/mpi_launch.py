"""Run a rank script of tests/ops (a *_suite.py) in an Open MPI job: torchrun's variables from Open MPI's,
with MASTER_ADDR/PORT for torch's store agreed over MPI_COMM_WORLD (bench/collectives.py's detect_launch),
then the script as __main__. mpi4py initialises MPI in every rank before torch and mk start, as in a user's
mpirun job that also uses torch.distributed on mk.

    mpirun -np 2 python tests/ops/mpi_launch.py tests/ops/gemm_suite.py [its arguments]
"""
from __future__ import annotations

import runpy
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

from collectives import detect_launch  # noqa: E402

launch = detect_launch()
if launch.launcher != "mpirun":
    sys.exit(f"mpi_launch.py: not started by mpirun (found {launch.launcher}); run it under mpirun")
script = Path(sys.argv[1]).resolve()
sys.argv = [str(script), *sys.argv[2:]]
sys.path.insert(0, str(script.parent))
runpy.run_path(str(script), run_name="__main__")
