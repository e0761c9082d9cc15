"""One-sided windows: expose a tensor to the group, then read, write and atomically update any rank's
exposed tensor without that rank taking part (RDMA-style "RAM as a service").

Semantics follow MPI-3 passive-target RMA (``MPI_Win_lock_all`` epochs) and OpenSHMEM:

* **Memory.** Each rank exposes a block of elements (ranks may expose different sizes; all the same
  dtype). Ranks on the same host map each other's blocks (memfd shared memory) and operate on them with
  plain loads/stores and atomic instructions: truly one-sided, the target's threads are not involved.
  Between hosts the tcp provider's progress thread at the target executes each operation, whatever the
  target's Python thread is doing (computing, sleeping, blocked in a collective).
* **Offsets and lengths** are in elements of the window's dtype, over the flattened exposed tensor. The
  number of elements moved is ``src.numel()`` / ``out.numel()``; src/out must be CPU tensors of the window's
  dtype (``out`` contiguous; a non-contiguous ``src`` is copied first).
* **Atomicity.** ``put``/``get`` are not atomic: concurrent conflicting accesses to the same element race
  (as in MPI). ``accumulate`` (sum, min, max) is atomic per element against other accumulates and the
  int64 atomics from any rank; ``fetch_add`` and ``compare_swap`` (int64 windows) are atomic and return the
  old value. bf16/fp16 accumulate in fp32 and round once per element.
* **Completion.** A blocking call returns when the operation is complete at the target (same host: the
  stores are done; over tcp: the target acknowledged; so a blocking put is also remotely complete). With
  ``async_op=True`` the call returns a ``WindowFuture`` at once (torch.distributed's convention);
  ``future.wait()`` returns the result (None, or the old int64), ``future.done()`` polls. The src/out
  tensors must not be touched until then. ``flush(rank)`` completes every operation this rank issued to
  ``rank``; ``flush_all()`` to every rank (OpenSHMEM ``quiet``, MPI ``Win_flush_all``).
* **Ordering.** ``fence(rank)``: operations issued to ``rank`` before the fence are performed before those
  issued after it (OpenSHMEM ``fence``). Over tcp one origin's operations to one target are executed in
  issue order anyway; on one host operations are performed when they are issued.
* **Notification.** ``put(..., notify=tag)`` (0 <= tag < 1024) increments the target's counter ``tag``
  after the put's data is visible there (release). ``wait_notify(tag)`` on the target waits until the
  counter is non-zero, consumes **one** arrival (decrements it) and returns; the data of that put is then
  visible (acquire). Several notified puts with one tag are counted, each ``wait_notify`` takes one.
* **Collectives.** Creating a window and ``free()`` are collective over the group (every rank, in the same
  order). ``free()`` completes this rank's outstanding operations, waits (timeout: the group's, or
  ``timeout=``) for every rank to reach free, then stops exposing the block; a rank that never comes makes
  ``free`` raise ``TimeoutError`` on the others instead of hanging. Using a freed window raises
  ``RuntimeError``. ``win.tensor`` stays valid after free (it is then this rank's private memory).
* **Errors.** Rank, offset or tag out of range: ``IndexError``; wrong dtype: ``TypeError``; bad op or a
  non-CPU tensor or a non-contiguous ``out``: ``ValueError``; a wait past its deadline: ``TimeoutError``; the target
  process died or the group was aborted: ``PeerError`` (a ``RuntimeError``) naming window, op and rank; an
  interrupt (``superkernel.backend.cancel_waits``): ``CancelledError``.
* **Interrupts and aborts.** An interrupt ends the *wait*, not the operation: a get or put whose data are
  still crossing carries on, ``out`` is written (or ``src`` read) until it completes, ``flush(rank)`` waits
  for that, and the window stays usable. Aborting the group (``group.abort()``, or a collective on it that
  was interrupted or lost a peer) fails every outstanding operation at once with ``PeerError``; nothing
  writes into their buffers afterwards, the peers waiting on this rank hear of it, ``free()`` releases the
  block at once and raises ``PeerError`` (not every rank could be told), and a new group is needed (tests/memory/test_window_interrupt.py, two hosts over 100 Mbit/s).

The window needs the ``mk`` backend (``dist.init_process_group("mk")`` or ``"cpu:mk,..."``); ranks are ranks
of ``group`` (a subgroup made with ``dist.new_group(..., backend="mk")`` works, with its own numbering).
Waits without ``timeout=`` use the group's timeout; every wait can be interrupted by
``superkernel.backend.cancel_waits()``.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

from superkernel import _C
from superkernel.backend import BACKEND_NAME, cpu_backend

PeerError = _C.PeerError
CancelledError = _C.CancelledError
WindowFuture = _C.WindowFuture

__all__ = ["CancelledError", "PeerError", "Window", "WindowFuture"]


def _mk_backend(group: dist.ProcessGroup | None):
    if not dist.is_initialized():
        raise RuntimeError("superkernel Window: torch.distributed is not initialised "
                           "(call dist.init_process_group('mk') first)")
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    try:
        backend = cpu_backend(pg)
    except RuntimeError as e:
        raise RuntimeError(f"superkernel Window needs the {BACKEND_NAME!r} backend for CPU tensors; this group "
                           f"has none ({e})") from None
    name = backend.name() if hasattr(backend, "name") else type(backend).__name__
    if name != BACKEND_NAME:
        raise RuntimeError(f"superkernel Window needs the {BACKEND_NAME!r} backend (init_process_group('mk') or "
                           f"'cpu:mk,cuda:nccl'); this group's CPU backend is {name!r}")
    return backend


class Window:
    """A one-sided window over ``group`` (the default group when None). See the module docstring.

    ``Window(tensor, group)`` exposes ``tensor`` (contiguous, CPU; collective). Its storage is moved into
    shared window memory: the contents are copied in and ``tensor`` is re-pointed (``tensor.set_``) at the
    window memory, so the same tensor object keeps working and sees remote writes. Views of ``tensor``
    created *before* the window keep the old storage and do not see them. ``Window.allocate(shape, dtype)``
    lets the library allocate a zero-filled tensor instead.

    ``put``, ``get``, ``accumulate``, ``fetch_add``, ``compare_swap``, ``flush`` and ``flush_all`` are bound
    per window to C++ builtins with the signatures, results and errors of the methods documented here (a
    subclass that overrides one keeps its override), so a same-host operation costs well under a microsecond.
    """

    def __init__(self, tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> None:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"superkernel Window: expected a tensor, got {type(tensor).__name__}")
        if tensor.device.type != "cpu":
            raise ValueError(f"superkernel Window: the tensor must be on the CPU, got {tensor.device}")
        if not tensor.is_contiguous():
            raise ValueError("superkernel Window: the tensor must be contiguous")
        # the contents are copied in before any peer can see the block
        self._impl = _C.Window(_mk_backend(group), tensor.numel(), tensor.dtype, tensor.detach().reshape(-1))
        local = self._impl.local_tensor()
        with torch.no_grad():
            tensor.set_(local.untyped_storage(), 0, tensor.shape, tensor.stride())
        self._tensor = tensor
        self._group = group
        self._bind_fast_ops()

    @classmethod
    def allocate(cls, shape: int | Sequence[int], dtype: torch.dtype,
                 group: dist.ProcessGroup | None = None) -> "Window":
        """Collective: allocate a zero-filled window tensor of ``shape`` on this rank (ranks may differ)."""
        shape = (int(shape),) if isinstance(shape, int) else tuple(int(s) for s in shape)
        if any(s < 0 for s in shape):
            raise ValueError(f"superkernel Window.allocate: negative dimension in shape {shape}")
        win = cls.__new__(cls)
        win._impl = _C.Window(_mk_backend(group), math.prod(shape), dtype)
        win._tensor = win._impl.local_tensor().view(shape)
        win._group = group
        win._bind_fast_ops()
        return win

    def _bind_fast_ops(self) -> None:
        # The hot operations go straight to C++: the builtins from _impl.fast_ops() have the signatures and
        # semantics of the methods below (which stay the documented API and the path a subclass that
        # overrides one of them keeps), and cost no Python frame per call.
        for name, fn in self._impl.fast_ops().items():
            if getattr(type(self), name) is getattr(Window, name):
                self.__dict__[name] = fn

    # ---- introspection ----
    @property
    def tensor(self) -> torch.Tensor:
        """This rank's exposed tensor (window memory: remote puts and accumulates land in it)."""
        return self._tensor

    @property
    def rank(self) -> int:
        return self._impl.rank

    @property
    def world_size(self) -> int:
        return self._impl.world_size

    @property
    def dtype(self) -> torch.dtype:
        return self._tensor.dtype

    @property
    def freed(self) -> bool:
        return self._impl.freed

    def size(self, rank: int) -> int:
        """Number of elements ``rank`` exposes."""
        return self._impl.size(rank)

    def transport(self, rank: int) -> str:
        """How this rank reaches ``rank``: 'self', 'shm' (direct mapped memory) or 'tcp'."""
        return self._impl.transport(rank)

    # ---- operations ----
    def put(self, rank: int, offset: int, src: torch.Tensor, notify: int | None = None,
            async_op: bool = False) -> WindowFuture | None:
        """Write ``src`` into ``rank``'s block at element ``offset``; with ``notify=tag`` bump the target's
        notify counter ``tag`` once the data is visible there. A non-contiguous ``src`` is copied first."""
        return self._impl.put(rank, offset, src, notify, async_op)

    def get(self, rank: int, offset: int, out: torch.Tensor, async_op: bool = False) -> WindowFuture | None:
        """Read ``out.numel()`` elements of ``rank``'s block from element ``offset`` into ``out``."""
        return self._impl.get(rank, offset, out, async_op)

    def accumulate(self, rank: int, offset: int, src: torch.Tensor, op: str = "sum",
                   async_op: bool = False) -> WindowFuture | None:
        """Element-wise atomic ``target[offset + i] = op(target[offset + i], src[i])``, op in sum/min/max."""
        return self._impl.accumulate(rank, offset, src, op, async_op)

    def fetch_add(self, rank: int, offset: int, value: int, async_op: bool = False) -> int | WindowFuture:
        """Atomically add ``value`` to the int64 at ``offset`` of ``rank``; returns the old value."""
        return self._impl.atomic(rank, offset, False, int(value), 0, async_op)

    def compare_swap(self, rank: int, offset: int, expected: int, desired: int,
                     async_op: bool = False) -> int | WindowFuture:
        """Atomically store ``desired`` at ``offset`` of ``rank`` if it holds ``expected``; returns the old
        value (equal to ``expected`` exactly when the swap happened)."""
        return self._impl.atomic(rank, offset, True, int(expected), int(desired), async_op)

    def flush(self, rank: int, timeout: float | None = None) -> None:
        """Complete (at the target) every operation this rank issued to ``rank``."""
        self._impl.flush(rank, timeout)

    def flush_all(self, timeout: float | None = None) -> None:
        """Complete every operation this rank issued, to any rank."""
        self._impl.flush_all(timeout)

    def fence(self, rank: int) -> None:
        """Order: operations to ``rank`` issued before are performed before those issued after."""
        self._impl.fence(rank)

    def wait_notify(self, tag: int, timeout: float | None = None) -> None:
        """Wait for one put with ``notify=tag`` to this rank and consume it (TimeoutError after ``timeout``
        seconds, default the group's timeout)."""
        self._impl.wait_notify(tag, timeout)

    def test_notify(self, tag: int) -> bool:
        """Consume one arrival of ``tag`` if there is one; never waits."""
        return self._impl.test_notify(tag)

    def free(self, timeout: float | None = None) -> None:
        """Collective: complete this rank's operations, wait for every rank, stop exposing the block.
        Calling it again on a freed window does nothing. A ``TimeoutError`` leaves the window exposed (call
        free again); when the group was aborted or a rank is gone, the block is released here all the same
        and ``PeerError`` says that not every rank could be told."""
        self._impl.free(timeout)

    def __enter__(self) -> "Window":
        return self

    def __exit__(self, *exc: object) -> None:
        self.free()

    def __repr__(self) -> str:
        state = "freed" if self.freed else f"{self.size(self.rank)} x {self.dtype}"
        return f"<superkernel Window #{self._impl.id} rank {self.rank}/{self.world_size}: {state}>"
