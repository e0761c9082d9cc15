"""Registers every rank-side magic in a rank's shell."""
from __future__ import annotations

from typing import Any


def register(shell: Any) -> None:
    from superkernel.magics.barrier import BarrierMagics
    from superkernel.magics.info import InfoMagics
    from superkernel.magics.pip import PipMagics

    for cls in (InfoMagics, BarrierMagics, PipMagics):
        shell.register_magics(cls(shell))
    from superkernel.magics.memory import MemoryMagics
    from superkernel.magics.probe import ProbeMagics

    for cls in (MemoryMagics, ProbeMagics):
        shell.register_magics(cls(shell))
