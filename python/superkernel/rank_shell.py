"""The IPython shell each rank runs cells in: ipykernel's ZMQInteractiveShell, errors kept for the reply.

Streams, displays and results already travel through ipykernel's machinery (``OutStream``, the ZMQ
display hook and display publisher, all pointed at the worker's signed PUSH socket). The only change is
that a traceback is recorded for the ``execute_reply`` instead of being published as its own ``error``
message: the kernel groups every rank's traceback into one ``error`` per cell.
"""
from __future__ import annotations

import sys
from typing import Any

from ipykernel.zmqshell import ZMQInteractiveShell
from traitlets import Any as AnyTrait
from traitlets.config import Config


class RankShell(ZMQInteractiveShell):
    worker = AnyTrait()

    def __init__(self, **kwargs: Any) -> None:
        config = kwargs.pop("config", None) or Config()
        # several ranks share one home directory: keep history in memory, not in one sqlite file
        config.HistoryManager.hist_file = ":memory:"
        super().__init__(config=config, **kwargs)
        self.last_error: dict[str, Any] | None = None

    def _showtraceback(self, etype: type, evalue: BaseException, stb: list[str]) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        self.last_error = {"ename": etype.__name__, "evalue": str(evalue), "traceback": list(stb)}
        self._last_traceback = stb

    def enable_gui(self, gui: Any = None) -> None:
        # no GUI event loops on a rank; "%matplotlib inline" needs none
        if gui not in (None, "inline"):
            print(f"GUI event loop {gui!r} is not available on a rank; using inline", file=sys.stderr)
        self.active_eventloop = None
