"""superkernel's Store worker thread (csrc/store_worker.h): Store calls handed to it return the Store's answers,
and after a call it polls for the next one for its linger, then sleeps."""
from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch.distributed as dist

from superkernel import _C


def _worker_state() -> str:
    """The scheduler state of the worker thread ('R' running, 'S' sleeping), from /proc."""
    for task in Path("/proc/self/task").iterdir():
        if (task / "comm").read_text().strip() == "mk-store-calls":
            return (task / "stat").read_text().rsplit(")", 1)[1].split()[0]
    raise AssertionError("no mk-store-calls thread in this process")


def _state_after(seconds: float, want: str) -> str:
    """Poll the worker's state for up to ``seconds`` until it is ``want``; returns the last state seen."""
    deadline = time.monotonic() + seconds
    state = _worker_state()
    while state != want and time.monotonic() < deadline:
        time.sleep(0.001)
        state = _worker_state()
    return state


@pytest.fixture
def restore_linger():
    before = _C.set_store_worker_linger(0)
    _C.set_store_worker_linger(before)
    yield before
    _C.set_store_worker_linger(before)


def test_answers_and_errors() -> None:
    store = dist.HashStore()
    assert _C.store_compare_set_async(store, "k", "", "v1").wait(10.0) == b"v1"
    assert _C.store_compare_set_async(store, "k", "wrong", "v2").wait(10.0) == b"v1"   # refused: the current value
    assert _C.store_compare_set_async(store, "k", "v1", "v2").wait(10.0) == b"v2"
    assert store.get("k") == b"v2"


def test_linger_then_sleep(restore_linger: int) -> None:
    """With a linger the worker keeps polling (running) after a call; without, or once it ran out, it sleeps.
    Set to 0 while polling, it stops at once."""
    assert restore_linger == 250, f"default linger {restore_linger} us (store_worker.h says 250)"
    store = dist.HashStore()
    _C.set_store_worker_linger(30_000_000)   # 30 s: long enough that the reads below see it polling
    _C.store_compare_set_async(store, "a", "", "x").wait(10.0)
    assert _state_after(0.5, "R") == "R", "the worker did not poll after its call"
    time.sleep(0.05)
    assert _worker_state() == "R", "the worker stopped polling long before its 30 s linger"
    assert _C.set_store_worker_linger(0) == 30_000_000
    assert _state_after(5.0, "S") == "S", "the worker kept polling after its linger was set to 0"
    _C.store_compare_set_async(store, "b", "", "x").wait(10.0)
    assert _state_after(5.0, "S") == "S", "with no linger the worker did not go to sleep"
    time.sleep(0.05)
    assert _worker_state() == "S"
    _C.set_store_worker_linger(restore_linger)
    _C.store_compare_set_async(store, "c", "", "x").wait(10.0)
    assert _state_after(5.0, "S") == "S", f"the worker still polled long after its {restore_linger} us linger"


def test_negative_linger_refused() -> None:
    with pytest.raises(ValueError, match=">= 0"):
        _C.set_store_worker_linger(-1)


def test_calls_while_polling_run_in_order(restore_linger: int) -> None:
    """Calls posted while the worker polls are taken at once and answered in posting order."""
    store = dist.HashStore()
    _C.set_store_worker_linger(1_000_000)
    calls = [_C.store_compare_set_async(store, "n", str(i - 1) if i else "", str(i)) for i in range(200)]
    assert [c.wait(10.0) for c in calls] == [str(i).encode() for i in range(200)]
