"""fd-level output capture for a rank: ipykernel's OutStream (watchfd) plus a sync point.

``OutStream(watchfd=...)`` swaps fd 1/2 for pipes and a watcher thread forwards what arrives. A cell's
reply must not overtake output its subprocesses or C code wrote to the fd just before the cell ended, so
:meth:`RankOutStream.sync` writes a marker into the fd and waits until the watcher has forwarded it: the
pipe is FIFO, so everything written before the marker is then in the stream's buffer.

Most cells write nothing to the fds, and the marker's round trip through the watcher thread is a good
part of an empty cell's cost when four ranks share two cores. So the watcher here waits for the pipe to
become readable *before* it reads, and marks itself busy (under a lock) from the read until the data is
in the stream: when the pipe is empty and the watcher is not busy, nothing written earlier is in flight
and no marker is needed.
"""
from __future__ import annotations

import os
import select
import sys
import threading
from typing import Any

from ipykernel.iostream import PIPE_BUFFER_SIZE, OutStream

from superkernel.protocol import SYNC


class RankOutStream(OutStream):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._synced = threading.Event()
        self._carry = ""
        self._fd_lock = threading.Lock()
        self._fd_busy = False
        super().__init__(*args, **kwargs)

    def _watch_pipe_fd(self) -> None:
        """ipykernel's watcher loop, but: wait until readable, then read and forward while marked busy."""
        if self._fid is None:
            return
        poller = select.poll()
        poller.register(self._fid, select.POLLIN | select.POLLHUP)
        try:
            while self._should_watch:
                poller.poll()
                with self._fd_lock:
                    self._fd_busy = True
                try:
                    bts = os.read(self._fid, PIPE_BUFFER_SIZE)
                    if not bts:
                        return
                    self.write(bts.decode(errors="replace"))
                    os.write(self._original_stdstream_copy, bts)
                finally:
                    with self._fd_lock:
                        self._fd_busy = False
        except Exception:
            self._exc = sys.exc_info()

    def _fd_idle(self) -> bool:
        """Nothing written to the fd so far is still on its way to the stream buffer."""
        with self._fd_lock:
            if self._fd_busy:
                return False
            return not select.select([self._fid], [], [], 0)[0]

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
        if getattr(self, "_fid", None) is None or self._fd_idle():
            return False
        self._synced.clear()
        os.write(self._original_stdstream_fd, SYNC.encode())
        return True

    def wait_sync(self, timeout: float = 1.0) -> bool:
        return self._synced.wait(timeout)

    def sync(self, timeout: float = 1.0) -> bool:
        """Wait until everything written to the fd so far has reached this stream."""
        return self.wait_sync(timeout) if self.start_sync() else True
