"""Runs inside both ranks of a 2-rank job between two namespace hosts whose link is slow (tc tbf): one-sided
window operations whose data take over a second to cross the link, and waits on them ended from another
thread while those data are in flight.

* ``interrupt`` (both ranks, as the notebook interrupts every rank of its pool): superkernel.backend.
  cancel_waits 0.3 s into a blocking get, a blocking put, an async get's wait, a flush, a fetch_add queued
  behind a large put, and a wait_notify nobody answers. Each wait must end at once with CancelledError; the
  operation itself is not undone: flush(peer) then completes it, the data are what they would have been,
  and the window keeps working.
* ``abort`` (rank 0 only): group.abort() 0.3 s into rank 0's get from rank 1 while rank 1 gets from rank 0.
  Rank 0's wait must end at once with PeerError naming the abort, its ``out`` must not change afterwards
  (nothing still writes into it), and rank 1 must hear of it promptly too (its peer went away), not at the
  group timeout. free() must release the window at once on both ranks (PeerError: not every rank could be
  told); a new group's window then works.

Prints one REPORT line per rank: per case, the error's type and text (None when the wait returned), seconds
from the interrupt/abort to the wait's end, and the checks made afterwards (a list of problems, empty when
all held).
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
import threading
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from superkernel.backend import cancel_waits
from superkernel.memory import Window

ELEMS = 2 << 20  # int64 elements a rank exposes: 16 MiB, 1.3 s at 100 Mbit/s
SMALL = 1024


def pattern(rank: int, salt: int = 0) -> torch.Tensor:
    return torch.arange(ELEMS, dtype=torch.int64) + (rank + 1) * 10_000_000_000 + salt * 1_000_000_000


def timed(after: float, stop: Callable[[], None], call: Callable[[], object]) -> dict:
    """Run ``call`` with ``stop`` made on another thread ``after`` seconds in: the error (type and text, or
    None) and the seconds from ``stop`` to the call's end."""
    stopped: list[float] = []

    def fire() -> None:
        stopped.append(time.monotonic())
        stop()

    timer = threading.Timer(after, fire)
    timer.start()
    try:
        call()
        error = None
    except Exception as e:  # noqa: BLE001 - reported, the test decides
        error = {"type": type(e).__name__, "text": str(e)}
    end = time.monotonic()
    timer.cancel()
    timer.join()
    return {"error": error, "after_stop": end - stopped[0] if stopped else None}


def open_window(rank: int, peer: int, salt: int = 0) -> tuple[dist.ProcessGroup, Window]:
    """A window of ``pattern(rank, salt)`` on a new mk group, its connections made (one small get), and the
    ranks in step."""
    group = dist.new_group(backend="mk", timeout=datetime.timedelta(seconds=60))
    win = Window(pattern(rank, salt), group)
    win.get(peer, 0, torch.zeros(SMALL, dtype=torch.int64))
    dist.barrier()
    return group, win


def interrupt_cases(rank: int, peer: int, after: float) -> dict:
    out: dict = {}
    names = ("get", "put", "get_async", "flush", "fetch_add", "wait_notify")
    for name in names:
        _, win = open_window(rank, peer)
        got = torch.zeros(ELEMS, dtype=torch.int64)
        src = pattern(rank, salt=5)
        small = torch.zeros(SMALL, dtype=torch.int64)
        calls: dict[str, Callable[[], object]] = {
            "get": lambda: win.get(peer, 0, got),
            "put": lambda: win.put(peer, 0, src),
            "get_async": lambda: win.get(peer, 0, got, async_op=True).wait(),
            "flush": lambda: (win.put(peer, 0, src, async_op=True), win.flush(peer)),
            "fetch_add": lambda: (win.put(peer, 0, src, async_op=True), win.fetch_add(peer, ELEMS - 1, 1)),
            "wait_notify": lambda: win.wait_notify(3),
        }
        rep = timed(after, cancel_waits, calls[name])
        at_error = got.clone()
        problems: list[str] = []
        try:
            win.flush(peer, timeout=30)  # the interrupted operation completes
            dist.barrier()
            if name in ("get", "get_async") and torch.equal(got, at_error):
                problems.append("out was complete when the wait ended: the transfer was not in flight")
            if name in ("get", "get_async") and not torch.equal(got, pattern(peer)):
                problems.append("after flush, out does not hold the peer's window")
            if name in ("put", "flush", "fetch_add"):
                want = pattern(peer, salt=5)
                if name == "fetch_add":
                    want[-1] += 1  # (the fetch_add, queued behind the put, is not undone either)
                if not torch.equal(win.tensor, want):
                    problems.append("after flush, this rank's window does not hold the peer's put")
            win.get(peer, 0, small)  # and the window goes on working: the peer's window holds our put, or its own
            wrote = name in ("put", "flush", "fetch_add")
            if not torch.equal(small, (pattern(rank, salt=5) if wrote else pattern(peer))[:SMALL]):
                problems.append(f"the next get gave {small[:4].tolist()}...")
            dist.barrier()
            win.free(timeout=30)
        except Exception as e:  # noqa: BLE001
            problems.append(f"afterwards: {type(e).__name__}: {e}")
        rep["problems"] = problems
        out[name] = rep
        dist.barrier()
    return out


def abort_case(rank: int, peer: int, after: float) -> dict:
    group, win = open_window(rank, peer)
    got = torch.zeros(ELEMS, dtype=torch.int64)
    small = torch.zeros(SMALL, dtype=torch.int64)
    stop = group.abort if rank == 0 else (lambda: None)
    t0 = time.monotonic()
    rep = timed(after, stop, lambda: win.get(peer, 0, got))
    rep["seconds"] = time.monotonic() - t0
    problems: list[str] = []
    snapshot = got.clone()
    time.sleep(0.5)
    if not torch.equal(got, snapshot):
        problems.append("out changed after the wait ended")
    t1 = time.monotonic()
    try:
        win.free(timeout=30)
        rep["free"] = None
    except Exception as e:  # noqa: BLE001
        rep["free"] = f"{type(e).__name__}: {e}"
    rep["free_seconds"] = time.monotonic() - t1
    if not win.freed:
        problems.append("free() left the window unreleased")
    try:
        win.free()  # (released: nothing more to do)
    except Exception as e:  # noqa: BLE001
        problems.append(f"a second free(): {type(e).__name__}: {e}")
    dist.barrier()
    try:  # the process goes on: a new group's window works
        _, win2 = open_window(rank, peer, salt=2)
        win2.get(peer, 0, small)
        if not torch.equal(small, pattern(peer, salt=2)[:SMALL]):
            problems.append(f"a new group's window gave {small[:4].tolist()}...")
        dist.barrier()
        win2.free(timeout=30)
    except Exception as e:  # noqa: BLE001
        problems.append(f"a new group's window: {type(e).__name__}: {e}")
    rep["problems"] = problems
    return rep


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--after", type=float, default=0.3)
    args = ap.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))  # keeps the ranks in step
    rank = dist.get_rank()
    peer = 1 - rank
    report = {"rank": rank, "interrupt": interrupt_cases(rank, peer, args.after),
              "abort": abort_case(rank, peer, args.after)}
    sys.stdout.write("REPORT " + json.dumps(report) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
