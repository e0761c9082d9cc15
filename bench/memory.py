""""RAM as a service" benchmark: superkernel's one-sided Window against Open MPI RMA, and the TensorStore
against a Redis server, on the same ranks and host, in one run.

    mpirun --allow-run-as-root -np 2 python bench/memory.py            # everything (MPI needs mpirun)
    mpirun --allow-run-as-root -np 2 python bench/memory.py --quick
    torchrun --nproc-per-node 2 bench/memory.py                        # no MPI column (not an MPI job)
    SUPERKERNEL_TRANSPORT=tcp mpirun ... -x SUPERKERNEL_TRANSPORT ...  # mk's TCP provider on one host

Part 1, one-sided (OSU's osu_put_latency / osu_get_latency / osu_put_bw / osu_get_bw method with a passive
target): rank 0 writes into / reads from rank 1's window; the other ranks only wait. Latency = one operation
followed by a flush, averaged; bandwidth = bursts of ``--burst`` operations followed by one flush, bytes per
second. Both windows exist at once, and for every size and test mk and MPI are timed alternately in
``--rounds`` rounds (the one going first changes each round), each row keeping its median round. mk: ``superkernel.memory.Window`` (uint8, over the default mk group). MPI: ``MPI.Win.Allocate`` of
the same size on the same ranks, ``Lock_all`` once (passive target), ``Put``/``Get`` then ``Flush(1)``.
Both read from / write into the same origin memory (numpy arrays; mk gets ``torch.from_numpy`` views of
them), and the per-size buffer slices (and MPI's ``[buf, MPI.BYTE]`` specs) are made before the timed loop,
so the loop times the library calls only. Rank 0 also measures one core's memcpy bandwidth
(bench/memcpy.py): a same-host copy cannot beat it.

Part 2, tensor store: rank 0 puts a uint8 tensor of each size (1 MiB - 256 MiB) into a ``TensorStore``
placed on rank 1 (``put(key, t, rank=1)``: the pool is remote memory, not a local copy) and gets it back
into a preallocated tensor; against Redis, rank 0 ``SET``s the tensor's buffer (redis-py, zero-copy
memoryview) and ``GET``s it back as a tensor (``torch.frombuffer``). The Redis server is started by this
script on 127.0.0.1 with a random password, no persistence (``--save "" --appendonly no``), and stopped
after. Throughput = bytes per second per operation, averaged over ``--store-iters`` repetitions after one
warm-up. Every measured get is checked against the bytes put (a mismatch is flagged with '!').

Targets (issue "RAM as a service"), reported, never asserted: same-host put/get bandwidth >= 80% of memcpy
and ahead of Open MPI RMA; store >= 5x Redis throughput for tensors >= 1 MiB. Results: JSON and PNG under
bench/results/memory-<tag>.*. This is a benchmark, not a test.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import json
import os
import secrets
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from collectives import _git_commit, detect_launch, parse_size  # noqa: E402
from report import format_size  # noqa: E402

ONE_SIDED_TESTS = ("put_lat", "get_lat", "put_bw", "get_bw")


# ------------------------------------------------------------------------------------------ one-sided
def _timed(fn: Callable[[], None], seconds: float, lo: int, hi: int) -> tuple[float, int]:
    """Average seconds per call of ``fn`` over as many calls as fit in ``seconds`` (between lo and hi)."""
    t0 = time.perf_counter()
    fn()
    fn()
    est = (time.perf_counter() - t0) / 2
    iters = int(min(hi, max(lo, seconds / max(est, 1e-9))))
    for _ in range(max(1, iters // 10)):
        fn()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters, iters


def one_sided_ops(put: Callable[[int], Callable[[], None]], get: Callable[[int], Callable[[], None]],
                  flush: Callable[[], None], burst: int) -> dict[str, Callable[[int], Callable[[], None]]]:
    """The four tests as factories: size -> the timed call. ``put(size)`` / ``get(size)`` return a call that
    moves ``size`` bytes with its buffers already sliced, so the timed loop holds nothing but library calls
    (identical loop code for mk and MPI)."""
    def lat(start: Callable[[int], Callable[[], None]]) -> Callable[[int], Callable[[], None]]:
        def make(size: int) -> Callable[[], None]:
            op = start(size)

            def f() -> None:
                op()
                flush()
            return f
        return make

    def bw(start: Callable[[int], Callable[[], None]]) -> Callable[[int], Callable[[], None]]:
        def make(size: int) -> Callable[[], None]:
            op = start(size)
            ops = range(burst)

            def f() -> None:
                for _ in ops:
                    op()
                flush()
            return f
        return make

    return {"put_lat": lat(put), "get_lat": lat(get), "put_bw": bw(put), "get_bw": bw(get)}


def origin_buffers(n: int) -> tuple[Any, Any]:
    """Rank 0's source (random bytes) and destination, shared by the mk and MPI measurements."""
    import numpy as np

    return np.random.default_rng(1).integers(0, 256, n, dtype=np.uint8), np.zeros(n, dtype=np.uint8)


def measure_one_sided(impls: dict[str, tuple[dict[str, Callable[[int], Callable[[], None]]], Callable[[int], str]]],
                      sizes: list[int], burst: int, seconds: float, rounds: int) -> list[dict[str, Any]]:
    """Every test at every size for every implementation (name -> (ops, check)), the implementations
    alternating: ``rounds`` rounds of one timing each, the first implementation changing from round to round,
    so drifting load hits them alike; each row keeps the median over its rounds."""
    names = list(impls)
    rows = {name: [] for name in names}
    for size in sizes:
        row = {name: {"impl": name, "bytes": size, "check": impls[name][1](size)} for name in names}
        for test in ONE_SIDED_TESTS:
            made = {name: impls[name][0][test](size) for name in names}
            times: dict[str, list[float]] = {name: [] for name in names}
            iters: dict[str, int] = {name: 0 for name in names}
            for r in range(rounds):
                for name in names[r % len(names):] + names[:r % len(names)]:
                    per_call, n = _timed(made[name], seconds / rounds, 3, 20000)
                    times[name].append(per_call)
                    iters[name] += n
            for name in names:
                per_op = statistics.median(times[name]) / (burst if test.endswith("_bw") else 1)
                row[name][test + "_us"] = per_op * 1e6
                row[name][test.split("_")[0] + ("_lat_GBps" if test.endswith("lat") else "_bw_GBps")] = size / per_op / 1e9
                row[name][test + "_iters"] = iters[name]
        for name in names:
            rows[name].append(row[name])
    return [r for name in names for r in rows[name]]


@contextlib.contextmanager
def mk_window_ops(sizes: list[int], args: argparse.Namespace, rank: int, buffers: tuple[Any, Any]) -> Iterator[Any]:
    """(ops, check) of superkernel's Window on rank 0 (None on the others); the window lives until the end."""
    import functools

    import torch
    import torch.distributed as dist

    from superkernel.memory import Window

    win = Window.allocate((max(sizes),), torch.uint8)
    try:
        if rank != 0:
            yield None
            return
        src, dst = (torch.from_numpy(b) for b in buffers)

        def check(size: int) -> str:
            win.put(1, 0, src[:size])
            win.flush(1)
            dst[:size].zero_()
            win.get(1, 0, dst[:size])
            win.flush(1)
            return "ok" if torch.equal(dst[:size], src[:size]) else "put/get round trip differs"

        yield (one_sided_ops(lambda s: functools.partial(win.put, 1, 0, src[:s]),
                             lambda s: functools.partial(win.get, 1, 0, dst[:s]),
                             functools.partial(win.flush, 1), args.burst), check)
    finally:
        dist.barrier()
        win.free()


@contextlib.contextmanager
def mpi_window_ops(sizes: list[int], args: argparse.Namespace, comm: Any, buffers: tuple[Any, Any]) -> Iterator[Any]:
    """(ops, check) of an Open MPI window (MPI.Win.Allocate, passive target) on rank 0 (None on the others)."""
    import functools

    import numpy as np
    from mpi4py import MPI

    win = MPI.Win.Allocate(max(sizes), 1, comm=comm)
    win.Lock_all()
    try:
        if comm.Get_rank() != 0:
            yield None
            return
        src, dst = buffers

        def check(size: int) -> str:
            win.Put([src[:size], MPI.BYTE], 1)
            win.Flush(1)
            dst[:size] = 0
            win.Get([dst[:size], MPI.BYTE], 1)
            win.Flush(1)
            return "ok" if np.array_equal(dst[:size], src[:size]) else "put/get round trip differs"

        yield (one_sided_ops(lambda s: functools.partial(win.Put, [src[:s], MPI.BYTE], 1),
                             lambda s: functools.partial(win.Get, [dst[:s], MPI.BYTE], 1),
                             functools.partial(win.Flush, 1), args.burst), check)
    finally:
        win.Unlock_all()
        comm.Barrier()
        win.Free()


# --------------------------------------------------------------------------------------------- store
class RedisServer:
    """redis-server on 127.0.0.1, a free port, a random password, no persistence; stopped on exit."""

    def __init__(self) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server not found (Debian: apt-get install redis-server)")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.password = secrets.token_hex(16)
        self.dir = tempfile.mkdtemp(prefix="superkernel-bench-redis-")
        conf = os.path.join(self.dir, "redis.conf")
        with open(conf, "w") as f:   # the password goes in a file, not on the command line
            f.write(f"port {self.port}\nbind 127.0.0.1\nrequirepass {self.password}\nsave \"\"\n"
                    f"appendonly no\nprotected-mode yes\ndir {self.dir}\nproto-max-bulk-len 1gb\n")
        self.proc = subprocess.Popen([exe, conf], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        import redis

        self.client = redis.Redis(host="127.0.0.1", port=self.port, password=self.password,
                                  socket_timeout=120)
        deadline = time.monotonic() + 20
        while True:
            try:
                self.client.ping()
                break
            except redis.exceptions.ConnectionError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    self.stop()
                    raise RuntimeError("redis-server did not start within 20 s")
                time.sleep(0.05)
        self.version = self.client.info("server").get("redis_version", "?")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


def _throughput(fn: Callable[[], None], size: int, iters: int) -> float:
    # warm-up: two calls, since an overwriting put alternates between two extents (first touch of pool
    # memory allocates its pages: that one-time cost is not the store's throughput)
    fn()
    fn()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return size * iters / (time.perf_counter() - t0) / 1e9


def _throughput_fresh(put: Callable[[int], None], drop: Callable[[int], None], size: int, iters: int) -> float:
    """Throughput of puts of new keys: only the put is timed; the key is deleted (untimed) right after."""
    put(-1)
    drop(-1)
    spent = 0.0
    for i in range(iters):
        t0 = time.perf_counter()
        put(i)
        spent += time.perf_counter() - t0
        drop(i)
    return size * iters / spent / 1e9


@contextlib.contextmanager
def _patched(obj: Any, name: str, value: Any) -> Iterator[None]:
    before = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, before)


@contextlib.contextmanager
def _store_worker_linger(c_module: Any, microseconds: int) -> Iterator[None]:
    before = c_module.set_store_worker_linger(microseconds)
    try:
        yield
    finally:
        c_module.set_store_worker_linger(before)


def _isolated(store: Any, tensor_store: Any, src: Any, dst: Any, key: str, target: int, gap: float = 0.002,
              iters: int = 25) -> dict[str, float]:
    """Median microseconds of a new-key put and of a cold get made ``gap`` s after the previous operation (the
    machine idles in between), as the store routes them (after such a pause: on the calling thread) and with
    the Store worker thread forced."""
    out: dict[str, float] = {"gap_ms": gap * 1e3}
    for route, warm in (("chosen", tensor_store._WARM_NS), ("worker", 1 << 62)):
        puts, gets = [], []
        with _patched(tensor_store, "_WARM_NS", warm):
            for i in range(iters):
                time.sleep(gap)
                t0 = time.perf_counter()
                store.put(f"{key}/iso{i}", src, rank=target)
                puts.append(time.perf_counter() - t0)
                time.sleep(gap)
                store.delete(f"{key}/iso{i}")
                time.sleep(gap)
                store._known.pop(key, None)
                t0 = time.perf_counter()
                store.get(key, out=dst)
                gets.append(time.perf_counter() - t0)
        out[f"newput_{route}_us"] = statistics.median(puts) * 1e6
        out[f"coldget_{route}_us"] = statistics.median(gets) * 1e6
    return out


def store_side(sizes: list[int], args: argparse.Namespace, rank: int, n: int) -> tuple[list[dict[str, Any]], str]:
    import torch
    import torch.distributed as dist

    try:
        from superkernel import _C
        from superkernel.memory import tensor_store
        from superkernel.memory.tensor_store import TensorStore
    except Exception as e:  # noqa: BLE001
        return [], f"TensorStore unavailable: {type(e).__name__}: {e}"
    target = 1 if n > 1 else 0
    # an overwrite holds the old and the new copy for a moment: room for two of the largest tensor
    store = TensorStore(capacity_per_rank=2 * max(sizes) + (16 << 20))
    rows: list[dict[str, Any]] = []
    if rank == 0:
        # what a put of a new key cannot avoid: one compare_set round trip to the job's c10d Store
        trips = []
        for _ in range(200):
            t0 = time.perf_counter()
            store._store.compare_set("bench/round-trip", "", "x")
            trips.append(time.perf_counter() - t0)
        args.store_round_trip_us = {"median": statistics.median(trips) * 1e6, "min": min(trips) * 1e6,
                                    "p90": statistics.quantiles(trips, n=10)[-1] * 1e6}
        redis = RedisServer()
        try:
            for size in sizes:
                iters = max(2, min(args.store_iters, int(args.store_bytes // size)))
                src = torch.randint(0, 256, (size,), dtype=torch.uint8)
                dst = torch.empty(size, dtype=torch.uint8)
                key = f"bench/{size}"
                put = _throughput(lambda: store.put(key, src, rank=target), size, iters)
                def new_puts(tag: str) -> float:
                    return _throughput_fresh(lambda i: store.put(f"{key}/{tag}{i}", src, rank=target),
                                             lambda i: store.delete(f"{key}/{tag}{i}"), size, iters)

                def cold_get() -> None:   # as a process that has not seen the key: its record from the Store
                    store._known.pop(key, None)
                    store.get(key, out=dst)

                new_put = new_puts("new")
                # the same with the Store worker sleeping at once after each call (no linger: every put wakes it)
                with _store_worker_linger(_C, 0):
                    asleep_put = new_puts("zz")
                # the same with the record published after the copy (no overlap with the Store round trip)
                with _patched(tensor_store, "_OVERLAP_BYTES", 1 << 62):
                    serial_put = new_puts("ser")
                # the same with every Store call on the calling thread (none on the worker thread)
                with _patched(tensor_store, "_WARM_NS", 0):
                    caller_put = new_puts("cal")
                    coldget_caller = _throughput(cold_get, size, iters)
                get = _throughput(lambda: store.get(key, out=dst), size, iters)
                coldget = _throughput(cold_get, size, iters)
                # the same, validated by a second read of the record instead of the owner's free counter
                with _patched(store, "_near", []):
                    coldget_serial = _throughput(cold_get, size, iters)
                isolated = _isolated(store, tensor_store, src, dst, key, target) if size == sizes[0] else None
                ok = torch.equal(dst, src)
                buf = memoryview(src.numpy())
                rput = _throughput(lambda: redis.client.set(key, buf), size, iters)
                got: list[Any] = [None]

                def rget() -> None:
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")   # frombuffer over immutable bytes
                        got[0] = torch.frombuffer(redis.client.get(key), dtype=torch.uint8)

                rget_bw = _throughput(rget, size, iters)
                rnew_put = _throughput_fresh(lambda i: redis.client.set(f"{key}/new{i}", buf),
                                             lambda i: redis.client.delete(f"{key}/new{i}"), size, iters)
                rok = torch.equal(got[0], src)
                redis.client.delete(key)
                store.delete(key)
                rows.append({"bytes": size, "iters": iters, "store_put_GBps": put, "store_get_GBps": get,
                             "redis_put_GBps": rput, "redis_get_GBps": rget_bw,
                             "store_newput_GBps": new_put, "store_newput_serial_GBps": serial_put,
                             "store_newput_asleep_GBps": asleep_put, "store_newput_caller_GBps": caller_put,
                             "store_coldget_GBps": coldget, "store_coldget_serial_GBps": coldget_serial,
                             "store_coldget_caller_GBps": coldget_caller, "isolated": isolated,
                             "redis_newput_GBps": rnew_put,
                             "check": "ok" if ok and rok else f"store {'ok' if ok else 'WRONG'}, "
                                                              f"redis {'ok' if rok else 'WRONG'}",
                             "store_rank": target})
            args.redis_version = redis.version
        finally:
            redis.stop()
    dist.barrier()
    store.free()
    return rows, ""


# --------------------------------------------------------------------------------------------- report
def _x(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b > 0 else "-"


def format_one_sided(doc: dict[str, Any]) -> str:
    mk = {r["bytes"]: r for r in doc["one_sided"] if r["impl"] == "mk"}
    mpi = {r["bytes"]: r for r in doc["one_sided"] if r["impl"] == "mpi"}
    sizes = sorted(set(mk) | set(mpi))
    meta = doc["meta"]
    lines = [f"# one-sided, rank 0 -> rank 1 ({meta['route']}); latency = op + flush; bandwidth = "
             f"{meta['args']['burst']}-op bursts + flush; GB/s = 1e9 B/s"]
    lines.append(f"{'size':>10} | {'mk Window':^43} | {'Open MPI RMA (passive)':^43} | {'mk/mpi bw':^15}")
    sub = f"{'put us':>9} {'get us':>9} {'put GB/s':>11} {'get GB/s':>11}"
    lines.append(f"{'':>10} | {sub} | {sub} | {'put':>7} {'get':>7}")
    for s in sizes:
        a, b = mk.get(s), mpi.get(s)

        def cells(r: dict[str, Any] | None) -> str:
            if r is None:
                return f"{'-':>9} {'-':>9} {'-':>11} {'-':>11}"
            flag = "" if r["check"] == "ok" else "!"
            return (f"{r['put_lat_us']:>9.2f} {r['get_lat_us']:>9.2f} {r['put_bw_GBps']:>11.3f} "
                    f"{r['get_bw_GBps']:>10.3f}{flag or ' '}")
        ratio = (f"{_x(a['put_bw_GBps'], b['put_bw_GBps']):>7} {_x(a['get_bw_GBps'], b['get_bw_GBps']):>7}"
                 if a and b else f"{'-':>7} {'-':>7}")
        lines.append(f"{format_size(s):>10} | {cells(a)} | {cells(b)} | {ratio}")
    for r in doc["one_sided"]:
        if r["check"] != "ok":
            lines.append(f"# ! {r['impl']} {format_size(r['bytes'])}: {r['check']}")
    return "\n".join(lines)


def format_store(doc: dict[str, Any]) -> str:
    meta = doc["meta"]
    nan = float("nan")
    lines = [f"# tensor store: rank 0 puts/gets uint8 tensors; TensorStore data on rank {meta.get('store_rank', 1)} "
             f"({meta['route']}); Redis {meta.get('redis_version', '?')} on 127.0.0.1 (redis-py); GB/s = 1e9 B/s"]
    lines.append("# put = overwrite of one key (same shape); new = put of a new key (deleted after, untimed), one "
                 "after the other; the same new-key puts: asleep = the Store worker thread sleeping at once after "
                 "each call (no linger), serial = the record published after the copy instead of during it, caller "
                 "= every Store call on the calling thread (none on the worker)")
    lines.append(f"{'size':>10} | {'TensorStore':^65} | {'Redis':^32} | {'store/redis':^26}")
    lines.append(f"{'':>10} | {'put GB/s':>10} {'new GB/s':>10} {'asleep':>10} {'serial':>10} {'caller':>10} "
                 f"{'get GB/s':>10} | {'put GB/s':>10} {'new GB/s':>10} {'get GB/s':>10} | {'put':>8} {'new':>8} "
                 f"{'get':>8}")
    for r in doc["store"]:
        flag = "" if r["check"] == "ok" else " !"
        alt = [r.get(f"store_newput_{k}_GBps", nan) for k in ("asleep", "serial", "caller")]
        lines.append(f"{format_size(r['bytes']):>10} | {r['store_put_GBps']:>10.3f} {r['store_newput_GBps']:>10.3f} "
                     + " ".join(f"{v:>10.3f}" for v in alt) + " "
                     f"{r['store_get_GBps']:>10.3f} | {r['redis_put_GBps']:>10.3f} {r['redis_newput_GBps']:>10.3f} "
                     f"{r['redis_get_GBps']:>10.3f} | {_x(r['store_put_GBps'], r['redis_put_GBps']):>8} "
                     f"{_x(r['store_newput_GBps'], r['redis_newput_GBps']):>8} "
                     f"{_x(r['store_get_GBps'], r['redis_get_GBps']):>8}{flag}")
        if flag:
            lines.append(f"# ! {format_size(r['bytes'])}: {r['check']}")
    cold = [r for r in doc["store"] if "store_coldget_GBps" in r]
    if cold:
        lines.append("# cold get = a get by a process that has not seen the key (its record comes from the Store), one "
                     "after the other; serial = the same with the copy validated by a second Store read of the record, "
                     "not the owner's free counter; caller = every Store call on the calling thread")
        lines.append(f"{'size':>10} | {'cold get GB/s':>13} {'serial':>10} {'caller':>10} | {'Redis get':>10} | "
                     f"{'cold/redis':>10}")
        for r in cold:
            lines.append(f"{format_size(r['bytes']):>10} | {r['store_coldget_GBps']:>13.3f} "
                         f"{r['store_coldget_serial_GBps']:>10.3f} {r.get('store_coldget_caller_GBps', nan):>10.3f} | "
                         f"{r['redis_get_GBps']:>10.3f} | {_x(r['store_coldget_GBps'], r['redis_get_GBps']):>10}")
    for r in doc["store"]:
        iso = r.get("isolated")
        if iso:
            lines.append(f"# isolated {format_size(r['bytes'])} calls, {iso['gap_ms']:g} ms apart (median us): new-key "
                         f"put {iso['newput_chosen_us']:.1f} as routed (calling thread after a pause), "
                         f"{iso['newput_worker_us']:.1f} on the worker; cold get {iso['coldget_chosen_us']:.1f} as "
                         f"routed, {iso['coldget_worker_us']:.1f} on the worker")
    rt = meta.get("store_round_trip_us")
    if rt:
        lines.append(f"# a new key costs one c10d Store compare_set round trip: {rt['median']:.1f} us median "
                     f"(min {rt['min']:.1f}, p90 {rt['p90']:.1f}) in this run; an overwrite or a get needs none")
    return "\n".join(lines)


def format_targets(doc: dict[str, Any]) -> str:
    lines = ["# targets (reported, not asserted)"]
    memcpy = (doc["meta"].get("memcpy") or {}).get("best_GBps")
    mk = [r for r in doc["one_sided"] if r["impl"] == "mk"]
    mpi = {r["bytes"]: r for r in doc["one_sided"] if r["impl"] == "mpi"}
    if mk and memcpy:
        big = max(mk, key=lambda r: r["bytes"])
        for op in ("put", "get"):
            bw = big[f"{op}_bw_GBps"]
            verdict = "met" if bw >= 0.8 * memcpy else "NOT met"
            line = (f"#   {op} bandwidth at {format_size(big['bytes'])}: {bw:.2f} GB/s = {100 * bw / memcpy:.0f}% "
                    f"of memcpy {memcpy:.2f} GB/s (target >= 80%: {verdict})")
            if big["bytes"] in mpi:
                m = mpi[big["bytes"]][f"{op}_bw_GBps"]
                line += f"; Open MPI RMA {m:.2f} GB/s ({'ahead' if bw > m else 'BEHIND'}, {_x(bw, m)})"
            lines.append(line)
    elif not mk:
        lines.append(f"#   one-sided: not measured ({doc['meta'].get('mk_window_reason') or 'no data'})")
    store = [r for r in doc["store"] if r["bytes"] >= 1 << 20]
    if store:
        ops = [("put", "put (overwrite)"), ("newput", "put (new key)"), ("get", "get")]
        if all("store_coldget_GBps" in r for r in store):
            ops.append(("coldget", "get (cold: record from the Store)"))
        for op, what in ops:
            base = "get" if op == "coldget" else op   # Redis has no cold get: every GET reads the server
            r = min(store, key=lambda r: r[f"store_{op}_GBps"] / max(r[f"redis_{base}_GBps"], 1e-12))
            x = r[f"store_{op}_GBps"] / max(r[f"redis_{base}_GBps"], 1e-12)
            lines.append(f"#   store {what} vs Redis, worst size >= 1 MiB ({format_size(r['bytes'])}): {x:.2f}x "
                         f"(target >= 5x: {'met' if x >= 5 else 'NOT met'})")
    return "\n".join(lines)


def plot(doc: dict[str, Any], path: str) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4.2), dpi=100)
    ax1, ax2 = fig.subplots(1, 2)
    for impl, style in (("mk", "-"), ("mpi", "--")):
        rows = sorted((r for r in doc["one_sided"] if r["impl"] == impl), key=lambda r: r["bytes"])
        if rows:
            xs = [r["bytes"] for r in rows]
            ax1.plot(xs, [r["put_bw_GBps"] for r in rows], style, marker=".", label=f"{impl} put")
            ax1.plot(xs, [r["get_bw_GBps"] for r in rows], style, marker="x", label=f"{impl} get")
    memcpy = (doc["meta"].get("memcpy") or {}).get("best_GBps")
    if memcpy:
        ax1.axhline(memcpy, color="grey", linestyle=":", label="memcpy (1 core)")
    rows = doc["store"]
    if rows:
        xs = [r["bytes"] for r in rows]
        curves = (("store_put_GBps", "-", "TensorStore put"), ("store_newput_GBps", "-", "TensorStore put (new key)"),
                  ("store_get_GBps", "-", "TensorStore get"), ("redis_put_GBps", "--", "Redis SET"),
                  ("redis_newput_GBps", "--", "Redis SET (new key)"), ("redis_get_GBps", "--", "Redis GET"))
        for key, style, label in curves:
            ax2.plot(xs, [r[key] for r in rows], style, marker="." if "put" in key else "x", label=label)
    for ax, title in ((ax1, "one-sided bandwidth (rank 0 -> rank 1)"), (ax2, "tensor store throughput")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("bytes")
        ax.set_ylabel("GB/s")
        ax.set_title(title, fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7)
    fig.suptitle(f"superkernel memory benchmark, {doc['meta']['world_size']} ranks, {doc['meta']['date']}",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path)


# ----------------------------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="8,64,1K,8K,64K,512K,4M,16M,64M", help="one-sided sizes")
    p.add_argument("--store-sizes", default="1M,4M,16M,64M,256M", help="tensor store sizes")
    p.add_argument("--quick", action="store_true", help="fewer sizes and shorter timing")
    p.add_argument("--burst", type=int, default=16, help="operations per flush in the bandwidth tests")
    p.add_argument("--time", type=float, default=0.3, help="seconds of timed calls per one-sided point and implementation")
    p.add_argument("--rounds", type=int, default=3,
                   help="one-sided: rounds per point, mk and MPI alternating (the median is kept)")
    p.add_argument("--store-iters", type=int, default=200, help="max repetitions per store size")
    p.add_argument("--store-bytes", type=float, default=2e9, help="bytes moved per store size and op, at most")
    p.add_argument("--store-server", choices=["process", "rank0"], default="process",
                   help="who serves torch's TCPStore: a helper process (as torchrun's agent does; default) "
                        "or a thread of rank 0 (plain env:// initialisation)")
    p.add_argument("--skip", default="", help="comma-separated parts to skip: mk,mpi,store")
    p.add_argument("--out-dir", default=str(HERE / "results"))
    p.add_argument("--tag", default="")
    args = p.parse_args(argv)
    if args.quick:
        args.sizes, args.store_sizes, args.time, args.store_iters = "8,4K,1M,16M", "1M,16M,256M", 0.03, 4
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    launch = detect_launch()
    import torch
    import torch.distributed as dist

    import superkernel  # noqa: F401  (registers mk)
    from superkernel.backend import transports

    torch.set_num_threads(1)
    rank, n = launch.rank, launch.world_size
    skip = set(filter(None, args.skip.split(",")))
    store_server = None
    if args.store_server == "process" and n > 1 and launch.launcher == "mpirun":  # torchrun's agent serves it
        # as under torchrun (whose agent process serves torch's TCPStore), serve it from a process of its own
        # instead of a thread of rank 0: the TensorStore's records live there
        store_server, store = _tcpstore_in_process(rank, n)
        dist.init_process_group("mk", store=store, rank=rank, world_size=n, timeout=_dt.timedelta(seconds=600))
    else:
        dist.init_process_group("mk", timeout=_dt.timedelta(seconds=600))
    route = transports()[1] if n > 1 else "self"
    memcpy = None
    if rank == 0:
        from memcpy import measure_memcpy

        memcpy = measure_memcpy().to_json()
    doc: dict[str, Any] = {"meta": {
        "world_size": n, "launcher": launch.launcher, "date": _dt.datetime.now(_dt.timezone.utc).strftime(
            "%Y-%m-%d %H:%M UTC"), "memcpy": memcpy, "args": vars(args), "torch": torch.__version__,
        "route": f"mk {route}" + ("" if route != "shm" else ", same host"), "git_commit": _git_commit(),
        "loadavg": os.getloadavg(), "nproc": os.cpu_count()}, "one_sided": [], "store": []}
    if rank == 0:
        print(f"# superkernel memory benchmark: {n} ranks, launcher {launch.launcher}, {doc['meta']['date']}, "
              f"load {doc['meta']['loadavg'][0]:.2f} on {os.cpu_count()} cores", flush=True)
        if memcpy:
            print(f"# memcpy (one core, 256 MiB): {memcpy['best_GBps']:.2f} GB/s", flush=True)
    if n < 2:
        raise SystemExit("bench/memory.py needs at least 2 ranks")
    sizes = sorted(parse_size(s) for s in args.sizes.split(","))
    buffers = origin_buffers(max(sizes)) if rank == 0 else (None, None)  # one origin memory for mk and MPI
    with contextlib.ExitStack() as stack:
        impls: dict[str, Any] = {}
        if "mk" not in skip:
            try:
                impls["mk"] = stack.enter_context(mk_window_ops(sizes, args, rank, buffers))
                doc["meta"]["mk_window_reason"] = ""
            except ImportError as e:
                doc["meta"]["mk_window_reason"] = f"superkernel.memory.Window unavailable: {e}"
        if "mpi" not in skip:
            if launch.mpi_comm is None:
                doc["meta"]["mpi"] = "not launched by mpirun"
            else:
                from mpi4py import MPI

                doc["meta"]["mpi"] = MPI.Get_library_version().splitlines()[0].strip()
                impls["mpi"] = stack.enter_context(mpi_window_ops(sizes, args, launch.mpi_comm, buffers))
        if rank == 0 and impls:
            doc["one_sided"] = measure_one_sided(impls, sizes, args.burst, args.time, args.rounds)
    if "store" not in skip:
        rows, why = store_side(sorted(parse_size(s) for s in args.store_sizes.split(",")), args, rank, n)
        doc["store"] = rows
        doc["meta"]["store_reason"] = why
        doc["meta"]["store_rank"] = 1
        doc["meta"]["redis_version"] = getattr(args, "redis_version", None)
        doc["meta"]["store_round_trip_us"] = getattr(args, "store_round_trip_us", None)
    if rank == 0:
        print(f"# Open MPI: {doc['meta'].get('mpi', 'skipped')}", flush=True)
        print("\n" + format_one_sided(doc), flush=True)
        print("\n" + format_store(doc), flush=True)
        print("\n" + format_targets(doc), flush=True)
        out = Path(args.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        tag = args.tag or f"{n}r-{launch.launcher}-{_dt.datetime.now().strftime('%Y%m%d-%H%M%S')}"
        (out / f"memory-{tag}.json").write_text(json.dumps(doc, indent=1) + "\n")
        print(f"\n# json: {out / f'memory-{tag}.json'}")
        try:
            plot(doc, str(out / f"memory-{tag}.png"))
            print(f"# plot: {out / f'memory-{tag}.png'}")
        except Exception as e:  # noqa: BLE001 - a failed plot must not lose the numbers
            print(f"# plot failed: {type(e).__name__}: {e}")
    dist.barrier()
    dist.destroy_process_group()
    if store_server is not None:
        store_server.terminate()
        store_server.wait(10)
    return 0


def _tcpstore_in_process(rank: int, n: int) -> tuple[Any, Any]:
    """Rank 0 starts a helper process serving a TCPStore on MASTER_ADDR:MASTER_PORT; every rank connects."""
    import torch.distributed as dist

    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    proc = None
    if rank == 0:
        code = ("import sys, time, datetime, torch.distributed as d; "
                f"s = d.TCPStore({addr!r}, {port}, {n}, True, timeout=datetime.timedelta(seconds=900), "
                "wait_for_workers=False); sys.stdin.read()")
        proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE)
    store = dist.TCPStore(addr, port, n, False, timeout=_dt.timedelta(seconds=600))
    return proc, store


if __name__ == "__main__":
    sys.exit(main())
