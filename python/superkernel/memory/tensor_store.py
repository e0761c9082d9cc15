"""``TensorStore``: a key -> tensor store pooled across the memory of every rank ("RAM as a service").

    store = TensorStore(capacity_per_rank="1GiB")     # collective: every rank of the group contributes
    store.put("weights/layer0", w)                     # from any rank; lands on the rank with most free space
    x = store.get("weights/layer0")                     # from any rank
    store.keys("weights/"), store.exists(k), store.delete(k), store.stats()

Design (everything below is what the code does; the tests check it):

* Memory. Every rank contributes one uint8 :class:`~superkernel.memory.Window` of ``capacity_per_rank`` bytes
  (the data) and one small int64 Window (its allocator). Tensor bytes move one-sidedly: ``put`` writes with
  ``Window.put`` into the chosen rank's memory, ``get`` reads with ``Window.get``; the owning rank's Python
  thread is never involved. An object lives whole on one rank (it is not striped), so the largest object
  is ``capacity_per_rank``. Nothing is ever evicted: a put that does not fit fails.
* Allocator. Each rank's allocator window holds a lock word, its used bytes, object count, capacity, and
  its free extents ``(offset, length)`` sorted by offset (coalesced: no two free extents touch). Any rank
  allocates or frees in any rank's memory by taking that rank's lock with ``compare_swap`` on the lock
  word (spinning with back-off, bounded by ``timeout``), reading the header and extents with ``get``,
  writing the changed parts back with ``put`` (blocking window operations are complete at the target when
  they return), then releasing the lock with ``compare_swap``. This runs in C++ (``PoolAllocator``,
  csrc/transport/pool_allocator.h), one call per allocation or free: as a dozen Python-level window
  operations it cost about 20 us of a 1 MiB put on one host.
  Allocations are rounded up to ``ALIGN`` (4 KiB) and placed best-fit. Because free extents are coalesced
  and at least one aligned block long, a rank never has more than ``capacity / (2 * ALIGN) + 1`` of them:
  the extent table is sized for that worst case and cannot overflow.
* Placement. A put reads every rank's header (used, capacity; no lock) and tries ranks in order of most
  free bytes first (ties: the putting rank itself, then lower ranks); a rank whose largest free extent is
  too small (fragmentation, or a concurrent put got there first) is skipped under its lock. When no rank
  can hold it: ``TensorStoreFull`` naming the pool's capacity, the largest free extent, and the size.
  ``put(key, t, rank=r)`` pins the placement to rank r instead; ``locate(key)`` says where a tensor is.
* Metadata. The record ``key -> (rank, offset, nbytes, dtype, shape, token)`` lives in torch's c10d Store
  (the job's TCPStore), under a prefix of its own per TensorStore instance. Records are replaced with
  ``compare_set`` only, and whoever replaces a record frees the extent it named: of two concurrent puts of
  one key, the later publisher replaces the earlier one's record and frees its extent, so exactly one
  extent per key stays allocated. Every record carries a unique token, so a record never reappears (no ABA;
  one exception, a put whose copy failed, see "Publishing during the copy").
  A deleted key's record becomes a tombstone ``"deleted <token>"`` rather than disappearing; it is unique
  too, so a ``compare_set`` that returns the value it was asked to store has stored it (of two concurrent
  deletes of one key, exactly one frees the extent; the other raises KeyError).
* Index. ``keys(prefix)`` lists the record keys under this store's prefix (``Store.list_keys``: TCPStore,
  FileStore and HashStore have it) and keeps those whose record (``multi_get``) is not a tombstone, so a put
  of a new key costs one Store round trip (hidden behind the copy from 1 MiB, below). A Store without
  ``list_keys`` gets an append-only log instead: each put of a new key (or one previously deleted) appends
  ``key + "\\n"`` to it with the Store's atomic ``append`` after publishing the record (so every name in
  the log has a record), a second round trip.
* Versions. Every allocated extent has a version word in its rank's allocator window (one int64 per
  ``ALIGN`` block, indexed by the extent's first block): even when the extent is at rest, odd while a put
  writes into it in place or a new put is still copying into it after publishing its record (below); an odd
  word also names the writer (its rank + 1 from bit 48 up). Freeing an extent waits until its version is
  even and advances it by 2 (under the allocator lock), so versions only grow and an extent is never freed
  under a writer. A writer that died never finishes: a get that waits on it raises ``PeerError`` naming it
  (checked every 50 ms, once the transport noticed the death), and a free ends its write and goes on, so
  the key can be put again or deleted.
* Publishing during the copy. A put into a new extent of at least ``_OVERLAP_BYTES`` (1 MiB), made while
  Store calls go to the worker thread (below), sets the extent's version odd, hands the record's first
  ``compare_set`` to that thread, copies the bytes meanwhile, sets the version even and then takes the
  Store's answer, so the round trip hides behind the copy (``bench/memory.py``'s "serial" column is the put
  without it). A get that finds the record before the bytes are there sees an odd version and waits, as for
  a put in place. If the copy fails, the key gets back the record the put had replaced (the only case where a
  record reappears; a process holding the failed put's record then finds its ``compare_set`` refused, as
  after any replacement). Smaller tensors publish after their copy: handing the call over costs more than it
  hides.
* Store calls. The record calls (``compare_set``) run on superkernel's Store worker thread
  (``csrc/store_worker.h``; this thread polls for the answer) while this process made a Store call within the
  last ``_WARM_NS`` (250 us, the time the worker keeps polling for its next call after one); after a pause they
  run on the calling thread. On a VM, waking a thread that sleeps on an idle core costs tens of microseconds
  and a sleeping Store client pays it at every answer, while a polling worker and a polling caller keep both
  cores awake: measured on this 2-core VM with 1 MiB tensors on the same host, a run of new-key puts or of
  cold gets took 41 and 58 us each on the worker against 135 and 136 us on the calling thread, but calls
  2 ms apart took 511 and 500 us on the worker (which had gone to sleep) against 197 and 187 us on the
  calling thread. ``bench/memory.py``'s "caller" columns are the runs with every call on the calling thread.
* Overwrite in place. When this process overwrites a key whose record it knows with a tensor of the same
  dtype and shape (and no other ``rank=``), the record stays as it is: the put takes the extent's version
  from v to v+1 with ``compare_swap`` (v is the version this process last saw: any free or other write
  since then makes the swap fail), writes the bytes, and sets v+2. No Store round trip and no allocator
  lock. If the swap fails, the ordinary put below runs (new extent, new record, old extent freed).
* Consistency of get. ``get`` reads the record, the extent's version, copies the bytes, reads the version
  and the record again: if the record changed (a concurrent overwrite or delete could have freed and
  reused the extent) or the version moved or was odd (a write in place), the copy is retried. A get
  therefore returns either the old or the new tensor, never a mix. Fast path, no Store round trip, when
  this process knows the key's record: read the owner's free counter (bumped under the lock by every free
  on that rank) and the version, copy, read both again. The counter must still be the value it had when
  the record was last seen current: every put or delete that replaces a record frees that record's
  extent before it returns, so an unchanged counter proves that no completed operation replaced the key.
  Otherwise (or on any change) the slow path above, with one Store round trip instead of two when the owner's
  memory is mapped here (same host): it reads the free counters of those ranks before the record (loads, no
  round trip), and an owner's counter unchanged after the copy proves the same as above, so the second read
  of the record is skipped. ``put``/``delete`` likewise first try ``compare_set``
  against the record this process last saw. A get that keeps finding the key changing, or a version that
  stays odd, gives up after ``timeout`` with a TimeoutError naming the extent.
* Ordering. Operations on one key are sequentially consistent: every process sees one order of the puts
  and deletes of a key, and each process sees its own operations in program order. A put in place that
  runs while another process's replacing put is between publishing its record and returning is ordered
  before that put (its bytes are overwritten by it), even though it started after the record was
  published; operations that do not overlap in time keep their real-time order.

Device tensors: the pool is host memory. ``put`` of a CUDA tensor copies it to the host first; ``get``
returns a CPU tensor, or fills a device (or non-contiguous) ``out`` through a host copy.

Limits: a rank that dies while holding an allocator lock leaves that rank's allocator locked: a put or delete
that needs it raises ``PeerError`` naming the dead holder as soon as the transport noticed the death (the
waiter checks the holder every 50 ms), instead of waiting out ``timeout``. The lock is not broken, because
the dead rank may have left the allocator half-written. A rank that dies while writing a tensor leaves a get
of that key raising ``PeerError`` (see Versions) until the key is put again or deleted. If the dead write was
a replacing put of >= 1 MiB whose record had gone out, the extent of the record it replaced stays allocated
(freeing it was the dead put's job), and a process that still knows the old record may read the old value
on its fast path. The pool is one job, and a dead rank ends it.
"""
from __future__ import annotations

import itertools
import threading
import time
import uuid
import weakref
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.distributed as dist

from superkernel import _C
from superkernel.byte_sizes import format_bytes, parse_bytes
from superkernel.memory.window import PeerError

ALIGN = 4096
DEFAULT_CAPACITY = 256 << 20
# allocator window layout (int64 elements)
# (csrc/transport/pool_allocator.h reads and writes this layout too)
LOCK, USED, OBJECTS, NFREE, CAPACITY, FREES = 0, 1, 2, 3, 4, 5
HEADER = 8        # then 2 * max_extents extent words, then one version word per ALIGN block
_HOLDER_PROBE = 0.05   # seconds between checks that the holder of a lock we wait for is alive
# A new tensor of at least this many bytes is copied while its record is published (the round trip hides
# behind the copy); a smaller one is published after its copy (waking the worker would cost more than it hides)
_OVERLAP_BYTES = 1 << 20
# Store calls go to the Store worker thread while this process made one within this many ns (the worker's
# linger, csrc/store_worker.h: it still polls, and the machine is awake); see "Store calls" in the docstring
_WARM_NS = 250_000
_last_store_call_ns = 0
# an odd version word carries its writer's rank + 1 from this bit up (the version itself stays below it)
_WRITER = 48   # = kWriter in csrc/transport/pool_allocator.h, which ends dead writers' writes
_MISSING = "\x00superkernel-missing\x00"   # never a record: compare_set(k, _MISSING, _MISSING) reads k
_TOMBSTONE = "deleted "                       # + a unique token: the record of a deleted key
_LIVE: "weakref.WeakSet[TensorStore]" = weakref.WeakSet()
_SEQ: dict[str, itertools.count] = {}
_SEQ_LOCK = threading.Lock()


class TensorStoreFull(RuntimeError):
    """No rank has a free extent large enough for the tensor (nothing is evicted to make room)."""


@dataclass(frozen=True)
class Record:
    rank: int            # -1 for an empty tensor (no bytes stored)
    offset: int          # bytes into that rank's data window
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    token: str

    @property
    def reserved(self) -> int:
        return _round_up(self.nbytes)

    def encode(self) -> str:
        return " ".join([str(self.rank), str(self.offset), str(self.nbytes), str(self.dtype).removeprefix("torch."),
                         ",".join(map(str, self.shape)) or "-", self.token])

    @staticmethod
    def decode(text: str) -> "Record":
        rank, offset, nbytes, dtype, shape, token = text.split(" ")
        dims = () if shape == "-" else tuple(int(s) for s in shape.split(","))
        return Record(int(rank), int(offset), int(nbytes), getattr(torch, dtype), dims, token)


@dataclass
class _Known:
    """What this process last saw of a key: its record, the owner's free counter at a moment when that
    record was current (None: unknown), and the extent's version as last seen at rest (None: unknown)."""
    text: str
    rec: Record
    frees: int | None
    version: int | None


@dataclass(frozen=True)
class RankUsage:
    rank: int
    capacity: int
    used: int
    objects: int
    free_extents: int
    largest_free: int

    @property
    def free(self) -> int:
        return self.capacity - self.used


def _writing(v: int, rank: int) -> int:
    """The odd version word that says "rank is writing this extent, which was at version v (even)"."""
    return v + 1 + ((rank + 1) << _WRITER)


def _writer(v: int) -> int:
    """The rank that wrote an odd version word (see _writing)."""
    return (v >> _WRITER) - 1


def _round_up(n: int) -> int:
    return (max(n, 1) + ALIGN - 1) // ALIGN * ALIGN


def live_stores() -> list["TensorStore"]:
    """The TensorStores of this process that are not freed (what ``%memory`` shows)."""
    return [s for s in list(_LIVE) if not s.freed]


class TensorStore:
    def __init__(self, group: Any = None, capacity_per_rank: int | str = DEFAULT_CAPACITY, *,
                 timeout: float = 60.0, name: str | None = None) -> None:
        """Collective over ``group`` (default: the whole job). Every rank contributes ``capacity_per_rank``
        bytes (ranks may pass different values). ``timeout`` bounds every wait for another rank's allocator
        lock and every c10d Store wait."""
        from superkernel.memory import Window

        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.timeout = timeout
        capacity = parse_bytes(capacity_per_rank)
        if capacity <= 0:
            raise ValueError(f"TensorStore: capacity_per_rank must be positive (got {capacity_per_rank!r})")
        capacity = _round_up(capacity)
        caps: list[Any] = [None] * self.world_size
        dist.all_gather_object(caps, capacity, group=group)
        self.capacities = [int(c) for c in caps]
        max_extents = max(self.capacities) // (2 * ALIGN) + 1
        self._versions = HEADER + 2 * max_extents       # first version word
        self._meta_len = self._versions + max(self.capacities) // ALIGN
        self._data = Window.allocate((capacity,), torch.uint8, group=group)
        self._meta = Window.allocate((self._meta_len,), torch.int64, group=group)
        self._max_extents = max_extents
        mine = self._meta.tensor
        mine[:HEADER] = 0
        mine[CAPACITY] = capacity
        mine[NFREE] = 1
        mine[HEADER] = 0
        mine[HEADER + 1] = capacity
        # one prefix per instance: the group's name plus how many stores this process made on that group
        # (construction is collective, so every rank counts the same)
        pg = group if group is not None else dist.distributed_c10d._get_default_group()
        gname = getattr(pg, "group_name", "default")
        with _SEQ_LOCK:
            seq = next(_SEQ.setdefault(gname, itertools.count()))
        self.name = name or f"{gname}/{seq}"
        self._store = dist.PrefixStore(f"superkernel/tensorstore/{self.name}/",
                                       dist.distributed_c10d._get_default_store())
        try:
            self._store.list_keys()
            self._listable = True
        except (RuntimeError, NotImplementedError):
            self._listable = False
            if self.rank == 0:
                self._store.set("log", "")
        self._tokens = itertools.count()
        # key -> what this process last saw of it (hints; every use is checked): see _Known
        self._known: dict[str, _Known] = {}
        # key -> the tombstone this process wrote when it deleted the key (the first guess of a later put)
        self._gone: dict[str, str] = {}
        self._scratch = torch.empty(1, dtype=torch.int64)
        # ranks whose allocator counters this process reads with plain loads (mapped memory): see get()
        self._near = [r for r in range(self.world_size) if self._meta.transport(r) in ("self", "shm")]
        # how long to wait for a Store call made on the worker thread: the Store's own timeout, plus a margin
        self._store_wait = self._store.timeout.total_seconds() + 10.0
        self._instance = uuid.uuid4().hex[:8]
        self.freed = False
        dist.barrier(group=group)
        _LIVE.add(self)

    # ------------------------------------------------------------------------------------------ public
    def put(self, key: str, tensor: torch.Tensor, rank: int | None = None) -> None:
        """Store a copy of ``tensor`` under ``key`` (replacing what was there). Any rank may put any key.
        ``rank`` pins the placement to that rank's memory (default: the rank with the most free bytes)."""
        self._check_open()
        _check_key(key)
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"TensorStore.put({key!r}): expected a torch.Tensor, got {type(tensor).__name__}")
        t = tensor.detach()
        if t.device.type != "cpu":
            t = t.cpu()      # the pool is host memory; device tensors travel through a host copy
        t = t.contiguous()
        nbytes = t.numel() * t.element_size()
        if rank is not None and not 0 <= rank < self.world_size:
            raise ValueError(f"TensorStore.put({key!r}): rank {rank} is not in the group (size {self.world_size})")
        known = self._known.get(key)
        if nbytes and known is not None and self._put_in_place(known, t, rank):
            return
        token = self._token()
        frees = version = None
        if nbytes == 0:
            rec = Record(-1, 0, 0, t.dtype, tuple(t.shape), token)
            text = rec.encode()
            old = self._publish(key, text)
        else:
            # nobody else knows the new extent before the record is published: its version is at rest, and
            # the counter read under the lock (before the record becomes current) is valid for get's fast path
            where, offset, version, frees = self._allocate(_round_up(nbytes), rank)
            rec = Record(where, offset, nbytes, t.dtype, tuple(t.shape), token)
            text = rec.encode()
            flat = t.reshape(-1).view(torch.uint8)
            if nbytes >= _OVERLAP_BYTES and self._on_worker():
                old = self._put_publishing(key, text, rec, version, flat)
                version += 2
            else:
                try:
                    self._data.put(where, offset, flat)  # complete at the target
                except BaseException:
                    self._free(where, offset, rec.reserved, objects=1)
                    raise
                old = self._publish(key, text)
        if old:
            o = Record.decode(old)
            if o.rank >= 0:
                before = self._free(o.rank, o.offset, o.reserved, objects=1)
                if frees is not None and o.rank == rec.rank:
                    # our own free bumped the counter: still valid if it was the only free since we read it
                    frees = frees + 1 if before == frees else None
        elif not self._listable:
            self._store.append("log", key + "\n")
        self._remember(key, text, rec, frees, version)

    def get(self, key: str, out: torch.Tensor | None = None) -> torch.Tensor:
        """A copy of the tensor stored under ``key`` (a new CPU tensor, or ``out`` when given: same dtype
        and shape; a non-contiguous or device ``out`` is filled through a CPU copy). KeyError when the key
        does not exist."""
        self._check_open()
        _check_key(key)
        if out is not None and (out.device.type != "cpu" or not out.is_contiguous()):
            got = self.get(key)
            self._check_out(key, got.dtype, tuple(got.shape), out)
            return out.copy_(got)
        known = self._known.get(key)
        if known is not None and known.frees is not None and known.rec.nbytes:
            # fast path, no Store round trip (see the module docstring): the owner's free counter unchanged
            # since the record was current, and the extent's version at rest and unchanged around the copy
            rec = known.rec
            dst = self._output(key, rec, out)
            if self._frees(rec.rank) == known.frees:
                v = self._version(rec.rank, rec.offset)
                if v % 2 == 0:
                    self._data.get(rec.rank, rec.offset, dst.reshape(-1).view(torch.uint8))
                    if self._version(rec.rank, rec.offset) == v and self._frees(rec.rank) == known.frees:
                        known.version = v
                        return dst
        # the free counters of the ranks whose memory is mapped here, read before the record (loads, no round
        # trip): if the owner's is unchanged after the copy, the record was current all along (see above)
        before = {r: self._frees(r) for r in self._near}
        text = self._read(key)
        deadline = time.monotonic() + self.timeout
        probe = time.monotonic() + _HOLDER_PROBE
        pause = 10e-6
        while True:
            if not text:
                self._known.pop(key, None)
                raise KeyError(key)
            rec = Record.decode(text)
            dst = self._output(key, rec, out)
            if not rec.nbytes:   # no bytes that a concurrent operation could tear
                self._remember(key, text, rec, None, None)
                return dst
            frees = self._frees(rec.rank)
            version = self._version(rec.rank, rec.offset)
            whole = version % 2 == 0
            if whole:
                self._data.get(rec.rank, rec.offset, dst.reshape(-1).view(torch.uint8))
                whole = self._version(rec.rank, rec.offset) == version
                if whole and before.get(rec.rank) == self._frees(rec.rank):
                    self._remember(key, text, rec, before[rec.rank], version)
                    return dst
            before = {}         # a retry validates with a second read of the record
            again = self._read(key)
            if again == text and whole:
                self._remember(key, text, rec, frees, version)
                return dst
            if time.monotonic() > deadline:
                raise TimeoutError(f"TensorStore.get({key!r}): rank {self.rank} could not read a whole value within "
                                   f"{self.timeout:g} s: the key kept changing, or a put writing rank {rec.rank}'s "
                                   f"extent at byte {rec.offset} did not finish")
            if again == text:
                if version % 2 and time.monotonic() > probe:    # writing for a while: is the writer alive?
                    if self._gone_error(_writer(version)) is not None:
                        raise PeerError(f"TensorStore.get({key!r}): rank {_writer(version)}, which was writing this "
                                        f"tensor (rank {rec.rank}'s extent at byte {rec.offset}), is gone: its bytes "
                                        f"are incomplete; put the key again or delete it")
                    probe = time.monotonic() + _HOLDER_PROBE
                time.sleep(pause)   # a put is writing: let it finish
                pause = min(1e-3, pause * 2)
            text = again     # overwritten or deleted while we copied: the extent may have been reused

    def delete(self, key: str) -> None:
        """Remove ``key`` and free its space. KeyError when it does not exist."""
        self._check_open()
        _check_key(key)
        tomb = f"{_TOMBSTONE}{self._token()}"
        old = self._publish(key, tomb)
        self._known.pop(key, None)
        if len(self._gone) > 100_000:
            self._gone.clear()
        self._gone[key] = tomb
        if not old:
            raise KeyError(key)
        o = Record.decode(old)
        if o.rank >= 0:
            self._free(o.rank, o.offset, o.reserved, objects=1)

    def locate(self, key: str) -> tuple[int, int]:
        """(rank, bytes) of the stored tensor: which rank's memory holds it (-1 for an empty tensor)."""
        self._check_open()
        _check_key(key)
        text = self._read(key)
        if not text:
            raise KeyError(key)
        rec = Record.decode(text)
        return rec.rank, rec.nbytes

    def exists(self, key: str) -> bool:
        self._check_open()
        _check_key(key)
        return bool(self._read(key))

    def keys(self, prefix: str = "") -> list[str]:
        """Every stored key starting with ``prefix``, sorted."""
        self._check_open()
        if self._listable:
            names = sorted(k[2:] for k in self._store.list_keys() if k.startswith("k/" + prefix))
        else:
            log = self._store.get("log").decode()
            names = sorted({k for k in log.split("\n") if k and k.startswith(prefix)})
        if not names:
            return []
        records = self._store.multi_get(["k/" + k for k in names])
        return [k for k, r in zip(names, records) if _live(r.decode())]

    def stats(self) -> list[RankUsage]:
        """Per rank: capacity, used bytes, objects, free extents and the largest one (a snapshot, no locks)."""
        self._check_open()
        out = []
        for r in range(self.world_size):
            out.append(RankUsage(r, *self._meta._impl.pool_usage(r, self._versions, ALIGN)))
        return out

    def free(self) -> None:
        """Release this rank's memory (collective). Stored tensors are gone afterwards."""
        if self.freed:
            return
        dist.barrier(group=self.group)
        self.freed = True
        self._data.free()
        self._meta.free()

    close = free

    def __enter__(self) -> "TensorStore":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.free()

    def __contains__(self, key: str) -> bool:
        return self.exists(key)

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.get(key)

    def __setitem__(self, key: str, value: torch.Tensor) -> None:
        self.put(key, value)

    def __delitem__(self, key: str) -> None:
        self.delete(key)

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    def __len__(self) -> int:
        return len(self.keys())

    def __repr__(self) -> str:
        total = sum(self.capacities)
        return (f"TensorStore({self.name!r}, {self.world_size} ranks x {format_bytes(self.capacities[0])}"
                f"{'' if len(set(self.capacities)) == 1 else ' (uneven)'}, {format_bytes(total)} in total)")

    # ----------------------------------------------------------------------------------------- records
    def _read(self, key: str) -> str:
        """The record of ``key``; "" when it does not exist (never stored, or deleted)."""
        return _live(self._compare_set(key, _MISSING, _MISSING))

    def _on_worker(self) -> bool:
        """Whether the next Store call goes to the Store worker thread: this process made one within the last
        ``_WARM_NS`` (see "Store calls" in the module docstring), and the Store is a c10d one (not a Python
        object standing in for it)."""
        return _warm() and isinstance(self._store, dist.Store)

    def _compare_set(self, key: str, expected: str, desired: str) -> str:
        """``compare_set`` of ``key``'s record, on the Store worker thread or on this one (_on_worker)."""
        if self._on_worker():
            got = self._answer(_C.store_compare_set_async(self._store, "k/" + key, expected, desired), key)
        else:
            got = self._store.compare_set("k/" + key, expected, desired).decode()
        _store_called()
        return got

    def _remember(self, key: str, text: str, rec: Record, frees: int | None, version: int | None) -> None:
        if len(self._known) > 100_000:
            self._known.clear()
        self._known[key] = _Known(text, rec, frees, version)

    def _put_in_place(self, known: _Known, t: torch.Tensor, rank: int | None) -> bool:
        """Overwrite the extent of ``known``'s record with ``t`` (same dtype and shape) under its version
        word; False (nothing written) when that is not possible and an ordinary put must run."""
        rec, v = known.rec, known.version
        if (v is None or rec.rank < 0 or t.dtype != rec.dtype or tuple(t.shape) != rec.shape
                or (rank is not None and rank != rec.rank)):
            return False
        word, odd = self._versions + rec.offset // ALIGN, _writing(v, self.rank)
        if int(self._meta.compare_swap(rec.rank, word, v, odd)) != v:
            known.version = None     # freed, or written by another process since: use the ordinary put
            return False
        try:
            self._data.put(rec.rank, rec.offset, t.reshape(-1).view(torch.uint8))   # complete at the target
        finally:
            got = int(self._meta.compare_swap(rec.rank, word, odd, v + 2))
        if got != odd:
            raise RuntimeError(f"TensorStore: rank {self.rank} wrote rank {rec.rank}'s extent at byte {rec.offset} in "
                               f"place but its version changed from {odd} to {got} meanwhile (a bug)")
        known.version = v + 2
        return True

    def _token(self) -> str:
        return f"{self.rank}.{self._instance}.{next(self._tokens)}"

    def _first_guess(self, key: str) -> str:
        """The record of ``key`` as this process last saw it, or the tombstone it wrote when it deleted it."""
        known = self._known.get(key)
        return known.text if known is not None else self._gone.pop(key, "")

    def _publish(self, key: str, value: str, expected: str | None = None, got: str | None = None) -> str:
        """Replace the record of ``key`` with ``value`` (unique) atomically; returns the live record it
        replaced ("" if the key was missing or deleted).
        The first guess of the current record is the one this process last saw, or the tombstone it wrote
        when it deleted the key (one round trip when right). ``expected`` and ``got``: a first compare_set
        already made (its guess and the Store's answer), to go on from."""
        if expected is None:
            expected = self._first_guess(key)
        for _ in range(10000):
            if got is None:
                got = self._compare_set(key, expected, value)
            if got == value:
                return _live(expected)
            # (FileStore and HashStore report a missing key as the expected value)
            expected, got = ("" if got == _MISSING else got), None
        raise RuntimeError(f"TensorStore: could not update the record of {key!r} (contention)")

    def _put_publishing(self, key: str, text: str, rec: Record, version: int, flat: torch.Tensor) -> str:
        """Copy ``flat`` into the new extent of ``rec`` while its record ``text`` is published: the first
        compare_set goes to superkernel's Store worker thread (csrc/store_worker.h) before the copy starts, so
        the round trip hides behind the copy. The extent's version is odd meanwhile, so a get that finds the
        record waits for the bytes, as it does for a put in place. Returns the live record it replaced.

        If the copy fails, the key gets back the record it had, and the copy's error is raised. (If another put
        or delete replaced our record meanwhile, that one frees our extent, and the record ours replaced is
        freed here, as any replaced record is.)"""
        where, word, odd = rec.rank, self._versions + rec.offset // ALIGN, _writing(version, self.rank)
        if int(self._meta.compare_swap(where, word, version, odd)) != version:
            raise RuntimeError(f"TensorStore: the version of rank {where}'s new extent at byte {rec.offset} changed "
                               f"before its record was published (a bug)")
        expected = self._first_guess(key)
        call = _C.store_compare_set_async(self._store, "k/" + key, expected, text)
        try:
            self._data.put(where, rec.offset, flat)  # complete at the target
        except BaseException:
            self._meta.compare_swap(where, word, odd, version + 2)
            self._unpublish(key, text, expected, call, rec)
            raise
        self._meta.compare_swap(where, word, odd, version + 2)
        return self._publish(key, text, expected, self._answer(call, key))

    def _answer(self, call: Any, key: str) -> str:
        """The Store's answer to a compare_set made on the worker thread; its error names this rank and key."""
        try:
            got = call.wait(self._store_wait).decode()
        except RuntimeError as e:
            raise RuntimeError(f"TensorStore: rank {self.rank}, Store call for the record of {key!r}: {e}") from e
        _store_called()
        return got

    def _unpublish(self, key: str, text: str, expected: str, call: Any, rec: Record) -> None:
        """(A put whose copy failed) Undo the publication of ``text`` if it happened and free our extent; if a
        later put or delete replaced our record first, it frees our extent, and we free the one we replaced."""
        try:
            if self._answer(call, key) == text:   # published: put back what it replaced
                if self._store.compare_set("k/" + key, text, expected).decode() != expected:
                    replaced = _live(expected)
                    if replaced and (o := Record.decode(replaced)).rank >= 0:
                        self._free(o.rank, o.offset, o.reserved, objects=1)
                    return
            self._free(rec.rank, rec.offset, rec.reserved, objects=1)
        except Exception:       # noqa: BLE001  (the copy's error is the one to report; an extent may leak)
            pass

    def _output(self, key: str, rec: Record, out: torch.Tensor | None) -> torch.Tensor:
        if out is None:
            return torch.empty(rec.shape, dtype=rec.dtype)
        self._check_out(key, rec.dtype, rec.shape, out)
        return out

    @staticmethod
    def _check_out(key: str, dtype: torch.dtype, shape: tuple[int, ...], out: torch.Tensor) -> None:
        if out.dtype != dtype:
            raise TypeError(f"TensorStore.get({key!r}): out has dtype {out.dtype}, the stored tensor is {dtype}")
        if tuple(out.shape) != shape:
            raise ValueError(f"TensorStore.get({key!r}): out has shape {tuple(out.shape)}, the stored tensor "
                             f"has shape {shape}")

    def _check_open(self) -> None:
        if self.freed:
            raise RuntimeError(f"TensorStore {self.name!r} was freed")

    # --------------------------------------------------------------------------------------- allocator
    def _gone_error(self, rank: int) -> PeerError | None:
        """The PeerError of a one-sided read of ``rank``'s allocator window once the transport noticed that rank
        died (shm: its process is gone; tcp: its connection), else None (alive, this process, or not a rank)."""
        if rank == self.rank or not 0 <= rank < self.world_size:
            return None
        try:
            self._meta.get(rank, LOCK, torch.empty(1, dtype=torch.int64))
        except PeerError as e:
            return e
        return None

    def _version(self, rank: int, offset: int) -> int:
        """The version word of the extent starting at byte ``offset`` of ``rank`` (odd: a put in place)."""
        self._meta.get(rank, self._versions + offset // ALIGN, self._scratch)
        return self._scratch.item()

    def _frees(self, rank: int) -> int:
        """How many frees ``rank``'s allocator has done (a seqlock-style generation for get's fast path)."""
        self._meta.get(rank, FREES, self._scratch)
        return self._scratch.item()

    def _allocate(self, need: int, only: int | None = None) -> tuple[int, int, int, int]:
        """(rank, offset, version, frees) of ``need`` free bytes, placed by free capacity (see the module
        docstring), or on rank ``only`` when given: the extent's version word, and the rank's free counter read
        under its lock. Runs in C++ (csrc/transport/pool_allocator.h) on the allocator windows."""
        where, offset, version, frees, largest = self._meta._impl.pool_allocate(
            need, -1 if only is None else only, self._versions, ALIGN, self.timeout)
        if where >= 0:
            return where, offset, version, frees
        caps = set(self.capacities)
        pool = (f"{self.world_size} ranks × {format_bytes(self.capacities[0])} capacity" if len(caps) == 1
                else f"{self.world_size} ranks, {format_bytes(sum(self.capacities))} capacity in total")
        if only is not None:
            pool = f"rank {only} of {pool}"
        raise TensorStoreFull(f"TensorStore full: {pool}, {format_bytes(largest)} free at most on one rank, "
                              f"cannot place {format_bytes(need)}")

    def _free(self, rank: int, offset: int, length: int, objects: int) -> int:
        """Return [offset, offset+length) to ``rank``'s free extents, coalescing with its neighbours, once a put
        writing into it finished (or its writer is gone). Returns ``rank``'s free counter as it was before this
        free. C++ (csrc/transport/pool_allocator.h)."""
        return self._meta._impl.pool_release(rank, offset, length, objects, self._versions, ALIGN, self.timeout)


def _warm() -> bool:
    """Whether this process made a Store call within the last ``_WARM_NS``."""
    return time.monotonic_ns() - _last_store_call_ns < _WARM_NS


def _store_called() -> None:
    global _last_store_call_ns
    _last_store_call_ns = time.monotonic_ns()


def _live(text: str) -> str:
    """``text`` when it is a record, "" when it says the key is missing or deleted."""
    return "" if not text or text == _MISSING or text.startswith(_TOMBSTONE) else text


def _check_key(key: str) -> None:
    if not isinstance(key, str) or not key or "\n" in key:
        raise ValueError(f"TensorStore: a key is a non-empty string without newlines (got {key!r})")
