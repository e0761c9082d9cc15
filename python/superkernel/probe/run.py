"""Running a probe on a group: hardware of every host, then the measurements, gathered into one report.

``run_probe(group)`` is collective; rank 0 of the group gets the :class:`ProbeReport`, the others None.
"""
from __future__ import annotations

import datetime as _dt
import os
import socket
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from superkernel.probe import hardware, measure
from superkernel.probe.report import ProbeReport


@dataclass
class ProbeOptions:
    max_bytes: int = 4 << 20           # largest message of the point-to-point and one-sided tests
    allreduce_max_bytes: int = 16 << 20
    budget: float = 0.02               # seconds of timed iterations per point
    one_sided: bool = True
    launcher: str = "torch.distributed"

    @staticmethod
    def quick() -> "ProbeOptions":
        return ProbeOptions(max_bytes=1 << 20, allreduce_max_bytes=1 << 20, budget=0.01)


def _memcpy_GBps(nbytes: int = 64 << 20, repeat: int = 3) -> float:
    """One core's memcpy bandwidth (bytes copied per second, GB/s = 1e9 B/s), best of ``repeat``."""
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.zeros(nbytes, dtype=torch.uint8)
    dst.copy_(src)
    best = float("inf")
    with _one_thread():
        for _ in range(repeat):
            t0 = time.perf_counter()
            dst.copy_(src)
            best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


class _one_thread:
    def __enter__(self) -> None:
        self.n = torch.get_num_threads()
        torch.set_num_threads(1)

    def __exit__(self, *exc: Any) -> None:
        torch.set_num_threads(self.n)


def _agree(flag: bool, group: Any) -> bool:
    t = torch.tensor([1 if flag else 0], dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return bool(t.item())


def _window(nbytes: int, group: Any) -> tuple[Any, str]:
    """A uint8 Window of ``nbytes`` on every rank, or (None, why not) - decided the same on every rank."""
    why = ""
    try:
        from superkernel.memory import Window
    except Exception as e:  # noqa: BLE001
        Window, why = None, f"superkernel.memory.Window not importable ({type(e).__name__}: {e})"
    if not _agree(Window is not None, group):
        return None, why or "superkernel.memory.Window not importable on another rank"
    try:
        win, err = Window.allocate((nbytes,), torch.uint8, group=group), ""
    except Exception as e:  # noqa: BLE001
        win, err = None, f"Window.allocate failed: {type(e).__name__}: {e}".splitlines()[0]
    if not _agree(win is not None, group):
        if win is not None:
            win.free()
        return None, err or "Window.allocate failed on another rank"
    return win, ""


def run_probe(group: Any = None, options: ProbeOptions | None = None) -> ProbeReport | None:
    opts = options or ProbeOptions()
    t0 = time.perf_counter()
    me, n = dist.get_rank(group), dist.get_world_size(group)
    root = 0 if group is None else dist.get_global_rank(group, 0)
    local = hardware.detect().to_json()
    per_rank: list[Any] = [None] * n
    dist.all_gather_object(per_rank, (socket.gethostname(), local), group=group)
    ranks_per_host: dict[str, list[int]] = {}
    hosts: dict[str, Any] = {}
    for r, (host, hw) in enumerate(per_rank):
        ranks_per_host.setdefault(host, []).append(r)
        hosts.setdefault(host, hw)

    notes: list[str] = []
    if os.environ.get("SUPERKERNEL_TRANSPORT", "auto") != "auto":
        notes.append(f"SUPERKERNEL_TRANSPORT={os.environ['SUPERKERNEL_TRANSPORT']} forces mk's provider between "
                     "ranks of one host")
    series = []
    sizes = measure.size_range(opts.max_bytes)
    routes = measure.routes(group)
    if not routes:
        notes.append("point-to-point: not measured (a single rank)")
    for route in routes:
        series.append(measure.osu_latency(route, sizes, opts.budget, group))
        series.append(measure.osu_bw(route, sizes, opts.budget, group))
    if opts.one_sided and routes:
        win, why = _window(opts.max_bytes, group)
        if win is None:
            notes.append(f"one-sided put/get: not measured: {why}")
        else:
            try:
                for route in routes:
                    series.extend(measure.one_sided(route, sizes, opts.budget, win, group))
            finally:
                dist.barrier(group=group)
                win.free()
    if n > 1:
        series.append(measure.allreduce(measure.size_range(opts.allreduce_max_bytes, 4), opts.budget, group))
    memcpy = _memcpy_GBps() if me == 0 else None
    # series measured on the initiating rank of each route: gather them to rank 0
    gathered: list[Any] = [None] * n if me == 0 else None  # type: ignore[assignment]
    dist.gather_object([s.to_json() for s in series if s.sizes], gathered, dst=root, group=group)
    if me != 0:
        return None
    merged: dict[tuple[Any, ...], measure.Series] = {}
    for rank_series in gathered:
        for d in rank_series:
            s = measure.Series.from_json(d)
            key = (s.test, s.route.provider if s.route else None, s.route.b if s.route else None)
            merged.setdefault(key, s)
    return ProbeReport(
        world_size=n, backend=str(dist.get_backend(group)), launcher=opts.launcher,
        date=_dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
        hosts=[hardware.HostHardware.from_json(h) for h in hosts.values()], ranks_per_host=ranks_per_host,
        series=list(merged.values()), memcpy_GBps=memcpy, notes=notes, seconds=time.perf_counter() - t0)
