"""Runs inside every rank of a world (tests/transport/world.py): the TensorStore cases, each on a store of its
own. Every value is regenerated from a seed on the checking rank (the reference never travels through the
store). Prints one REPORT line: per case, the list of failures (empty when it passed), and timings."""
from __future__ import annotations

import contextlib
import datetime
import json
import math
import os
import sys
import threading
import time
import traceback
import zlib
from collections import defaultdict

import torch
import torch.distributed as dist

import superkernel  # noqa: F401  (registers "mk")
from superkernel.memory import TensorStore
from superkernel.memory.tensor_store import ALIGN, LOCK, TensorStoreFull

ALIGN = 4096
KiB, MiB = 1 << 10, 1 << 20
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.int16,
          torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128]

rank = world = 0
failures: dict[str, list[str]] = defaultdict(list)
timings: dict[str, float] = {}


def check(case: str, ok: bool, what: str) -> None:
    if not ok:
        failures[case].append(f"rank {rank}: {what}")


def gen(key: str, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(f"{key}/{shape}/{dtype}".encode()))
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_complex:
        return torch.randn(shape, generator=g, dtype=dtype)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -1000), min(info.max, 1000) + 1, shape, generator=g, dtype=torch.int64).to(dtype)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN-safe), dtype and shape included."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)) if a.numel() else True


def reserved(nbytes: int) -> int:
    return math.ceil(max(nbytes, 1) / ALIGN) * ALIGN if nbytes else 0


def case_cross_rank(store: TensorStore) -> None:
    """Every rank puts, every rank reads every rank's tensor; placement goes by free capacity."""
    c = "cross_rank"
    store.put(f"x/{rank}", gen(f"x/{rank}", (100 + rank, 33)))
    dist.barrier()
    for r in range(world):
        got = store.get(f"x/{r}")
        check(c, same(got, gen(f"x/{r}", (100 + r, 33))), f"x/{r} differs")
    # placement: with equal capacity, the one rank that got a large tensor is the least free one, so the
    # next put from it must land elsewhere (the rank with most free bytes)
    dist.barrier()
    if rank == 0:
        store.put("big", torch.zeros(256 * KiB, dtype=torch.uint8), rank=0)
        store.put("next", torch.ones(10))
        where, nbytes = store.locate("next")
        check(c, where != 0 and nbytes == 40, f"'next' placed on rank {where} ({nbytes} B), expected another rank")
        free = {u.rank: u.free for u in store.stats()}
        check(c, free[0] == min(free.values()), f"free bytes per rank {free}")
    dist.barrier()
    check(c, store.exists("next") and store.locate("big") == (0, 256 * KiB), "exists/locate from another rank")


def case_concurrent(store: TensorStore) -> None:
    """All ranks put at once: private keys, and shared keys that every rank overwrites with its own value
    (different sizes per rank). Gets during the storm return a whole value of one rank, never a mix; after
    it, exactly one extent per live key is allocated."""
    c = "concurrent"
    n_private, n_shared, rounds = 40, 6, 4
    dist.barrier()
    for i in range(n_private):       # every other one pinned to rank 0: all ranks contend for one allocator
        key = f"c/p/{rank}/{i}"
        store.put(key, gen(key, (1 + (i * 37) % 900,)), rank=0 if i % 2 else None)
    for rnd in range(rounds):
        for j in range(n_shared):
            store.put(f"c/s/{j}", torch.full((500 + 300 * rank + j,), float(rank)))
            try:
                v = store.get(f"c/s/{(j + 1) % n_shared}")
            except KeyError:
                continue
            owner = int(v[0].item())
            check(c, 0 <= owner < world and v.numel() == 500 + 300 * owner + (j + 1) % n_shared
                  and bool((v == owner).all()), f"torn read of c/s/{(j + 1) % n_shared}: {v.numel()} elements")
    dist.barrier()
    keys = store.keys("c/")
    want = sorted([f"c/p/{r}/{i}" for r in range(world) for i in range(n_private)]
                  + [f"c/s/{j}" for j in range(n_shared)])
    check(c, keys == want, f"keys('c/') has {len(keys)} names, expected {len(want)}; "
                           f"missing {sorted(set(want) - set(keys))[:5]}, extra {sorted(set(keys) - set(want))[:5]}")
    used = 0
    for r in range(world):
        for i in range(n_private):
            key = f"c/p/{r}/{i}"
            ref = gen(key, (1 + (i * 37) % 900,))
            check(c, same(store.get(key), ref), f"{key} differs")
            used += reserved(ref.numel() * 4)
    for j in range(n_shared):
        v = store.get(f"c/s/{j}")
        owner = int(v[0].item())
        check(c, v.numel() == 500 + 300 * owner + j and bool((v == owner).all()), f"c/s/{j} is not a whole value")
        used += reserved(v.numel() * 4)
    st = store.stats()
    check(c, sum(u.used for u in st) == used, f"used {sum(u.used for u in st)} B, live keys reserve {used} B "
                                              "(leaked or double-freed space)")
    check(c, sum(u.objects for u in st) == len(want), f"objects {sum(u.objects for u in st)} != {len(want)}")


def case_keys_delete_reuse(store: TensorStore, c: str = "keys_delete_reuse") -> None:
    if rank == 0:
        for name in ("a/1", "a/2", "a/sub/3", "ab/4", "b/5"):
            store.put(name, torch.arange(10))
    dist.barrier()
    check(c, store.keys("a/") == ["a/1", "a/2", "a/sub/3"], f"keys('a/') = {store.keys('a/')}")
    check(c, store.keys("a") == ["a/1", "a/2", "a/sub/3", "ab/4"], f"keys('a') = {store.keys('a')}")
    check(c, len(store.keys()) == 5, f"keys() = {store.keys()}")
    dist.barrier()
    if rank == world - 1:
        store.delete("a/2")
        check(c, not store.exists("a/2"), "a/2 exists after delete")
        try:
            store.get("a/2")
            check(c, False, "get of a deleted key did not raise KeyError")
        except KeyError:
            pass
        counting = _CountingStore(store._store)
        store._store = counting
        try:
            with store_route(worker=False):
                store.put("a/2", torch.arange(3))   # re-put after delete: listed once
        finally:
            store._store = counting.inner
        # the first guess is the tombstone this process wrote: one record round trip, not two
        check(c, counting.calls.get("compare_set") == 1, f"re-put after this rank's delete: {counting.calls}")
    dist.barrier()
    check(c, store.keys("a/") == ["a/1", "a/2", "a/sub/3"], f"after delete+put keys('a/') = {store.keys('a/')}")
    check(c, same(store.get("a/2"), torch.arange(3)), "a/2 after re-put differs")
    dist.barrier()


class _CountingStore:
    """A c10d Store that counts the calls made through it."""

    def __init__(self, inner) -> None:  # noqa: ANN001
        self.inner = inner
        self.calls: dict[str, int] = {}

    def __getattr__(self, name: str):  # noqa: ANN204
        attr = getattr(self.inner, name)
        if not callable(attr):
            return attr

        def counted(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            self.calls[name] = self.calls.get(name, 0) + 1
            return attr(*args, **kwargs)
        return counted


@contextlib.contextmanager
def store_route(worker: bool):
    """TensorStore's Store calls on the Store worker thread (worker=True: as while this process keeps making
    them) or on the calling thread (False: as after a pause; a _CountingStore in store._store sees them)."""
    import superkernel.memory.tensor_store as ts

    before = ts._WARM_NS
    ts._WARM_NS = 1 << 62 if worker else 0
    try:
        yield
    finally:
        ts._WARM_NS = before


class _StoreWithoutListing:
    """A c10d Store seen through an API without ``list_keys`` (custom Stores may lack it)."""

    def __init__(self, inner) -> None:  # noqa: ANN001
        self.inner = inner

    def list_keys(self) -> list[str]:
        raise NotImplementedError("list_keys")

    def __getattr__(self, name: str):  # noqa: ANN204
        return getattr(self.inner, name)


def case_keys_log(store: TensorStore) -> None:
    """The same listing, deletes and re-puts on a Store that cannot list keys (the append-only log)."""
    store._store = _StoreWithoutListing(store._store)
    store._listable = False
    if rank == 0:
        store._store.set("log", "")
    dist.barrier()
    case_keys_delete_reuse(store, "keys_log")


def case_reuse(store: TensorStore) -> None:
    """Fill one rank's memory completely, free every other chunk (fragmented), then all (coalesced), then
    one put of nearly the whole capacity must fit: deleted space is reused."""
    c = "reuse"
    cap = store.capacities[0]
    target = world - 1
    if rank == 0:
        chunk = 64 * KiB
        names: list[str] = []
        try:
            while True:
                names.append(f"fill/{len(names)}")
                store.put(names[-1], torch.full((chunk,), len(names) % 251, dtype=torch.uint8), rank=target)
        except TensorStoreFull as e:
            names.pop()
            check(c, str(e).startswith(f"TensorStore full: rank {target} of"), f"pinned-full message: {e}")
        check(c, len(names) == cap // chunk, f"{len(names)} chunks fitted, expected {cap // chunk}")
        for i, name in enumerate(names):
            check(c, same(store.get(name), torch.full((chunk,), (i + 1) % 251, dtype=torch.uint8)), f"{name} differs")
        for name in names[::2]:
            store.delete(name)
        u = store.stats()[target]
        check(c, (u.used, u.largest_free, u.free_extents) == (cap // 2, chunk, len(names[::2])),
              f"after freeing every other chunk: used {u.used}, largest free {u.largest_free}, "
              f"{u.free_extents} extents")
        for name in names[1::2]:
            store.delete(name)
        u = store.stats()[target]
        check(c, (u.used, u.objects, u.free_extents, u.largest_free) == (0, 0, 1, cap),
              f"after deleting all: used {u.used}, objects {u.objects}, {u.free_extents} extents, "
              f"largest {u.largest_free} (capacity {cap})")
        store.put("whole", torch.zeros(cap - ALIGN, dtype=torch.uint8), rank=target)
        check(c, store.locate("whole") == (target, cap - ALIGN), "the large re-put did not land on the emptied rank")
    dist.barrier()
    if rank == target:
        check(c, store.keys() == ["whole"] and same(store.get("whole"), torch.zeros(cap - ALIGN, dtype=torch.uint8)),
              f"keys {store.keys()}")
    dist.barrier()


def case_full(store: TensorStore) -> None:
    """A full pool refuses with a clear message and evicts nothing."""
    c = "full"
    cap = store.capacities[0]
    key = f"f/{rank}"
    store.put(key, gen(key, (cap // 4 * 3 // 4,)))   # 3/4 of a rank, float32
    dist.barrier()
    if rank == 0:
        try:
            store.put("too-big", torch.zeros(cap // 2, dtype=torch.uint8))
            check(c, False, "a put larger than any free extent succeeded")
        except TensorStoreFull as e:
            msg = str(e)
            mib = cap / MiB
            free = cap - reserved(cap // 4 * 3 // 4 * 4)
            want = (f"TensorStore full: {world} ranks × {mib:.0f} MiB capacity, {free // KiB} KiB free at most on "
                    f"one rank, cannot place {cap // 2 // KiB} KiB")
            check(c, msg == want, f"message: {msg!r} (expected {want!r})")
        try:
            store.put("huge", torch.zeros(cap + 1, dtype=torch.uint8))
            check(c, False, "a put larger than a rank's capacity succeeded")
        except TensorStoreFull:
            pass
    dist.barrier()
    for r in range(world):
        k = f"f/{r}"
        check(c, same(store.get(k), gen(k, (cap // 4 * 3 // 4,))), f"{k} changed after a refused put (evicted?)")
    check(c, not store.exists("too-big") and not store.exists("huge"), "a refused key exists")
    check(c, sum(u.objects for u in store.stats()) == world, "object count changed by refused puts")


def case_large(store: TensorStore, nbytes: int) -> None:
    c = "large"
    src = world - 1
    key = "large"
    shape = (nbytes // 4 // 1024, 1024)
    if rank == src:
        store.put(key, gen(key, shape), rank=0 if world > 1 else None)
    dist.barrier()
    if rank != src or world == 1:
        out = torch.empty(shape)
        t0 = time.perf_counter()
        store.get(key, out=out)
        timings["large_get_s"] = time.perf_counter() - t0
        check(c, same(out, gen(key, shape)), f"{nbytes} B tensor differs")
    dist.barrier()


def case_dtypes(store: TensorStore) -> None:
    c = "dtypes"
    shapes = [(), (0,), (3, 0, 2), (7,), (5, 3, 2)]
    if rank == 0:
        for dt in DTYPES:
            for i, shape in enumerate(shapes):
                store.put(f"d/{dt}/{i}", gen(f"d/{dt}", shape, dt))
        t = gen("nc", (64, 48)).t()               # non-contiguous input
        store.put("d/noncontig", t)
        nan = torch.tensor([float("nan"), -0.0, float("inf")])
        store.put("d/special", nan)
    dist.barrier()
    if rank == world - 1:
        for dt in DTYPES:
            for i, shape in enumerate(shapes):
                got = store.get(f"d/{dt}/{i}")
                check(c, same(got, gen(f"d/{dt}", shape, dt)), f"{dt} shape {shape} differs "
                                                                 f"(got {got.dtype} {tuple(got.shape)})")
        check(c, same(store.get("d/noncontig"), gen("nc", (64, 48)).t().contiguous()), "non-contiguous input")
        check(c, same(store.get("d/special"), torch.tensor([float("nan"), -0.0, float("inf")])), "nan/-0/inf")
        out = torch.empty(5, 3, 2, dtype=torch.bfloat16)
        r = store.get(f"d/{torch.bfloat16}/4", out=out)
        check(c, r is out and same(out, gen(f"d/{torch.bfloat16}", (5, 3, 2), torch.bfloat16)), "get(out=)")
    dist.barrier()


def case_errors(store: TensorStore) -> None:
    c = "errors"
    store.put(f"e/{rank}", torch.zeros(4, 5))

    def expect(exc: type, fn, what: str, needle: str = "") -> None:  # noqa: ANN001
        try:
            fn()
            check(c, False, f"{what}: no {exc.__name__}")
        except exc as e:
            check(c, needle in str(e), f"{what}: message {e!r} lacks {needle!r}")
        except Exception as e:  # noqa: BLE001
            check(c, False, f"{what}: {type(e).__name__} instead of {exc.__name__}: {e}")

    expect(KeyError, lambda: store.get("e/missing"), "get missing")
    expect(KeyError, lambda: store.delete("e/missing"), "delete missing")
    expect(KeyError, lambda: store.locate("e/missing"), "locate missing")
    expect(TypeError, lambda: store.get(f"e/{rank}", out=torch.zeros(4, 5, dtype=torch.float64)), "out dtype",
           "torch.float64")
    expect(ValueError, lambda: store.get(f"e/{rank}", out=torch.zeros(5, 4)), "out shape", "(5, 4)")
    expect(ValueError, lambda: store.get(f"e/{rank}", out=torch.zeros(4, 5).t()), "out shape (transposed)", "(5, 4)")
    store.put(f"e/nc{rank}", gen("e/nc", (4, 5)))
    nc = torch.zeros(5, 4).t()                 # non-contiguous out of the right shape: filled via a CPU copy
    check(c, store.get(f"e/nc{rank}", out=nc) is nc and torch.equal(nc, gen("e/nc", (4, 5))), "non-contiguous out")
    expect(ValueError, lambda: store.put("", torch.zeros(1)), "empty key")
    expect(ValueError, lambda: store.put("a\nb", torch.zeros(1)), "newline key")
    expect(TypeError, lambda: store.put("e/x", [1, 2]), "not a tensor")
    expect(ValueError, lambda: store.put("e/x", torch.zeros(1), rank=world), "rank out of range")
    check(c, store.exists(f"e/{rank}") and not store.exists("e/x"), "state after errors")
    expect(ValueError, lambda: store.get(f"e/nc{rank}", out=torch.zeros(5, 4).t().t()), "out shape", "(5, 4)")
    # a writer that never finishes (its extent's version stays odd): get gives up after the timeout, naming
    # the extent, instead of spinning forever; once the version is even again the value is served
    dist.barrier()
    owner, _ = store.locate("e/0")
    rec = store._known.get("e/0").rec if rank == 0 else None
    if rank == 0:
        word = store._versions + rec.offset // ALIGN
        v = int(store._meta.compare_swap(owner, word, -1, -1))   # read: -1 is never a version
        check(c, v % 2 == 0 and int(store._meta.compare_swap(owner, word, v, v + 1)) == v, "could not stall e/0")
    dist.barrier()
    saved, store.timeout = store.timeout, 0.3
    t0 = time.monotonic()
    expect(TimeoutError, lambda: store.get("e/0"), "get of a value whose writer stalls", "did not finish")
    check(c, 0.25 < time.monotonic() - t0 < 5, f"the stalled get took {time.monotonic() - t0:.2f} s (timeout 0.3 s)")
    store.timeout = saved
    dist.barrier()
    if rank == 0:
        store._meta.compare_swap(owner, word, v + 1, v + 2)
    dist.barrier()
    check(c, torch.equal(store.get("e/0"), torch.zeros(4, 5)), "e/0 after its writer finished")
    dist.barrier()
    # freeing an extent twice is refused (nothing changes), so a bug cannot make two tensors share bytes
    if rank == 0:
        store.put("e/twice", torch.ones(1000))
        rec = store._known.get("e/twice").rec
        store.delete("e/twice")
        before = store.stats()[rec.rank]
        expect(RuntimeError, lambda: store._free(rec.rank, rec.offset, rec.reserved, 1), "a second free",
               "double free")
        expect(RuntimeError, lambda: store._free(rec.rank, store.capacities[rec.rank], ALIGN, 1),
               "a free beyond the capacity", "are not allocated")
        check(c, store.stats()[rec.rank] == before, f"refused frees changed the usage: {before} -> "
                                                    f"{store.stats()[rec.rank]}")
    dist.barrier()


def case_subgroup(store: TensorStore) -> None:
    """A store over an mk subgroup of every rank but rank 0 (group ranks differ from global ranks), alive
    next to the whole-world store: keys and space of the two are separate."""
    c = "subgroup"
    members = list(range(1, world)) if world > 1 else [0]
    g = dist.new_group(members, backend="mk")
    store.put(f"world/{rank}", torch.tensor([rank]))
    if rank in members:
        sub = TensorStore(g, capacity_per_rank=256 * KiB)
        me = members.index(rank)
        check(c, (sub.rank, sub.world_size) == (me, len(members)), f"group rank/size {(sub.rank, sub.world_size)}")
        sub.put(f"sub/{rank}", gen(f"sub/{rank}", (1000,)))
        dist.barrier(group=g)
        for r in members:
            check(c, same(sub.get(f"sub/{r}"), gen(f"sub/{r}", (1000,))), f"sub/{r} differs")
        check(c, sub.keys() == sorted(f"sub/{r}" for r in members), f"subgroup keys {sub.keys()}")
        check(c, len(sub.stats()) == len(members) and sum(u.objects for u in sub.stats()) == len(members),
              f"subgroup stats {sub.stats()}")
        where, _ = sub.locate(f"sub/{rank}")
        check(c, 0 <= where < len(members), f"placement {where} is not a group rank")
        dist.barrier(group=g)
        sub.free()
    dist.barrier()
    check(c, store.keys() == sorted(f"world/{r}" for r in range(world)), f"world store keys {store.keys()}")


def case_uneven(store: TensorStore) -> None:
    """Ranks contribute different capacities ((rank + 1) x 256 KiB): stats report them, a tensor that only
    the largest rank can hold lands there, and a bigger one is refused with the pool's total."""
    c = "uneven"
    caps = [(r + 1) * 256 * KiB for r in range(world)]
    check(c, [u.capacity for u in store.stats()] == caps, f"capacities {[u.capacity for u in store.stats()]}")
    if rank == 0:
        size = caps[-1] - 64 * KiB
        store.put("only-the-largest", torch.zeros(size, dtype=torch.uint8))
        check(c, store.locate("only-the-largest") == (world - 1, size), f"placed {store.locate('only-the-largest')}")
        try:
            store.put("nowhere", torch.zeros(caps[-1], dtype=torch.uint8))
            check(c, False, "a tensor larger than every free extent was placed")
        except TensorStoreFull as e:
            def fmt(n: int) -> str:
                if n >= MiB:
                    return f"{n // MiB} MiB" if n % MiB == 0 else f"{n / MiB:.1f} MiB"
                return f"{n // KiB} KiB"
            largest = caps[-2] if world > 1 else caps[-1] - (caps[-1] - 64 * KiB)
            want = (f"TensorStore full: {world} ranks, {fmt(sum(caps))} capacity in total, {fmt(largest)} free at "
                    f"most on one rank, cannot place {fmt(caps[-1])}")
            check(c, str(e) == want, f"message {str(e)!r}, expected {want!r}")
    dist.barrier()


def case_in_place(store: TensorStore) -> None:
    """Overwrites with the same dtype and shape are written in place (the record stays); what another rank
    cached is never served stale after a put, put in place or delete completed; every rank overwrites shared
    keys (in place, and with new shapes) and deletes them while the others read: every get is one whole
    value, never a mix, and the space accounting stays exact."""
    c = "in_place"
    n = 64 * KiB   # float32: 256 KiB per value
    other = 1 % world
    if rank == 0:
        store.put("ip/a", torch.full((n,), 1.0), rank=other)
        rec = store._read("ip/a")
        store.put("ip/a", torch.full((n,), 2.0))
        check(c, store._read("ip/a") == rec, "an overwrite with the same dtype and shape published a new record")
        check(c, bool((store.get("ip/a") == 2.0).all()), "get after a put in place is not the new value")
        store.put("ip/a", torch.full((n + 1,), 3.0))
        check(c, store._read("ip/a") != rec, "an overwrite with another shape kept the old record")
        store.put("ip/a", torch.full((n,), 4.0))
        store.put("ip/b", torch.full((n,), 0.0))
    dist.barrier()
    v = store.get("ip/a")
    check(c, v.shape == (n,) and bool((v == 4.0).all()), f"ip/a on rank {rank}: {v.shape}, {v[:2].tolist()}")
    # every rank caches ip/b; then the last rank changes it in each way, the others must see each change
    got = store.get("ip/b")
    check(c, bool((got == 0.0).all()), "ip/b differs")
    steps = [("in place", lambda: store.put("ip/b", torch.full((n,), 1.0)), 1.0, (n,)),
             ("new shape", lambda: store.put("ip/b", torch.full((n + 7,), 2.0)), 2.0, (n + 7,)),
             ("pinned elsewhere", lambda: store.put("ip/b", torch.full((n + 7,), 3.0), rank=0), 3.0, (n + 7,)),
             ("in place again", lambda: store.put("ip/b", torch.full((n + 7,), 4.0)), 4.0, (n + 7,))]
    for what, step, value, shape in steps:
        dist.barrier()
        if rank == world - 1:
            step()
        dist.barrier()
        got = store.get("ip/b")
        check(c, tuple(got.shape) == shape and bool((got == value).all()),
              f"after another rank's put ({what}) get returned shape {tuple(got.shape)}, {got[:2].tolist()}")
    dist.barrier()
    if rank == world - 1:
        store.delete("ip/b")
    dist.barrier()
    try:
        store.get("ip/b")
        check(c, False, "a key deleted by another rank was still served from the cache")
    except KeyError:
        pass
    # the storm
    keys = [f"ip/s/{j}" for j in range(3)]
    if rank == 0:
        for k in keys:
            store.put(k, torch.full((n,), -1.0))
    dist.barrier()
    reads = 0
    for i in range(120):
        value = float(rank * 1000 + i)
        shape = (n + rank + 1,) if i % 20 == 19 else (n,)
        if i % 40 == 39 and world > 1:
            try:
                store.delete(keys[(i + rank) % 3])
            except KeyError:
                pass
        else:
            store.put(keys[(i + rank) % 3], torch.full(shape, value))
        try:
            got = store.get(keys[(i + rank + 1) % 3])
        except KeyError:
            continue
        reads += 1
        first = float(got[0])
        writer = int(first) // 1000 if first >= 0 else -1
        ok_shape = got.numel() == n or (writer >= 0 and got.numel() == n + writer + 1)
        check(c, bool((got == first).all()) and ok_shape,
              f"torn or wrong read of {keys[(i + rank + 1) % 3]}: {got.numel()} elements, first {first}, "
              f"{int((got != first).sum())} differ")
    check(c, reads > 0, "no read succeeded during the storm")
    dist.barrier()
    live, used = 0, 0
    for k in keys:
        if store.exists(k):
            got = store.get(k)
            check(c, bool((got == got[0]).all()), f"{k} is not one whole value after the storm")
            live += 1
            used += reserved(got.numel() * 4)
    used += reserved(n * 4)     # ip/a
    st = store.stats()
    check(c, sum(u.used for u in st) == used, f"used {sum(u.used for u in st)} B, live keys reserve {used} B")
    check(c, sum(u.objects for u in st) == live + 1, f"objects {sum(u.objects for u in st)} != {live + 1}")
    dist.barrier()


def case_publishing(store: TensorStore) -> None:
    """New tensors of >= 1 MiB are copied while their record is published on the Store worker thread: that
    path is taken exactly from 1 MiB; gets from other ranks during a storm of such puts return whole values;
    no space leaks; and a put whose copy fails leaves the key as it was (old value, or absent) with the
    space it had taken freed."""
    import superkernel.memory.tensor_store as ts

    c = "publishing"
    real = store._put_publishing
    overlapped = [0]

    def counting(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        overlapped[0] += 1
        return real(*args, **kwargs)

    store._put_publishing = counting
    try:
        for worker in (True, False):
            for n, want in ((MiB - 1, 0), (MiB, 1), (3 * MiB + 5, 1)):
                want = want if worker else 0     # after a pause in Store calls: the calling thread, no overlap
                before = overlapped[0]
                key = f"p/size/{rank}/{n}/{worker}"
                with store_route(worker):
                    store.put(key, gen(key, (n,), torch.uint8))
                check(c, overlapped[0] - before == want, f"a new {n} B tensor took the overlapped path "
                      f"{overlapped[0] - before} times, expected {want} (worker route: {worker})")
                check(c, same(store.get(key), gen(key, (n,), torch.uint8)), f"{key} differs")
        # the route follows the clock: a Store call makes the next ones within _WARM_NS go to the worker
        before = ts._WARM_NS
        try:
            ts._WARM_NS = 10 ** 9       # 1 s
            store.exists("p/size/none")
            check(c, ts._warm(), "no worker route right after a Store call")
            ts._WARM_NS = 5 * 10 ** 6   # 5 ms
            time.sleep(0.02)
            check(c, not ts._warm(), "still the worker route 20 ms after the last Store call (5 ms window)")
        finally:
            ts._WARM_NS = before
    finally:
        del store._put_publishing
    dist.barrier()
    # storm: every rank replaces shared keys with new >= 1 MiB tensors (a size of its own: never in place)
    # and reads the others' keys meanwhile
    shared = 3
    for rnd in range(4):
        for j in range(shared):
            n = MiB + 4096 * (1 + rank) + j
            store.put(f"p/s/{j}", torch.full((n,), rank + 1, dtype=torch.uint8))
            try:
                v = store.get(f"p/s/{(j + 1) % shared}")
            except KeyError:
                continue
            owner = int(v[0].item()) - 1
            check(c, 0 <= owner < world and v.numel() == MiB + 4096 * (1 + owner) + (j + 1) % shared
                  and bool((v == owner + 1).all()), f"torn read of p/s/{(j + 1) % shared}: {v.numel()} B")
    dist.barrier()
    used = sum(reserved(n) for n in (MiB - 1, MiB, 3 * MiB + 5)) * world * 2
    for j in range(shared):
        used += reserved(store.get(f"p/s/{j}").numel())
    st = store.stats()
    check(c, sum(u.used for u in st) == used, f"used {sum(u.used for u in st)} B, live keys reserve {used} B")
    dist.barrier()
    if rank == 0:       # a copy that fails after the record went out
        old = gen("p/u", (MiB,), torch.uint8)
        store.put("p/u", old)
        used0, objects0 = sum(u.used for u in store.stats()), sum(u.objects for u in store.stats())
        real_put = store._data.put

        def failing(*args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
            raise RuntimeError("injected copy failure")

        store._data.put = failing
        try:
            for key in ("p/u", "p/u-new"):
                try:
                    with store_route(worker=True):   # the overlapped path
                        store.put(key, gen("p/u2", (2 * MiB,), torch.uint8))
                    check(c, False, f"put({key!r}) with a failing copy succeeded")
                except RuntimeError as e:
                    check(c, "injected" in str(e), f"put({key!r}) raised another error: {e}")
        finally:
            store._data.put = real_put
        check(c, same(store.get("p/u"), old), "after a failed put the key does not hold its old value")
        check(c, not store.exists("p/u-new"), "a new key whose put failed exists")
        st = store.stats()
        check(c, (sum(u.used for u in st), sum(u.objects for u in st)) == (used0, objects0),
              f"a failed put left used/objects {sum(u.used for u in st)}/{sum(u.objects for u in st)}, "
              f"before {used0}/{objects0}")
    dist.barrier()
    # a copy that fails after rank 1 deleted the key (replacing the failed put's record): rank 1's delete
    # frees the failed put's extent, rank 0 frees the one its put had replaced, nothing comes back
    st = store.stats()
    base = (sum(u.used for u in st), sum(u.objects for u in st))
    dist.barrier()      # every rank has its baseline before rank 0's put below changes the usage
    if rank == 0:
        store.put("p/d", gen("p/d", (MiB,), torch.uint8))
        first = store._read("p/d")
        real_put = store._data.put

        def published_then_fail(*args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
            while store._read("p/d") == first:   # our record goes out on the worker thread
                time.sleep(0.001)
            dist.barrier()                         # rank 1 deletes now, replacing our record
            time.sleep(0.3)
            raise RuntimeError("injected copy failure")

        store._data.put = published_then_fail
        try:
            with store_route(worker=True):   # the overlapped path
                store.put("p/d", gen("p/d2", (2 * MiB,), torch.uint8))
            check(c, False, "put with a failing copy succeeded")
        except RuntimeError as e:
            check(c, "injected" in str(e), f"put raised another error: {e}")
        finally:
            store._data.put = real_put
    else:
        dist.barrier()
        if rank == 1:
            store.delete("p/d")   # waits for rank 0's version to turn even before it frees the extent
    dist.barrier()
    st = store.stats()
    check(c, not store.exists("p/d"), "a deleted key came back after the failed put")
    check(c, (sum(u.used for u in st), sum(u.objects for u in st)) == base,
          f"after a failed put whose record was deleted meanwhile: used/objects "
          f"{sum(u.used for u in st)}/{sum(u.objects for u in st)}, expected {base[0]}/{base[1]}")
    dist.barrier()


def case_cold_get(store: TensorStore) -> None:
    """A get of a key this process has not seen yet costs one c10d Store round trip when the owner's memory is
    mapped here (same host: the free counter validates the copy), two otherwise (the record is read again);
    the next get of it none. An empty tensor costs one."""
    c = "cold_get"
    if rank == 0:
        for r in range(world):
            store.put(f"g/{r}", gen(f"g/{r}", (1000 + r,)), rank=r)
        store.put("g/empty", torch.empty(0, 3))
    dist.barrier()
    if rank != 0:
        import superkernel.memory.tensor_store as ts

        real_store, real_c = store._store, ts._C
        for worker in (False, True):
            # on this thread every round trip is one compare_set through store._store; on the worker thread,
            # one store_compare_set_async
            counted = _CountingStore(real_c if worker else real_store)
            name = "store_compare_set_async" if worker else "compare_set"

            def trips() -> int:
                return counted.calls.get(name, 0)

            route = "on the Store worker thread" if worker else "on the calling thread"
            if worker:
                ts._C = counted
            else:
                store._store = counted
            try:
                with store_route(worker):
                    for r in range(world):
                        store._known.pop(f"g/{r}", None)
                        near = store._data.transport(r) in ("self", "shm")
                        for want, what in ((1 if near else 2, "first"), (0, "second")):
                            n0 = trips()
                            got = store.get(f"g/{r}")
                            check(c, trips() - n0 == want, f"{what} get of a key on rank {r} ({store._data.transport(r)}, "
                                  f"{route}) took {trips() - n0} Store round trips, expected {want}")
                            check(c, same(got, gen(f"g/{r}", (1000 + r,))), f"g/{r} differs")
                    n0 = trips()
                    got = store.get("g/empty")
                    check(c, trips() - n0 == 1 and tuple(got.shape) == (0, 3), f"get of an empty tensor {route}")
            finally:
                store._store, ts._C = real_store, real_c
    dist.barrier()


def case_lock_waits(store: TensorStore) -> None:
    """The last rank holds rank 0's allocator lock (alive). Rank 0's put that needs it waits: until the store's
    timeout, then a TimeoutError names the holder; an interrupt (cancel_waits, as the notebook worker sends)
    ends the wait at once with CancelledError; once the holder lets go, the put goes through."""
    from superkernel.backend import cancel_waits
    from superkernel.memory import CancelledError

    c = "lock_waits"
    holder = world - 1
    store.timeout = 1.5
    if rank == holder:
        check(c, store._meta.compare_swap(0, LOCK, 0, rank + 1) == 0, "rank 0's allocator lock was taken")
    dist.barrier()
    if rank == 0:
        t0 = time.monotonic()
        try:
            store.put("waits", gen("waits", (1000,)), rank=0)
            check(c, False, "a put succeeded while another rank held the lock")
        except TimeoutError as e:
            waited = time.monotonic() - t0
            check(c, f"held by rank {holder}" in str(e) and "within 1.5 s" in str(e), f"timeout message: {e}")
            check(c, 1.4 < waited < 10, f"the timeout of 1.5 s came after {waited:.2f} s")
        store.timeout = 60
        timer = threading.Timer(0.2, cancel_waits)
        t0 = time.monotonic()
        timer.start()
        try:
            store.put("waits", gen("waits", (1000,)), rank=0)
            check(c, False, "a put succeeded while another rank held the lock")
        except CancelledError as e:
            waited = time.monotonic() - t0
            check(c, "cancelled by an interrupt" in str(e), f"cancel message: {e}")
            check(c, waited < 5, f"the interrupt took {waited:.2f} s to end the wait (timeout 60 s)")
        timer.join()
        check(c, store.stats()[0].objects == 0, "a failed put left an object behind")
    dist.barrier()
    if rank == holder:
        check(c, store._meta.compare_swap(0, LOCK, rank + 1, 0) == rank + 1, "the lock changed hands meanwhile")
    dist.barrier()
    if rank == 0:
        store.put("waits", gen("waits", (1000,)), rank=0)
        check(c, same(store.get("waits"), gen("waits", (1000,))), "the put after the lock came free")
    dist.barrier()


def case_dead_holder() -> None:
    """Rank 1 takes rank 0's allocator lock and exits. Rank 0's put that needs the lock must raise PeerError
    naming the dead holder soon after the transport noticed (not after the store's 60 s timeout), and what is
    already stored stays readable."""
    from superkernel.memory import PeerError

    c = "dead_holder"
    store = TensorStore(capacity_per_rank=1 * MiB, timeout=60)
    kept = gen("kept", (1000,))
    if rank == 0:
        store.put("kept", kept, rank=0)
    dist.barrier()
    if rank == 1:
        # taken (as the allocator does), never released: this process dies holding it
        assert store._meta.compare_swap(0, LOCK, 0, rank + 1) == 0
        dist.barrier()
        sys.stdout.flush()
        os._exit(0)
    dist.barrier()
    t0 = time.monotonic()
    try:
        store.put("new", gen("new", (1000,)), rank=0)
        check(c, False, "a put needing the dead rank's lock succeeded")
    except PeerError as e:
        msg = str(e)
        check(c, "held by rank 1" in msg and "gone" in msg and "rank 0's memory" in msg,
              f"PeerError does not say who holds which lock: {msg}")
        timings["dead_holder_message"] = msg
    except Exception as e:  # noqa: BLE001
        check(c, False, f"expected PeerError, got {type(e).__name__}: {e}")
    waited = time.monotonic() - t0
    timings["dead_holder_seconds"] = waited
    check(c, waited < 15, f"the error took {waited:.1f} s (the store's timeout is 60 s)")
    check(c, same(store.get("kept"), kept), "a tensor stored before the death is no longer readable")


def case_dead_writer(mode: str) -> None:
    """Rank 1 dies in the middle of a put into rank 0's memory: a put of a new tensor after its record went out
    (mode "publish"), or a put in place (mode "inplace"). Rank 0's get of the key must raise PeerError naming
    rank 1 soon after the transport noticed (not after the store's 60 s timeout), and deleting the key, then
    putting it again, must work."""
    from superkernel.memory import PeerError

    c = "dead_writer"
    store = TensorStore(capacity_per_rank=8 * MiB, timeout=60)
    if rank == 0:
        store.put("w", gen("w", (MiB,), torch.uint8), rank=0)
    dist.barrier()
    if rank == 1:
        first = store._read("w")
        store.get("w")      # now rank 1 knows the record (and its version): a same-shape put goes in place

        def die(*args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
            while mode == "publish" and store._read("w") == first:   # our record goes out first
                time.sleep(0.001)
            dist.barrier()
            sys.stdout.flush()
            os._exit(0)     # the version word stays odd, naming rank 1

        store._data.put = die
        shape = (MiB,) if mode == "inplace" else (2 * MiB,)
        with store_route(worker=True):   # "publish": the record goes out during the copy
            store.put("w", gen("w2", shape, torch.uint8), rank=0)
    dist.barrier()
    # as a process that has not read the key (rank 0 itself may still read the old value on its fast path in
    # mode "publish": the dead put never freed the old extent, so for rank 0 it never completed)
    store._known.pop("w", None)
    t0 = time.monotonic()
    try:
        store.get("w")
        check(c, False, "a get of a tensor whose writer died returned")
    except PeerError as e:
        check(c, "rank 1" in str(e) and "gone" in str(e), f"PeerError does not name the dead writer: {e}")
        timings["dead_writer_message"] = str(e)
    except Exception as e:  # noqa: BLE001
        check(c, False, f"expected PeerError, got {type(e).__name__}: {e}")
    timings["dead_writer_get_seconds"] = time.monotonic() - t0
    check(c, time.monotonic() - t0 < 15, f"the get's error took {time.monotonic() - t0:.1f} s (timeout 60 s)")
    t0 = time.monotonic()
    try:
        store.delete("w")
        again = gen("w3", (3000,))
        store.put("w", again, rank=0)
        check(c, same(store.get("w"), again), "the key put again after the dead writer reads back wrong")
    except Exception as e:  # noqa: BLE001
        check(c, False, f"delete/put after the dead writer failed: {type(e).__name__}: {e}")
    check(c, time.monotonic() - t0 < 15, f"delete and put took {time.monotonic() - t0:.1f} s (timeout 60 s)")


def run(name: str, fn, *args) -> None:  # noqa: ANN001
    t0 = time.perf_counter()
    try:
        fn(*args)
    except Exception:  # noqa: BLE001
        failures[name].append(f"rank {rank}: {traceback.format_exc()[-1500:]}")
        sys.stderr.write(f"case {name} failed on rank {rank}:\n{traceback.format_exc()}")   # before any hang
    timings[name] = time.perf_counter() - t0


def main() -> None:
    global rank, world
    import faulthandler

    faulthandler.dump_traceback_later(150, exit=True)   # a hang shows where, before world.py's kill
    large = int(sys.argv[1]) if len(sys.argv) > 1 and sys.argv[1].isdigit() else 64 * MiB
    # a case that fails on one rank leaves the others in a barrier: let it time out instead of hanging
    dist.init_process_group("mk", timeout=datetime.timedelta(seconds=40))
    rank, world = dist.get_rank(), dist.get_world_size()
    from superkernel.backend import transports

    dead = {"--dead-holder": ("dead_holder", case_dead_holder, ()),
            "--dead-writer=publish": ("dead_writer", case_dead_writer, ("publish",)),
            "--dead-writer=inplace": ("dead_writer", case_dead_writer, ("inplace",))}
    mode = next((a for a in sys.argv[1:] if a in dead), None)
    if mode is not None:
        name, fn, extra = dead[mode]
        run(name, fn, *extra)
        sys.stdout.write("REPORT " + json.dumps({"rank": rank, "world": world, "transports": transports(),
                                                 "failures": dict(failures), "cases": [name],
                                                 "timings": timings}) + "\n")
        sys.stdout.flush()
        os._exit(0)   # the group lost a rank: skip the collective teardown
    cases = [
        ("cross_rank", case_cross_rank, 4 * MiB, ()),
        ("concurrent", case_concurrent, 4 * MiB, ()),
        ("keys_delete_reuse", case_keys_delete_reuse, 1 * MiB, ()),
        ("keys_log", case_keys_log, 1 * MiB, ()),
        ("reuse", case_reuse, 1 * MiB, ()),
        ("full", case_full, 1 * MiB, ()),
        ("large", case_large, large + 8 * MiB, (large,)),
        ("dtypes", case_dtypes, 2 * MiB, ()),
        ("errors", case_errors, 1 * MiB, ()),
        ("subgroup", case_subgroup, 1 * MiB, ()),
        ("uneven", case_uneven, (rank + 1) * 256 * KiB, ()),
        ("in_place", case_in_place, 4 * MiB, ()),
        ("publishing", case_publishing, 16 * MiB, ()),
        ("cold_get", case_cold_get, 1 * MiB, ()),
        ("lock_waits", case_lock_waits, 1 * MiB, ()),
    ]
    for name, fn, cap, extra in cases:
        store = TensorStore(capacity_per_rank=cap, timeout=60)
        run(name, fn, store, *extra)
        store.free()
    rep = {"rank": rank, "world": world, "transports": transports(), "failures": dict(failures),
           "cases": [c[0] for c in cases], "timings": timings}
    sys.stdout.write("REPORT " + json.dumps(rep) + "\n")
    sys.stdout.flush()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
