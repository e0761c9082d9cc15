"""The rank side of an interrupt (superkernel.cell_interrupts) in this process: a real SIGINT to this main
thread, the control thread played by a test thread, and the mk cancellation replaced by a counter."""
from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator

import pytest

from superkernel import cell_interrupts
from superkernel.cell_interrupts import CellInterrupts


@pytest.fixture
def cells(monkeypatch: pytest.MonkeyPatch) -> Iterator[CellInterrupts]:
    monkeypatch.setattr(cell_interrupts, "_mk_cancel", lambda: None)
    previous = signal.getsignal(signal.SIGINT)
    c = CellInterrupts()
    c.install()
    try:
        yield c
    finally:
        signal.signal(signal.SIGINT, previous)


def from_control_thread(fn, *args):  # type: ignore[no-untyped-def]
    out: list[object] = []
    t = threading.Thread(target=lambda: out.append(fn(*args)))
    t.start()
    t.join(5)
    assert not t.is_alive()
    return out[0]


def test_an_interrupt_before_the_cell_arrives_stops_that_cell_only(cells: CellInterrupts) -> None:
    assert from_control_thread(cells.interrupt, "cell-1") is False  # remembered, nothing signalled
    assert cells.begin("cell-1") is False
    cells.end("cell-1")
    assert cells.begin("cell-2") is True
    time.sleep(0.05)  # no signal is pending for this one
    cells.end("cell-2")


def test_an_interrupt_while_the_cell_runs_raises_in_it(cells: CellInterrupts) -> None:
    assert cells.begin("cell-1")
    with pytest.raises(KeyboardInterrupt):
        assert from_control_thread(cells.interrupt, "cell-1") is True
        time.sleep(5)
    cells.end("cell-1")
    assert cells.taken.is_set()


def test_an_interrupt_for_an_ended_cell_does_not_hit_the_next(cells: CellInterrupts) -> None:
    assert cells.begin("cell-1")
    cells.end("cell-1")
    assert from_control_thread(cells.interrupt, "cell-1") is False
    assert cells.begin("cell-2")  # the late interrupt was not remembered for a later cell
    time.sleep(0.05)
    cells.end("cell-2")
    assert from_control_thread(cells.interrupt, None) is False  # nothing runs: nothing to interrupt


def test_sigint_between_cells_is_ignored(cells: CellInterrupts) -> None:
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.05)
    assert cells.signals_ignored == 1
    assert cells.begin("cell-1")
    with pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGINT)  # from outside, e.g. a launcher forwarding Ctrl-C
        time.sleep(5)
    cells.end("cell-1")


def test_mk_waits_are_cancelled_until_the_main_thread_takes_the_signal(monkeypatch: pytest.MonkeyPatch,
                                                                      cells: CellInterrupts) -> None:
    """A wait that began after the first cancellation (or ignores it) would keep the main thread in C code,
    the signal pending: the cancellation repeats until the main thread has raised KeyboardInterrupt, then stops."""
    counted = threading.Event()
    count = [0]

    def cancel() -> None:
        count[0] += 1
        if count[0] == 3:
            counted.set()

    monkeypatch.setattr(cell_interrupts, "_mk_cancel", lambda: cancel)
    assert cells.begin("cell-1")
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})  # "in C code": the signal stays pending
    try:
        assert from_control_thread(cells.interrupt, "cell-1") is True
        assert counted.wait(5), count
        assert not cells.taken.is_set()
        with pytest.raises(KeyboardInterrupt):
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # the third cancellation got it out
            time.sleep(5)
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    assert cells.taken.is_set()
    time.sleep(4 * cell_interrupts.CANCEL_EVERY)
    stopped_at = count[0]
    time.sleep(4 * cell_interrupts.CANCEL_EVERY)
    assert count[0] == stopped_at, "the cancellation went on after the main thread took the interrupt"
    cells.end("cell-1")
