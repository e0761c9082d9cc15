"""Runs inside every rank of a world (tests/transport/world.py): every Window operation, checked against
values regenerated from a shared seed on every rank. Prints one REPORT line: per family the list of
failures (empty when all passed), and timings of the one-sided checks.

    window_suite.py            the full suite
    window_suite.py --die      rank 1 exits right after creating a window; the others must get PeerError
"""
from __future__ import annotations

import json
import os
import sys
import time
import threading
import traceback
import zlib
from collections import defaultdict

import torch
import torch.distributed as dist

import superkernel  # noqa: F401  (registers "mk")
from superkernel import backend
from superkernel.memory import CancelledError, PeerError, Window

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int32, torch.int64, torch.uint8]

rank = world = 0
failures: dict[str, list[str]] = defaultdict(list)
timings: dict[str, float] = {}


def gen(key: str, n: int, dtype: torch.dtype, lo: int = -3, hi: int = 3) -> torch.Tensor:
    """Small integer values (exact in every dtype, also summed a few hundred times) from a shared seed."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{key}/{n}/{dtype}".encode()))
    if dtype == torch.uint8:
        lo = max(lo, 0)
    return torch.randint(lo, hi + 1, (n,), generator=g).to(dtype)


def check(family: str, ok: bool, what: str) -> None:
    if not ok:
        failures[family].append(what)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def family(fn):
    def run() -> None:
        t0 = time.monotonic()
        try:
            fn()
        except Exception:
            failures[fn.__name__].append(traceback.format_exc()[-1500:])
        timings[fn.__name__] = round(time.monotonic() - t0, 3)
        dist.barrier()
    run.__name__ = fn.__name__
    return run


@family
def put_get() -> None:
    chunk = 5
    for dtype in DTYPES:
        size = lambda r: chunk * world + 3 * r  # noqa: E731  (ranks expose different sizes)
        with Window.allocate(size(rank), dtype) as win:
            check("put_get", [win.size(p) for p in range(world)] == [size(p) for p in range(world)],
                  f"{dtype}: sizes {[win.size(p) for p in range(world)]}")
            win.tensor.copy_(gen(f"init/{rank}", size(rank), dtype))
            dist.barrier()
            for p in range(world):  # get every rank's whole block
                out = torch.empty(size(p), dtype=dtype)
                win.get(p, 0, out)
                check("put_get", same(out, gen(f"init/{p}", size(p), dtype)), f"{dtype}: get of rank {p}'s block")
            dist.barrier()
            for p in range(world):  # put our chunk into every rank (ourselves included)
                win.put(p, rank * chunk, gen(f"put/{rank}->{p}", chunk, dtype))
            win.flush_all()
            dist.barrier()
            want = gen(f"init/{rank}", size(rank), dtype)
            for p in range(world):
                want[p * chunk:(p + 1) * chunk] = gen(f"put/{p}->{rank}", chunk, dtype)
            check("put_get", same(win.tensor, want), f"{dtype}: block after every rank's put")
            dist.barrier()
            # read back a peer's block (what others wrote there) with a get at an offset
            p = (rank + 1) % world
            out = torch.empty(chunk, dtype=dtype)
            win.get(p, (world - 1) * chunk, out)
            check("put_get", same(out, gen(f"put/{world - 1}->{p}", chunk, dtype)), f"{dtype}: get at an offset")
            dist.barrier()
    # a large block, with a 2-D window tensor and the Window(tensor) constructor
    n = 1 << 20
    mine = torch.arange(n, dtype=torch.float32).reshape(1024, 1024) + rank
    before = mine.data_ptr()
    with Window(mine) as win:
        check("put_get", mine.data_ptr() != before and same(win.tensor, mine), "Window(tensor) re-points the tensor")
        check("put_get", same(mine.reshape(-1)[:4], torch.arange(4, dtype=torch.float32) + rank), "contents kept")
        p = (rank + 1) % world
        first = torch.empty(4)
        win.get(p, n - 4, first)  # no barrier: a peer's contents are exposed as soon as creation returns
        check("put_get", same(first, torch.arange(n - 4, n, dtype=torch.float32) + p), f"initial contents {first}")
        dist.barrier()
        win.put(p, 0, torch.full((n,), float(100 + rank)))
        win.flush(p)
        dist.barrier()
        q = (rank - 1) % world
        check("put_get", bool((mine == float(100 + q)).all()), "a peer's 4 MiB put lands in the user's tensor")
        out = torch.empty(n)
        win.get(p, 0, out)
        check("put_get", bool((out == float(100 + rank)).all()), "4 MiB get")
        dist.barrier()


@family
def accumulate() -> None:
    iters = 12
    n = 33
    for dtype in DTYPES:
        for op in ("sum", "min", "max"):
            with Window.allocate(n, dtype) as win:
                win.tensor.copy_(gen(f"acc0/{rank}/{op}", n, dtype))
                dist.barrier()
                futs = []
                for it in range(iters):  # every rank hammers the same elements of every rank
                    for k in range(world):
                        p = (rank + k) % world
                        src = gen(f"acc/{rank}/{p}/{it}/{op}", n, dtype)
                        if it % 3 == 2:
                            futs.append(win.accumulate(p, 0, src, op=op, async_op=True))
                        else:
                            win.accumulate(p, 0, src, op=op)
                for f in futs:
                    f.wait()
                win.flush_all()
                dist.barrier()
                vals = [gen(f"acc0/{rank}/{op}", n, dtype).long()] + [
                    gen(f"acc/{r}/{rank}/{it}/{op}", n, dtype).long() for r in range(world) for it in range(iters)]
                stack = torch.stack(vals)
                want = {"sum": stack.sum(0), "min": stack.min(0).values, "max": stack.max(0).values}[op]
                if dtype == torch.uint8:
                    want = want % 256
                check("accumulate", same(win.tensor.long(), want), f"{dtype} {op}: {win.tensor.tolist()} != {want.tolist()}")
    # hammer: every rank adds ones to the same 1024 elements of rank 0, many times, at the same time
    reps, m = 400, 1024
    for dtype in (torch.float32, torch.int64, torch.float16):
        with Window.allocate(m, dtype) as win:
            dist.barrier()
            one = torch.ones(m, dtype=dtype)
            for _ in range(reps):
                win.accumulate(0, 0, one)
            win.flush_all()
            dist.barrier()
            if rank == 0:
                got = win.tensor.double()
                want = float(min(world * reps, 2048)) if dtype == torch.float16 else float(world * reps)
                check("accumulate", bool((got == want).all()),
                      f"hammer {dtype}: {got.unique().tolist()[:8]} != {want} (lost updates)")
    # a partial range at an offset
    with Window.allocate(10, torch.float32) as win:
        dist.barrier()
        win.accumulate(0, 4, torch.ones(3))
        win.flush_all()
        dist.barrier()
        if rank == 0:
            want = torch.zeros(10)
            want[4:7] = world
            check("accumulate", same(win.tensor, want), f"accumulate at an offset: {win.tensor.tolist()}")


@family
def fetch_add() -> None:
    k = 60
    with Window.allocate(4, torch.int64) as win:
        dist.barrier()
        tickets = [win.fetch_add(0, 0, 1) for _ in range(k)]
        weighted = [win.fetch_add(world - 1, 2, rank + 1, async_op=True) for _ in range(k // 2)]
        olds = [f.wait() for f in weighted]
        win.flush_all()
        everyone = [None] * world
        dist.all_gather_object(everyone, tickets)
        flat = sorted(t for ts in everyone for t in ts)
        check("fetch_add", flat == list(range(world * k)), f"tickets not unique/complete: {flat[:20]}...")
        check("fetch_add", all(isinstance(o, int) for o in olds) and olds == sorted(olds),
              f"async fetch_add old values {olds[:10]}")
        dist.barrier()
        if rank == 0:
            check("fetch_add", int(win.tensor[0]) == world * k, f"counter {int(win.tensor[0])} != {world * k}")
        if rank == world - 1:
            want = sum(r + 1 for r in range(world)) * (k // 2)
            check("fetch_add", int(win.tensor[2]) == want, f"weighted counter {int(win.tensor[2])} != {want}")


@family
def compare_swap() -> None:
    k = 15
    owner = world - 1
    with Window.allocate(2, torch.int64) as win:  # [0] lock (0 free, r+1 held by r), [1] plain counter
        dist.barrier()
        cell = torch.zeros(1, dtype=torch.int64)
        for _ in range(k):
            deadline = time.monotonic() + 30
            while (old := win.compare_swap(owner, 0, 0, rank + 1)) != 0:
                check("compare_swap", 1 <= old <= world, f"lock holds {old}")
                if time.monotonic() > deadline:
                    raise TimeoutError("lock never acquired")
            win.get(owner, 1, cell)      # non-atomic read-modify-write, protected by the lock
            cell += 1
            win.put(owner, 1, cell)
            win.flush(owner)
            released = win.compare_swap(owner, 0, rank + 1, 0)
            check("compare_swap", released == rank + 1, f"unlock saw {released}, expected {rank + 1}")
        failed = win.compare_swap(owner, 0, 12345, 7)  # a swap that must not happen
        check("compare_swap", failed != 12345, f"compare_swap with a wrong expected value swapped ({failed})")
        dist.barrier()
        if rank == owner:
            check("compare_swap", win.tensor.tolist() == [0, world * k], f"lock/counter {win.tensor.tolist()}")


@family
def notify() -> None:
    n = 1 << 18
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    with Window.allocate(n, torch.float32) as win:
        dist.barrier()
        for i in range(3):
            win.put(nxt, 0, torch.full((n,), float(1000 * rank + i)), notify=5)
            win.wait_notify(5, timeout=30)
            got = win.tensor[[0, n // 2, n - 1]].tolist()
            # the puts of one origin complete in order; after our i-th wait at least i+1 arrived
            check("notify", all(v >= 1000 * prv + i for v in got) and all(v < 1000 * prv + 3 for v in got),
                  f"round {i}: data after wait_notify {got}")
        dist.barrier()
        check("notify", not win.test_notify(5), "a fourth arrival was consumed")
        t0 = time.monotonic()
        try:
            win.wait_notify(6, timeout=0.3)
            check("notify", False, "wait_notify with nothing sent returned")
        except TimeoutError as e:
            dt = time.monotonic() - t0
            check("notify", 0.25 <= dt < 3.0 and "wait_notify" in str(e), f"timeout after {dt:.2f}s: {e}")
        dist.barrier()
        # an interrupt (cancel_waits, as the notebook worker sends) ends the wait at once
        timer = threading.Timer(0.2, backend.cancel_waits)
        timer.start()
        t0 = time.monotonic()
        try:
            win.wait_notify(9, timeout=20)
            check("notify", False, "wait_notify was not cancelled")
        except CancelledError as e:
            check("notify", time.monotonic() - t0 < 5 and "cancelled" in str(e), f"cancel: {e}")
        timer.join()
        dist.barrier()
        # several notified puts with one tag are counted
        win.put(nxt, 0, torch.ones(1), notify=7)
        win.put(nxt, 1, torch.ones(1), notify=7)
        win.wait_notify(7, timeout=30)
        win.wait_notify(7, timeout=30)
        check("notify", not win.test_notify(7), "more arrivals than notified puts")


@family
def fence() -> None:
    n = 1 << 16
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    with Window.allocate(n + 1, torch.int32) as win:  # [0, n) data, [n] flag
        dist.barrier()
        futs = []
        for i in range(1, 9):
            futs.append(win.put(nxt, 0, torch.full((n,), i, dtype=torch.int32), async_op=True))
            win.fence(nxt)
        futs.append(win.put(nxt, n, torch.tensor([1], dtype=torch.int32), async_op=True))  # flag after the data
        deadline = time.monotonic() + 30
        while int(win.tensor[n]) != 1 and time.monotonic() < deadline:
            time.sleep(0.0005)
        data = win.tensor[:n]
        check("fence", int(win.tensor[n]) == 1, "flag never arrived")
        check("fence", bool((data == 8).all()), f"data seen after the fenced flag: {data.unique().tolist()} (from {prv})")
        for f in futs:
            f.wait()


@family
def async_ops() -> None:
    with Window.allocate(64, torch.int64) as win:
        win.tensor.copy_(torch.arange(64) + 100 * rank)
        dist.barrier()
        p = (rank + 1) % world
        out = torch.zeros(64, dtype=torch.int64)
        f = win.get(p, 0, out, async_op=True)
        check("async_ops", f.wait() is None and f.done() and f.is_completed() and f.is_success(), "get future")
        check("async_ops", same(out, torch.arange(64) + 100 * p), "async get result")
        dist.barrier()
        f = win.put(p, 10, torch.tensor([-1, -2], dtype=torch.int64), async_op=True)
        f.wait()
        f2 = win.fetch_add(p, 0, 5, async_op=True)
        f3 = win.compare_swap(p, 1, 1 + 100 * p, 77, async_op=True)
        check("async_ops", f2.wait() == 100 * p and f3.wait() == 1 + 100 * p, "atomic futures' values")
        win.flush(p)
        dist.barrier()
        want = torch.arange(64) + 100 * rank
        want[0] += 5
        want[1] = 77
        want[10:12] = torch.tensor([-1, -2])
        check("async_ops", same(win.tensor, want), f"after async ops {win.tensor[:12].tolist()}")


def expect(exc: type, fn, what: str, needle: str = "") -> None:
    try:
        fn()
    except exc as e:
        check("errors", needle in str(e), f"{what}: message {str(e)!r} lacks {needle!r}")
        return
    except Exception as e:  # noqa: BLE001
        check("errors", False, f"{what}: raised {type(e).__name__}: {e}, expected {exc.__name__}")
        return
    check("errors", False, f"{what}: no error")


@family
def errors() -> None:
    win = Window.allocate(8 + rank, torch.float32)
    dist.barrier()
    p = (rank + 1) % world
    buf = torch.zeros(4)
    expect(IndexError, lambda: win.get(p, 8 + p - 3, buf), "get past the end", "outside")
    expect(IndexError, lambda: win.put(p, 6 + p, buf), "put past the end", "outside")
    expect(IndexError, lambda: win.get(world, 0, buf), "rank == world", "out of range")
    expect(IndexError, lambda: win.put(-1, 0, buf), "rank -1", "out of range")
    expect(IndexError, lambda: win.get(p, -1, buf), "negative offset", "offset")
    expect(IndexError, lambda: win.size(world), "size of a bad rank", "out of range")
    expect(IndexError, lambda: win.put(p, 0, buf, notify=5000), "notify tag out of range", "notify")
    expect(TypeError, lambda: win.put(p, 0, torch.zeros(4, dtype=torch.float64)), "put of float64", "dtype")
    expect(TypeError, lambda: win.get(p, 0, torch.zeros(4, dtype=torch.int32)), "get into int32", "dtype")
    expect(TypeError, lambda: win.fetch_add(p, 0, 1), "fetch_add on float32", "int64")
    expect(ValueError, lambda: win.accumulate(p, 0, buf, op="prod"), "accumulate prod", "sum")
    expect(ValueError, lambda: win.get(p, 0, torch.zeros(8)[::2]), "non-contiguous out", "contiguous")
    dist.barrier()
    win.free()
    win.free()  # idempotent
    expect(RuntimeError, lambda: win.get(p, 0, buf), "get after free", "freed")
    expect(RuntimeError, lambda: win.put(p, 0, buf), "put after free", "freed")
    expect(RuntimeError, lambda: win.flush_all(), "flush after free", "freed")
    expect(RuntimeError, lambda: win.wait_notify(0, timeout=0.1), "wait_notify after free", "freed")
    check("errors", win.tensor.numel() == 8 + rank, "the tensor outlives free")
    gloo = dist.new_group(backend="gloo")
    expect(RuntimeError, lambda: Window.allocate(4, torch.float32, group=gloo), "non-mk group", "mk")
    dist.barrier()
    # free on only some ranks: a clear TimeoutError there, no hang; then everyone frees
    win = Window.allocate(4, torch.float32)
    dist.barrier()
    if rank == 0:
        t0 = time.monotonic()
        expect(TimeoutError, lambda: win.free(timeout=0.5), "free on rank 0 only", "collective")
        check("errors", time.monotonic() - t0 < 5, "partial free took too long")
    dist.barrier()
    win.free()


def raised(fn) -> tuple[str, str]:
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        return type(e).__name__, str(e)
    return "", "no error"


FAST = ("put", "get", "accumulate", "fetch_add", "compare_swap", "flush", "flush_all")


@family
def fast_ops() -> None:
    """The per-window builtins that Window binds for its hot methods: same results, arguments and errors as
    the documented methods (called through the class), non-contiguous sources, futures that outlive their
    tensors."""
    n = 32
    p, prv = (rank + 1) % world, (rank - 1) % world
    with Window.allocate(4 * n, torch.int64) as win:
        kinds = {name: type(getattr(win, name)).__name__ for name in FAST}
        check("fast_ops", all(k == "builtin_function_or_method" for k in kinds.values()), f"not bound: {kinds}")
        dist.barrier()
        # non-contiguous sources (a strided view, a transposed block), through both entry points
        base = gen(f"fast/{rank}", 2 * n, torch.int64)
        strided = base[::2]
        block = base[: n].view(4, n // 4).t()
        win.put(p, 0, strided)
        Window.put(win, p, n, block)
        win.accumulate(p, 2 * n, strided)
        Window.accumulate(win, p, 2 * n, block, op="sum")
        # keywords in any order; async futures whose (non-contiguous) source is dropped before the wait
        tmp = gen(f"fast-async/{rank}", 2 * n, torch.int64)
        f = win.put(src=tmp[::2], offset=3 * n, rank=p, async_op=True)
        del tmp
        f.wait(timeout=30)
        check("fast_ops", f.done() and f.is_success(), "async put future")
        win.flush(rank=p, timeout=30)
        win.flush_all(timeout=30)
        dist.barrier()
        mine = gen(f"fast/{prv}", 2 * n, torch.int64)
        want = torch.cat([mine[::2], mine[: n].view(4, n // 4).t().reshape(-1),
                          mine[::2] + mine[: n].view(4, n // 4).t().reshape(-1),
                          gen(f"fast-async/{prv}", 2 * n, torch.int64)[::2]])
        check("fast_ops", same(win.tensor, want), f"after non-contiguous puts/accumulates {win.tensor.tolist()}")
        out = torch.zeros(n, dtype=torch.int64)
        win.get(out=out, rank=p, offset=0)
        check("fast_ops", same(out, gen(f"fast/{rank}", 2 * n, torch.int64)[::2]), "get with keywords")
        f = win.get(p, n, out, True)
        check("fast_ops", f.wait() is None and same(out, block.reshape(-1)), "positional async get")
        dist.barrier()
        # atomics: int() of the value as before (a float, a 0-dim tensor), keywords, async
        before = win.tensor[0].item() if rank == 0 else None
        dist.barrier()
        if rank == 0:
            old = win.fetch_add(0, 0, 2.0)
            old2 = win.fetch_add(0, 0, value=torch.tensor(3))
            check("fast_ops", (old, old2) == (before, before + 2), f"fetch_add values {old, old2}, start {before}")
            old3 = win.compare_swap(0, 0, expected=before + 5, desired=-1, async_op=True).wait()
            check("fast_ops", old3 == before + 5 and win.tensor[0].item() == -1, f"compare_swap {old3}")
        dist.barrier()
        # argument errors as Python's own, and the library's errors identical through both entry points
        buf = torch.zeros(4, dtype=torch.int64)
        for what, fn in (("unknown keyword", lambda: win.put(p, 0, buf, nofity=1)),
                         ("missing src", lambda: win.put(p, 0)),
                         ("twice rank", lambda: win.get(p, 0, buf, rank=p)),
                         ("too many", lambda: win.flush(p, 1.0, 2)),
                         ("not a tensor", lambda: win.put(p, 0, [1, 2])),
                         ("float offset", lambda: win.get(p, 0.5, buf))):
            kind, msg = raised(fn)
            check("fast_ops", kind == "TypeError", f"{what}: {kind}: {msg}")
        cases = {"put": (lambda w: w.put(p, 4 * n - 2, buf), lambda: Window.put(win, p, 4 * n - 2, buf)),
                 "dtype": (lambda w: w.put(p, 0, buf.float()), lambda: Window.put(win, p, 0, buf.float())),
                 "rank": (lambda w: w.get(world, 0, buf), lambda: Window.get(win, world, 0, buf)),
                 "offset": (lambda w: w.accumulate(p, -1, buf), lambda: Window.accumulate(win, p, -1, buf)),
                 "op": (lambda w: w.accumulate(p, 0, buf, "prod"), lambda: Window.accumulate(win, p, 0, buf, "prod")),
                 "notify": (lambda w: w.put(p, 0, buf, 5000), lambda: Window.put(win, p, 0, buf, 5000)),
                 "timeout": (lambda w: w.flush(p, -1), lambda: Window.flush(win, p, -1)),
                 "flush rank": (lambda w: w.flush(-1), lambda: Window.flush(win, -1)),
                 "out": (lambda w: w.get(p, 0, torch.zeros(8, dtype=torch.int64)[::2]),
                         lambda: Window.get(win, p, 0, torch.zeros(8, dtype=torch.int64)[::2]))}
        want_kind = {"put": "IndexError", "dtype": "TypeError", "rank": "IndexError", "offset": "IndexError",
                     "op": "ValueError", "notify": "IndexError", "timeout": "ValueError", "flush rank": "IndexError",
                     "out": "ValueError"}
        for name, (fast, slow) in cases.items():
            a, b = raised(lambda: fast(win)), raised(slow)
            check("fast_ops", a == b and a[0] == want_kind[name], f"{name}: fast {a} vs method {b}")
        dist.barrier()
    # after free: the same RuntimeError from every fast op
    for name, fn in (("put", lambda: win.put(p, 0, buf)), ("get", lambda: win.get(p, 0, buf)),
                     ("accumulate", lambda: win.accumulate(p, 0, buf)), ("fetch_add", lambda: win.fetch_add(p, 0, 1)),
                     ("compare_swap", lambda: win.compare_swap(p, 0, 0, 1)), ("flush", lambda: win.flush(p)),
                     ("flush_all", lambda: win.flush_all())):
        kind, msg = raised(fn)
        check("fast_ops", kind == "RuntimeError" and "freed" in msg, f"{name} after free: {kind}: {msg}")

    class Logged(Window):  # a subclass that overrides put keeps its override (and the other fast ops)
        calls = 0

        def put(self, *a, **k):
            Logged.calls += 1
            return super().put(*a, **k)

    with Logged.allocate(4, torch.int64) as lw:
        lw.put(p, 0, torch.arange(4))
        lw.flush(p)
        dist.barrier()
        check("fast_ops", Logged.calls == 1 and "put" not in lw.__dict__ and "flush" in lw.__dict__,
              f"subclass override: calls {Logged.calls}, bound {sorted(lw.__dict__)}")
        check("fast_ops", same(lw.tensor, torch.arange(4)), "subclass put landed")
        dist.barrier()


@family
def subgroup() -> None:
    """A window over an mk subgroup of all ranks but the last: group ranks, group size."""
    members = list(range(max(1, world - 1)))
    g = dist.new_group(members, backend="mk")
    if rank not in members:
        return
    with Window.allocate(2, torch.int64, group=g) as win:
        check("subgroup", (win.rank, win.world_size) == (members.index(rank), len(members)),
              f"rank/world {(win.rank, win.world_size)}")
        old = win.fetch_add(0, 1, 1)
        win.flush_all()
        dist.barrier(group=g)
        check("subgroup", 0 <= old < len(members), f"fetch_add returned {old}")
        if win.rank == 0:
            check("subgroup", int(win.tensor[1]) == len(members), f"counter {win.tensor.tolist()}")
        expect_index = False
        try:
            win.get(len(members), 0, torch.zeros(1, dtype=torch.int64))
        except IndexError:
            expect_index = True
        check("subgroup", expect_index, "group rank == group size was accepted")


@family
def one_sided() -> None:
    """Rank 0 sleeps in time.sleep; every other rank reads, writes and updates its memory meanwhile."""
    nap = 1.5
    n = 1 << 16
    with Window.allocate(n, torch.int64) as win:
        win.tensor.copy_(torch.arange(n))
        dist.barrier()
        t0 = time.monotonic()
        if rank == 0:
            time.sleep(nap)  # the Python thread does nothing with the window
            woke = time.monotonic() - t0
            done_at = [None] * world
            dist.all_gather_object(done_at, None)
            for r in range(1, world):
                check("one_sided", done_at[r] is not None and done_at[r] < nap * 0.8,
                      f"rank {r} finished its operations {done_at[r]}s after the barrier; rank 0 slept {woke:.2f}s")
            want = torch.arange(n)
            for r in range(1, world):
                want[r * 8:(r + 1) * 8] = -r
            want[0] = sum(range(1, world))
            check("one_sided", same(win.tensor[:n], want), "rank 0's memory after the others' operations")
            timings["one_sided_ops_s"] = max(d for d in done_at[1:])
        else:
            out = torch.empty(n, dtype=torch.int64)
            win.get(0, 0, out)  # the first 8 * world elements may already hold others' writes
            ok = same(out[8 * world:], torch.arange(8 * world, n))
            win.put(0, rank * 8, torch.full((8,), -rank, dtype=torch.int64))
            win.fetch_add(0, 0, rank)
            win.flush(0)
            t = time.monotonic() - t0
            check("one_sided", ok, "get while the target sleeps")
            dist.all_gather_object([None] * world, round(t, 4))


def die() -> None:
    """Rank 1 exits after creating the window: the others' operations on it fail with PeerError."""
    win = Window.allocate(16, torch.float32)
    dist.barrier()
    if rank == 1:
        sys.stdout.flush()
        os._exit(0)
    time.sleep(1.0)  # let the transport notice (shm: pidfd poll; tcp: connection reset)
    buf = torch.zeros(4)
    t0 = time.monotonic()
    try:
        for _ in range(3):
            win.put(1, 0, buf)
            win.get(1, 0, buf)
        check("die", False, "operations on a dead rank succeeded")
    except PeerError as e:
        check("die", "rank 1" in str(e) or "peer 1" in str(e), f"PeerError does not name the dead rank: {e}")
        timings["die_message"] = str(e)
    except Exception as e:  # noqa: BLE001
        check("die", False, f"expected PeerError, got {type(e).__name__}: {e}")
    check("die", time.monotonic() - t0 < 10, "error took too long")


def main() -> None:
    global rank, world
    dist.init_process_group("mk")
    rank, world = dist.get_rank(), dist.get_world_size()
    transports = backend.transports()
    if "--die" in sys.argv:
        try:
            die()
        except Exception:
            failures["die"].append(traceback.format_exc()[-1500:])
    else:
        for fn in (put_get, accumulate, fetch_add, compare_swap, notify, fence, async_ops, errors, fast_ops, subgroup,
                   one_sided):
            fn()
    sys.stdout.write("REPORT " + json.dumps({"rank": rank, "transports": transports, "failures": failures,
                                             "timings": timings}) + "\n")
    sys.stdout.flush()
    if "--die" in sys.argv:
        os._exit(0)  # the group lost a rank: skip the collective teardown
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
