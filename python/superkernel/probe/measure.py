"""Measurements between the ranks of a group, per provider the group actually uses.

Every function here is collective: all ranks of the group call it with the same arguments.

* Routes: rank 0 asks the mk backend which provider carries its traffic to each peer
  (``superkernel.backend.transports``) and picks one peer per provider (the first same-host peer for
  ``shm``, the first peer on another host for ``tcp``). On a backend other than mk the route is named after
  the backend.
* Two-sided, OSU micro-benchmark method (``osu_latency``, ``osu_bw``): latency is half the round trip of a
  blocking ping-pong, averaged over the iterations; bandwidth is a window of non-blocking sends followed
  by a 4-byte acknowledgement, bytes sent per second. Only the two ranks of a pair communicate; the others
  wait in a barrier.
* One-sided (``superkernel.memory.Window``, when available): put/get latency = one operation followed by
  ``flush`` per iteration; bandwidth = a window of operations, then one ``flush``.
* Allreduce over the whole group: average time per iteration, maximum over ranks; bus bandwidth with
  nccl-tests' factor 2(n-1)/n.

Iteration counts adapt to a time budget per point (estimated on the initiating rank from a few warm-up
iterations and sent to the partner, so both run the same count).
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist

PROVIDER_NAMES = {"shm": "shared memory", "tcp": "TCP", "ibverbs": "RDMA (ibverbs)", "gloo": "gloo (TCP)",
                  "nccl": "NCCL", "mpi": "MPI"}
SMALL_WINDOW, LARGE_WINDOW, LARGE = 64, 16, 64 << 10  # osu_bw's window (fewer in flight for large messages)


@dataclass
class Route:
    provider: str        # shm | tcp | gloo ... (what carries the bytes)
    a: int               # initiating rank (group rank)
    b: int               # partner
    host_a: str
    host_b: str

    @property
    def scope(self) -> str:
        return "intra-host" if self.host_a == self.host_b else "inter-host"

    @property
    def label(self) -> str:
        return f"{self.scope} {PROVIDER_NAMES.get(self.provider, self.provider)} (rank {self.a} <-> {self.b})"


@dataclass
class Series:
    """One curve: ``test`` at every size over one route (allreduce: over the whole group, route None)."""

    test: str                      # latency | bw | put_latency | get_latency | put_bw | get_bw | allreduce
    route: Route | None
    sizes: list[int] = field(default_factory=list)
    latency_us: list[float] = field(default_factory=list)
    bandwidth_MBps: list[float] = field(default_factory=list)   # OSU's MB/s (1e6 B/s); allreduce: busbw
    iterations: list[int] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        return d

    @staticmethod
    def from_json(d: dict[str, Any]) -> "Series":
        d = dict(d)
        d["route"] = Route(**d["route"]) if d["route"] else None
        return Series(**d)


def size_range(max_bytes: int, min_bytes: int = 1, factor: int = 4) -> list[int]:
    out, s = [], min_bytes
    while s <= max_bytes:
        out.append(s)
        s *= factor
    if out[-1] != max_bytes:
        out.append(max_bytes)
    return out


def _backend_name(group: Any) -> str:
    return dist.get_backend(group)


def routes(group: Any = None) -> list[Route]:
    """One route per provider rank 0 uses (collective; every rank gets the same list)."""
    n = dist.get_world_size(group)
    me = dist.get_rank(group)
    plan: list[Any] = [None]
    if me == 0:
        found: list[Route] = []
        kinds: list[str] | None = None
        hosts: list[str] | None = None
        try:
            from superkernel.backend import peer_hosts, transports

            kinds, hosts = transports(group), peer_hosts(group)
        except Exception:  # noqa: BLE001 - not an mk group: name the route after the backend
            pass
        if kinds is None or hosts is None:
            import socket

            hosts = [socket.gethostname()] * n   # unknown: the backend does not tell
            kinds = ["self"] + [_backend_name(group)] * (n - 1)
        seen: set[tuple[str, bool]] = set()
        for peer in range(n):
            key = (kinds[peer], hosts[peer] == hosts[0])
            if kinds[peer] == "self" or key in seen:
                continue
            seen.add(key)
            found.append(Route(kinds[peer], 0, peer, hosts[0], hosts[peer]))
        plan = [[asdict(r) for r in found]]
    dist.broadcast_object_list(plan, src=_global(group, 0), group=group)
    return [Route(**r) for r in plan[0]]


def _global(group: Any, rank: int) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)


def _agree_iters(route: Route, me: int, estimate: float, budget: float, group: Any, lo: int, hi: int) -> int:
    """Rank a decides the iteration count from its estimate (seconds per iteration) and tells rank b."""
    t = torch.zeros(1, dtype=torch.int64)
    if me == route.a:
        t[0] = int(min(hi, max(lo, math.ceil(budget / max(estimate, 1e-9)))))
        dist.send(t, _global(group, route.b), group=group)
    else:
        dist.recv(t, _global(group, route.a), group=group)
    return int(t.item())


def _timed(fn: Callable[[], None], iters: int) -> float:
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return time.perf_counter() - t0


def osu_latency(route: Route, sizes: list[int], budget: float, group: Any = None) -> Series:
    me = dist.get_rank(group)
    out = Series("latency", route)
    if me in (route.a, route.b):
        buf = torch.zeros(max(sizes), dtype=torch.uint8)
        peer = _global(group, route.b if me == route.a else route.a)
        for size in sizes:
            view = buf[:size]
            if me == route.a:
                def step() -> None:
                    dist.send(view, peer, group=group)
                    dist.recv(view, peer, group=group)
            else:
                def step() -> None:
                    dist.recv(view, peer, group=group)
                    dist.send(view, peer, group=group)
            est = _timed(step, 3) / 3
            iters = _agree_iters(route, me, est, budget, group, 5, 10000)
            _timed(step, max(2, iters // 10))   # warm-up
            elapsed = _timed(step, iters)
            out.sizes.append(size)
            out.iterations.append(iters)
            out.latency_us.append(elapsed / iters / 2 * 1e6)
            out.bandwidth_MBps.append(size / (elapsed / iters / 2) / 1e6)
    dist.barrier(group=group)
    return out


def osu_bw(route: Route, sizes: list[int], budget: float, group: Any = None) -> Series:
    me = dist.get_rank(group)
    out = Series("bw", route)
    if me in (route.a, route.b):
        buf = torch.zeros(max(sizes), dtype=torch.uint8)
        ack = torch.zeros(1, dtype=torch.int32)
        peer = _global(group, route.b if me == route.a else route.a)
        for size in sizes:
            view = buf[:size]
            window = SMALL_WINDOW if size < LARGE else LARGE_WINDOW
            if me == route.a:
                def step() -> None:
                    reqs = [dist.isend(view, peer, group=group) for _ in range(window)]
                    for r in reqs:
                        r.wait()
                    dist.recv(ack, peer, group=group)
            else:
                def step() -> None:
                    reqs = [dist.irecv(view, peer, group=group) for _ in range(window)]
                    for r in reqs:
                        r.wait()
                    dist.send(ack, peer, group=group)
            est = _timed(step, 2) / 2
            iters = _agree_iters(route, me, est, budget, group, 3, 2000)
            _timed(step, max(1, iters // 10))
            elapsed = _timed(step, iters)
            out.sizes.append(size)
            out.iterations.append(iters)
            out.latency_us.append(elapsed / iters / window * 1e6)
            out.bandwidth_MBps.append(size * window * iters / elapsed / 1e6)
    dist.barrier(group=group)
    return out


def one_sided(route: Route, sizes: list[int], budget: float, window: Any, group: Any = None) -> list[Series]:
    """put/get latency and bandwidth from rank a into rank b's part of ``window`` (a uint8 Window)."""
    me = dist.get_rank(group)
    series = {t: Series(t, route) for t in ("put_latency", "get_latency", "put_bw", "get_bw")}
    if me == route.a:
        buf = torch.ones(max(sizes), dtype=torch.uint8)
        b = route.b
        for size in sizes:
            view = buf[:size]
            ops: dict[str, Callable[[], None]] = {}

            def put1() -> None:
                window.put(b, 0, view)
                window.flush(b)

            def get1() -> None:
                window.get(b, 0, view)
                window.flush(b)

            burst = SMALL_WINDOW if size < LARGE else LARGE_WINDOW

            def putn() -> None:
                for _ in range(burst):
                    window.put(b, 0, view)
                window.flush(b)

            def getn() -> None:
                for _ in range(burst):
                    window.get(b, 0, view)
                window.flush(b)

            ops = {"put_latency": put1, "get_latency": get1, "put_bw": putn, "get_bw": getn}
            for test, fn in ops.items():
                est = _timed(fn, 2) / 2
                iters = int(min(10000, max(3, math.ceil(budget / max(est, 1e-9)))))
                _timed(fn, max(1, iters // 10))
                elapsed = _timed(fn, iters)
                per_op = elapsed / iters / (burst if test.endswith("_bw") else 1)
                s = series[test]
                s.sizes.append(size)
                s.iterations.append(iters)
                s.latency_us.append(per_op * 1e6)
                s.bandwidth_MBps.append(size / per_op / 1e6)
    dist.barrier(group=group)
    return list(series.values())


def allreduce(sizes: list[int], budget: float, group: Any = None) -> Series:
    """Allreduce of float32 buffers over the whole group; bandwidth column = bus bandwidth (nccl-tests)."""
    n = dist.get_world_size(group)
    out = Series("allreduce", None)
    buf = torch.zeros(max(1, max(sizes) // 4), dtype=torch.float32)
    for size in sizes:
        count = max(1, size // 4)
        view = buf[:count]

        def step() -> None:
            dist.all_reduce(view, group=group)

        est = torch.tensor([_timed(step, 2) / 2], dtype=torch.float64)
        dist.all_reduce(est, op=dist.ReduceOp.MAX, group=group)
        iters = int(min(5000, max(3, math.ceil(budget / max(est.item(), 1e-9)))))
        _timed(step, max(1, iters // 10))
        dist.barrier(group=group)
        t = torch.tensor([_timed(step, iters) / iters], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        sec = t.item()
        nbytes = count * 4
        out.sizes.append(nbytes)
        out.iterations.append(iters)
        out.latency_us.append(sec * 1e6)
        out.bandwidth_MBps.append(nbytes / sec * (2 * (n - 1) / n) / 1e6 if n > 1 else 0.0)
    return out
