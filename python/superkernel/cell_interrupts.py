"""Which cell a rank's main thread runs, and delivering the kernel's interrupt to exactly that cell.

The kernel sends a cell on the rank's shell socket and an interrupt for it on the control socket, which
another thread reads. So an interrupt can reach a rank at three moments:

* before the main thread has taken the cell off its socket: the cell's id is remembered, and the cell ends
  with ``KeyboardInterrupt`` as soon as it arrives, without running;
* while the cell runs: SIGINT to the main thread (``KeyboardInterrupt`` in Python code) and, if the rank has
  loaded ``superkernel._C``, a cancellation of every mk wait, repeated until the main thread has taken the
  signal, so a wait that began just after a cancellation cannot keep the rank in C code;
* after the cell ended (its reply is on the way to the kernel): nothing happens; the next cell is not hit.

SIGINT from elsewhere (``kill -INT`` on a rank, a launcher forwarding Ctrl-C) interrupts a running cell and is
ignored between cells.
"""
from __future__ import annotations

import collections
import signal
import sys
import threading
import time
from types import FrameType
from typing import Callable

# how long the control thread keeps cancelling mk waits for one interrupt that the main thread has not taken
CANCEL_FOR = 10.0
CANCEL_EVERY = 0.05
REMEMBERED = 16  # cell ids kept of each kind (interrupted before arriving, ended)


def _mk_cancel() -> Callable[[], None] | None:
    """The mk cancellation, if this process has loaded the extension (only then can it be inside an mk wait)."""
    ext = sys.modules.get("superkernel._C")
    return getattr(ext, "cancel_waits", None)


class CellInterrupts:
    """Owned by the worker: the main thread calls :meth:`begin` / :meth:`end` around each cell, the control
    thread calls :meth:`interrupt`."""

    def __init__(self) -> None:
        """Construct it on the main thread: that is the thread SIGINT goes to."""
        self.main_ident = threading.get_ident()
        self._lock = threading.Lock()
        self.running: str | None = None  # id of the cell the main thread runs now
        self._early: collections.deque[str] = collections.deque(maxlen=REMEMBERED)
        self._ended: collections.deque[str] = collections.deque(maxlen=REMEMBERED)
        self.taken = threading.Event()  # the main thread raised KeyboardInterrupt for the last interrupt
        self.signals_ignored = 0  # SIGINTs that arrived between cells

    def install(self) -> None:
        """Make SIGINT this object's (call from the main thread)."""
        signal.signal(signal.SIGINT, self._on_sigint)

    # -- main thread --
    def begin(self, cell: str) -> bool:
        """The main thread starts ``cell``. False when it was interrupted before it arrived: do not run it."""
        with self._lock:
            if cell in self._early:
                self._early.remove(cell)
                self._ended.append(cell)
                return False
            self.taken.clear()
            self.running = cell
            return True

    def end(self, cell: str) -> None:
        """The main thread has finished ``cell`` (idempotent); SIGINT is ignored from here on."""
        self.running = None  # first, so that a signal from now on is ignored
        with self._lock:
            if cell not in self._ended:
                self._ended.append(cell)

    def _on_sigint(self, signum: int, frame: FrameType | None) -> None:
        if self.running is None:
            self.signals_ignored += 1
            return
        self.taken.set()
        raise KeyboardInterrupt

    # -- control thread --
    def interrupt(self, cell: str | None = None) -> bool:
        """Interrupt ``cell`` (the kernel's message id of it), or whatever cell runs when None.

        Returns True when a running cell was signalled, False when the interrupt was remembered for a cell that
        has not arrived yet or dropped for one that already ended.
        """
        with self._lock:
            running = self.running
            if cell is not None and cell != running:
                if cell not in self._ended and cell not in self._early:
                    self._early.append(cell)
                return False
            if running is None:
                return False
            self.taken.clear()
        signal.pthread_kill(self.main_ident, signal.SIGINT)
        cancel = _mk_cancel()
        if cancel is not None:
            threading.Thread(target=self._cancel_until_taken, args=(running, cancel), daemon=True,
                             name="superkernel-cancel").start()
        return True

    def _cancel_until_taken(self, cell: str, cancel: Callable[[], None]) -> None:
        deadline = time.monotonic() + CANCEL_FOR
        while self.running == cell and not self.taken.is_set() and time.monotonic() < deadline:
            cancel()
            self.taken.wait(CANCEL_EVERY)
