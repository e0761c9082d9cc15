"""``python -m superkernel.probe``: one rank of a probe (under torchrun, mpirun or srun)."""
import sys

from superkernel.probe.command import main

sys.exit(main())
