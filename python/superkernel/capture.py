"""fd-level output capture for a rank: ipykernel's OutStream (watchfd) plus a sync point.

``OutStream(watchfd=...)`` swaps fd 1/2 for pipes and a watcher thread forwards what arrives. A cell's
reply must not overtake output its subprocesses or C code wrote to the fd just before the cell ended, so
:meth:`RankOutStream.sync` writes a marker into the fd and waits until the watcher has forwarded it: the
pipe is FIFO, so everything written before the marker is then in the stream's buffer.
"""
from __future__ import annotations

import os
import threading
from typing import Any

from ipykernel.iostream import OutStream

from superkernel.protocol import SYNC


class RankOutStream(OutStream):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._synced = threading.Event()
        self._carry = ""
        super().__init__(*args, **kwargs)

    def write(self, string: str) -> int | None:  # type: ignore[override]
        if self._carry or "\x00" in string:
            string, self._carry = self._carry + string, ""
            if SYNC in string:
                string = string.replace(SYNC, "")
                self._synced.set()
            else:
                idx = string.rfind("\x00")
                if idx != -1 and SYNC.startswith(string[idx:]):
                    string, self._carry = string[:idx], string[idx:]  # a marker split across two reads
        if not string:
            return 0
        return super().write(string)

    def start_sync(self) -> bool:
        """Write the marker; :meth:`wait_sync` then waits for it. False when there is no fd to watch."""
        if getattr(self, "_fid", None) is None:
            return False
        self._synced.clear()
        os.write(self._original_stdstream_fd, SYNC.encode())
        return True

    def wait_sync(self, timeout: float = 1.0) -> bool:
        return self._synced.wait(timeout)

    def sync(self, timeout: float = 1.0) -> bool:
        """Wait until everything written to the fd so far has reached this stream."""
        return self.wait_sync(timeout) if self.start_sync() else True
