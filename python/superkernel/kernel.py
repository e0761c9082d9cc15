"""SuperKernel: an ipykernel kernel that runs every cell on a rank pool and merges what the ranks print.

The kernel process never imports torch. It owns

* a local IPython shell (from ``IPythonKernel``): the notebook-side namespace for ``%%local``, ``%pull``,
  ``%push``, history and ``is_complete``;
* a :class:`~superkernel.pool.Pool` of ranks, started in the background when the kernel starts;
* one :class:`CellRun` at a time: the per-rank state of the running cell. The pool's dispatcher thread
  feeds it events and ticks; merged output is published on IOPub from that thread as it arrives.

Settings come from the environment the kernelspec sets: ``SUPERKERNEL_FLAVOR`` (torch|mpi|plain),
``SUPERKERNEL_RANKS`` (ranks per host), ``SUPERKERNEL_BACKEND``, ``SUPERKERNEL_LAUNCHER_ARGS``,
``SUPERKERNEL_BIND`` (a reachable address for a pool spanning hosts, see :mod:`superkernel.join`),
``SUPERKERNEL_JOIN_FILE``, ``SUPERKERNEL_START_TIMEOUT``, ``SUPERKERNEL_LAUNCHER`` (torchrun | srun),
``SUPERKERNEL_INTERRUPT_GRACE`` (seconds a rank gets to honour an interrupt before SIGTERM/SIGKILL).
"""
from __future__ import annotations

import asyncio
import collections
import os
import shlex
import signal
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from ipykernel.ipkernel import IPythonKernel

from superkernel import __version__
from superkernel.magics import front_side
from superkernel.merge import (ErrorInfo, StreamMerger, display_token, format_ranks, group_errors, merge_results,
                              render_lines, split_displays)
from superkernel.pool import Death, Pool, PoolSpec, PoolStartError, default_nranks
from superkernel.protocol import Event

REQUEST_TIMEOUT = 5.0
# run on every rank (no name left in the namespace) when a cell's replies say its default group is aborted
REMAKE_DEFAULT_GROUP = '__import__("superkernel.default_group", fromlist=["remake"]).remake()'


@dataclass
class CellRun:
    """The state of one cell running on a set of ranks."""

    ranks: list[int]
    parent: dict[str, Any]
    msg_id: str
    loop: asyncio.AbstractEventLoop
    done: asyncio.Event
    mergers: dict[str, StreamMerger]
    label: bool
    results: dict[int, dict[str, Any]] = field(default_factory=dict)
    replies: dict[int, dict[str, Any]] = field(default_factory=dict)
    deaths: list[Death] = field(default_factory=list)
    progress_ids: dict[tuple[str, int], str] = field(default_factory=dict)
    last_set: dict[str, tuple[int, ...]] = field(default_factory=dict)  # rank set of the last line, per stream
    displays: dict[str, dict[str, Any]] = field(default_factory=dict)  # DisplayToken -> display_data content
    cleared: bool = False
    finished: bool = False
    interrupted_at: float | None = None
    timed_out: float | None = None
    escalated: list[int] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)

    def pending(self) -> list[int]:
        dead = {d.rank for d in self.deaths}
        return [r for r in self.ranks if r not in self.replies and r not in dead]


class SuperKernel(IPythonKernel):
    implementation = "superkernel"
    implementation_version = __version__
    banner = "SuperKernel: every cell runs on every rank of a torchrun/mpirun pool"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        env = os.environ
        self.flavor = env.get("SUPERKERNEL_FLAVOR", "torch")
        nranks = int(env.get("SUPERKERNEL_RANKS", "0") or 0) or default_nranks()
        self.spec = PoolSpec(
            flavor=self.flavor,
            nranks=nranks,
            backend=env.get("SUPERKERNEL_BACKEND") or None,
            launcher_args=shlex.split(env.get("SUPERKERNEL_LAUNCHER_ARGS", "")),
            bind_ip=env.get("SUPERKERNEL_BIND", "127.0.0.1"),
            start_timeout=float(env.get("SUPERKERNEL_START_TIMEOUT", "180")),
            join_file=env.get("SUPERKERNEL_JOIN_FILE") or None,
            launcher=env.get("SUPERKERNEL_LAUNCHER") or None,
        )
        self.output_mode = env.get("SUPERKERNEL_OUTPUT", "collapse")
        self.max_lines = int(env.get("SUPERKERNEL_MAX_LINES", "1000"))
        self.cell_timeout: float | None = None
        self.interrupt_grace = float(env.get("SUPERKERNEL_INTERRUPT_GRACE", "3"))
        self.pool: Pool | None = None
        self.pool_down: str | None = None
        self._cell: CellRun | None = None
        self._lock = threading.RLock()
        self._requests: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Future[Event]]] = {}
        self._last_lines: dict[int, collections.deque[str]] = collections.defaultdict(
            lambda: collections.deque(maxlen=5))
        self._pool_starter: threading.Thread | None = None
        self._restarting = threading.Event()  # an automatic restart (after escalation) is under way
        self._interrupted = threading.Event()  # an interrupt while waiting for the pool to start
        self._local_running = False            # a %%local cell runs in this process
        self.start_pool()

    # ---------------------------------------------------------------------------------------- kernel info
    @property
    def kernel_info(self) -> dict[str, Any]:
        info = super().kernel_info
        info["debugger"] = False  # the debugger would only see the kernel process, not the ranks
        return info

    # -------------------------------------------------------------------------------------------- pool
    def start_pool(self, nranks: int | None = None) -> None:
        if nranks:
            self.spec.nranks = nranks
        self.pool_down = None
        pool = Pool(self.spec, self)
        self.pool = pool

        def run() -> None:
            try:
                pool.start()
                pool.wait_ready()
                self.log.info("pool ready: %d ranks in %.1f s", pool.world_size, pool.ready_at - pool.started_at)
            except Exception as e:
                self.log.error("pool failed to start: %s", e)

        self._pool_starter = threading.Thread(target=run, name="superkernel-pool-start", daemon=True)
        self._pool_starter.start()

    def stop_pool(self) -> None:
        pool, self.pool = self.pool, None
        if pool is not None:
            pool.close()
            if self._pool_starter is not None:
                self._pool_starter.join(timeout=5)

    async def restart_pool(self, nranks: int | None, parent: dict[str, Any]) -> str:
        loop = asyncio.get_running_loop()
        t0 = time.monotonic()
        await loop.run_in_executor(None, self.stop_pool)
        self.start_pool(nranks)
        await self.ensure_pool(parent)
        return f"pool restarted: {self.spec.nranks} ranks ready in {time.monotonic() - t0:.1f} s"

    async def ensure_pool(self, parent: dict[str, Any]) -> Pool:
        """The running pool, waiting for it (with a progress display) if it is still starting."""
        if self._restarting.is_set():
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(None, lambda: _wait_clear(self._restarting, 60))
        pool = self.pool
        if pool is None:
            raise PoolStartError("no pool: %restart starts one")
        if self.pool_down:
            raise PoolStartError(self.pool_down)
        if pool.ready.is_set():
            return pool
        from tqdm import tqdm

        if pool.join_file:
            self._send("stream", {"name": "stderr", "text": (
                f"this pool spans hosts: on each other host run `superkernel join {pool.join_file}` (copy the "
                "file there first; it holds the pool's key: keep it private)\n")}, parent)
        display_id = uuid.uuid4().hex
        writer = _DisplayWriter(self, parent, display_id)
        bar = tqdm(total=pool.world_size, desc=f"starting {self.flavor} pool", unit="rank", file=writer,
                   mininterval=0, ascii=True, bar_format="{desc}: {n}/{total} ranks ready [{elapsed}]")

        def progress(n: int, total: int) -> None:
            bar.n = n
            bar.refresh()

        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(None, lambda: pool.wait_ready(progress=progress, cancel=self._interrupted))
        finally:
            bar.close()
        return pool

    # ----------------------------------------------------------------------- events (dispatcher thread)
    def on_event(self, ev: Event) -> None:
        with self._lock:
            req = self._requests.pop(ev.parent_id or "", None)
            if req is not None:
                loop, fut = req
                loop.call_soon_threadsafe(_resolve, fut, ev)
                return
            cell = self._cell
            if cell is None or cell.finished or ev.parent_id != cell.msg_id:
                if ev.msg_type == "stream":
                    self.log.info("[rank %d, outside a cell] %s", ev.rank, ev.msg["content"].get("text", "").rstrip())
                return
            content = ev.msg["content"]
            kind = ev.msg_type
            if kind == "stream":
                cell.mergers.setdefault(content["name"], self._new_merger(cell.ranks)).add(
                    ev.rank, content["text"], time.monotonic())
                self._publish_ready(cell)
            elif kind == "execute_result":
                cell.results[ev.rank] = content.get("data", {})
            elif kind == "display_data" and not (content.get("transient") or {}).get("display_id"):
                # through the stdout merger: identical displays of several ranks collapse into one, and
                # each stays in its place among the rank's printed lines
                token = display_token(content)
                cell.displays.setdefault(token, content)
                cell.mergers.setdefault("stdout", self._new_merger(cell.ranks)).add_item(
                    ev.rank, token, time.monotonic())
                self._publish_ready(cell)
            elif kind in ("display_data", "update_display_data"):
                self._publish_ready(cell, final=False, hold=False)
                meta = dict(content.get("metadata") or {})
                meta["superkernel"] = {"rank": ev.rank, "ranks": [ev.rank]}
                out = dict(content, metadata=meta)
                self._send(kind, out, cell.parent)
            elif kind == "clear_output":
                self._publish_ready(cell, final=False, hold=False)
                if not cell.cleared or ev.rank == min(cell.ranks):
                    cell.cleared = True
                    self._send("clear_output", content, cell.parent)
            elif kind == "execute_reply":
                cell.replies[ev.rank] = content
                for m in cell.mergers.values():
                    m.finish(ev.rank, time.monotonic())
                self._publish_ready(cell)
                if not cell.pending():
                    cell.loop.call_soon_threadsafe(cell.done.set)

    def on_tick(self) -> None:
        with self._lock:
            cell = self._cell
            if cell is not None and not cell.finished:
                self._publish_ready(cell)
                self._maybe_escalate(cell)

    def on_death(self, deaths: list[Death]) -> None:
        with self._lock:
            note = "; ".join(d.describe() for d in deaths)
            if self.pool_down is None and not self._restarting.is_set():
                self.pool_down = f"the pool is down: {note}. Run %restart to bring it back."
            self.log.error("pool: %s", note)
            if self.pool is not None:
                self.log.error("launcher output:\n%s", self.pool.launcher_tail())
            cell = self._cell
            if cell is not None and not cell.finished:
                cell.deaths.extend(d for d in deaths if d.rank in cell.ranks)
                cell.deaths.sort(key=lambda d: d.order)
                if cell.deaths:
                    cell.loop.call_soon_threadsafe(cell.done.set)

    # ------------------------------------------------------------------------------------- publishing
    def _new_merger(self, ranks: list[int]) -> StreamMerger:
        return StreamMerger(ranks, mode=self.output_mode, max_lines=self.max_lines)

    def _send(self, msg_type: str, content: dict[str, Any], parent: dict[str, Any]) -> None:
        self.session.send(self.iopub_socket, msg_type, content, parent, ident=self._topic(msg_type))

    def _publish_ready(self, cell: CellRun, final: bool = False, hold: bool = True) -> None:
        now = time.monotonic() + (0 if hold else 3600)
        for name, merger in cell.mergers.items():
            for up in merger.progress_updates():
                key = (name, up.rank)
                text = f"[rank {up.rank}] {up.text}" if cell.label else up.text
                if key not in cell.progress_ids:
                    cell.progress_ids[key] = uuid.uuid4().hex
                    kind = "display_data"
                else:
                    kind = "update_display_data"
                self._send(kind, {"data": {"text/plain": text}, "metadata": {},
                                  "transient": {"display_id": cell.progress_ids[key]}}, cell.parent)
            for kind, run in split_displays(merger.take(now, final=final)):
                if kind == "display":
                    rs, token = run[0]
                    content = cell.displays[token]
                    meta = dict(content.get("metadata") or {})
                    meta["superkernel"] = {"rank": rs[0], "ranks": list(rs)}
                    self._send("display_data", dict(content, metadata=meta), cell.parent)
                    cell.last_set.pop(name, None)  # the next line is labelled again
                    continue
                for rs, line in run:
                    for r in rs:
                        self._last_lines[r].append(line)
                text = render_lines(run, label=cell.label, after=cell.last_set.get(name))
                cell.last_set[name] = tuple(run[-1][0])
                self._send("stream", {"name": name, "text": text}, cell.parent)

    # -------------------------------------------------------------------------------------- execution
    async def do_execute(self, code: str, silent: bool, store_history: bool = True,
                         user_expressions: dict[str, Any] | None = None, allow_stdin: bool = False,
                         *, cell_meta: Any = None, cell_id: Any = None) -> dict[str, Any]:
        parent = self.get_parent("shell")
        shell = self.shell
        assert shell is not None
        self._interrupted.clear()
        try:
            split = front_side.split_cell(code)
        except front_side.FrontMagicError as e:
            return self._error_reply(parent, "UsageError", str(e), [f"UsageError: {e}"])
        if split.cell_magic == "local":
            self._local_running = True
            try:
                return await super().do_execute(split.body, silent, store_history, user_expressions, allow_stdin)
            finally:
                self._local_running = False

        count = shell.execution_count
        if store_history:
            shell.history_manager.store_inputs(count, code, code)
            shell.execution_count += 1
        try:
            for name, args in split.line_magics:
                text = await front_side.run_line_magic(self, name, args, parent)
                if text:
                    self._send("stream", {"name": "stdout", "text": text.rstrip("\n") + "\n"}, parent)
        except front_side.FrontMagicError as e:
            return self._error_reply(parent, "UsageError", str(e), [f"UsageError: {e}"], count)
        except PoolStartError as e:
            return self._error_reply(parent, "PoolError", str(e), [f"PoolError: {e}"], count)
        if not split.body.strip():
            return {"status": "ok", "execution_count": count, "user_expressions": {}, "payload": []}

        try:
            pool = await self.ensure_pool(parent)
        except PoolStartError as e:
            return self._error_reply(parent, "PoolError", str(e), [f"PoolError: {e}"], count)
        ranks = split.ranks if split.ranks is not None else list(range(pool.world_size))
        if split.cell_magic == "rank":
            bad = [r for r in ranks if r >= pool.world_size]
            if bad:
                return self._error_reply(parent, "UsageError", f"rank {bad[0]} does not exist (world size "
                                         f"{pool.world_size})", [], count)
            warning = front_side.collective_warning(split.body, ranks, pool.world_size)
            if warning:
                self._send("stream", {"name": "stderr", "text": warning + "\n"}, parent)
        return await self._run_on_ranks(pool, ranks, split.body, silent, store_history,
                                        user_expressions or {}, parent, count)

    async def _run_on_ranks(self, pool: Pool, ranks: list[int], code: str, silent: bool, store_history: bool,
                            user_expressions: dict[str, Any], parent: dict[str, Any], count: int,
                            remake: bool = True) -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        msg_id = uuid.uuid4().hex
        cell = CellRun(ranks=ranks, parent=parent, msg_id=msg_id, loop=loop, done=asyncio.Event(),
                       mergers={}, label=pool.world_size > 1)
        cell.mergers["stdout"] = self._new_merger(ranks)
        cell.mergers["stderr"] = self._new_merger(ranks)
        content = {"code": code, "silent": silent, "store_history": store_history,
                   "user_expressions": user_expressions if ranks and ranks[0] == min(ranks) else {},
                   "execution_count": count}
        with self._lock:
            self._cell = cell
        try:
            for r in ranks:  # zmq sends do not block: every rank has the cell before any can block in it
                pool.send(r, "execute_request", content, msg_id=msg_id)
        except ConnectionError as e:
            with self._lock:
                cell.finished = True
                self._cell = None
            return self._error_reply(parent, "PoolError", str(e), [f"PoolError: {e}"], count)
        try:
            if self.cell_timeout:
                try:
                    await asyncio.wait_for(asyncio.shield(cell.done.wait()), self.cell_timeout)
                except asyncio.TimeoutError:
                    with self._lock:
                        cell.timed_out = self.cell_timeout
                    self.interrupt_cell(cell)
                    await cell.done.wait()
            else:
                await cell.done.wait()
        finally:
            with self._lock:
                cell.finished = True
                self._publish_ready(cell, final=True)
                self._cell = None
        reply = self._finish_cell(cell, count, silent)
        if remake and not cell.deaths and any(rep.get("mk_aborted") for rep in cell.replies.values()):
            # the default group's mk communicator was aborted on some rank (an interrupt): every rank makes it
            # again (superkernel.default_group), its note in this cell's output
            await self._run_on_ranks(pool, list(range(pool.world_size)), REMAKE_DEFAULT_GROUP, True, False, {},
                                     parent, count, remake=False)
        return reply

    def _finish_cell(self, cell: CellRun, count: int, silent: bool) -> dict[str, Any]:
        parent = cell.parent
        if cell.results and not silent:
            data = merge_results(cell.results, label=cell.label)
            self._send("execute_result", {"data": data, "metadata": {}, "execution_count": count}, parent)
        errors: dict[int, ErrorInfo] = {}
        for r, rep in sorted(cell.replies.items()):
            if rep.get("status") == "error":
                errors[r] = ErrorInfo(rep.get("ename", "Error"), rep.get("evalue", ""),
                                      tuple(rep.get("traceback", [])))
        notes: list[str] = []
        if cell.deaths:
            if cell.escalated:
                notes.append(
                    f"{format_ranks(cell.escalated)} did not honour the interrupt within "
                    f"{self.interrupt_grace:.0f} s (stuck in C code, e.g. a collective) and were terminated; "
                    "every rank's namespace was lost. The pool is restarting.")
            for d in cell.deaths:
                last = list(self._last_lines.get(d.rank, []))
                tail = ("; last output: " + " | ".join(last[-3:])) if last else ""
                notes.append(d.describe() + tail)
            for d in cell.deaths:
                errors.setdefault(d.rank, ErrorInfo("RankDied", d.describe(), ()))
            if not cell.escalated:
                notes.append("The kernel is alive; the pool is down. Run %restart to bring it back.")
        if cell.timed_out:
            stuck = cell.escalated or []
            msg = (f"the cell exceeded the %timeout of {cell.timed_out:g} s and was interrupted on "
                   f"{format_ranks(cell.ranks)}" + ("" if stuck else "; the rank namespaces are intact"))
            notes.insert(0, msg)
            for r in cell.ranks:
                if r in errors and errors[r].ename == "KeyboardInterrupt":
                    errors[r] = ErrorInfo("CellTimeout", msg, errors[r].traceback)
            if not errors:
                errors[min(cell.ranks)] = ErrorInfo("CellTimeout", msg, ())
        if not errors:
            first = min(cell.replies) if cell.replies else None
            rep = cell.replies.get(first, {}) if first is not None else {}
            return {"status": "ok", "execution_count": count,
                    "user_expressions": rep.get("user_expressions", {}), "payload": rep.get("payload", [])}
        content = group_errors(errors)
        if notes:
            content["traceback"] = [f"\x1b[1;31m{n}\x1b[0m" for n in notes] + list(content["traceback"])
            if cell.deaths or cell.timed_out:
                content["ename"] = "CellTimeout" if cell.timed_out else "RankDied"
                content["evalue"] = notes[0]
        self._send("error", content, parent)
        return {"status": "error", "execution_count": count, "user_expressions": {}, "payload": [], **content}

    def _error_reply(self, parent: dict[str, Any], ename: str, evalue: str, tb: list[str],
                     count: int | None = None) -> dict[str, Any]:
        content = {"ename": ename, "evalue": evalue, "traceback": tb or [f"{ename}: {evalue}"]}
        self._send("error", content, parent)
        return {"status": "error", "execution_count": count if count is not None else self.shell.execution_count,
                "user_expressions": {}, "payload": [], **content}

    # -------------------------------------------------------------------------------- interrupt/escalation
    def interrupt_cell(self, cell: CellRun | None = None) -> None:
        cell = cell or self._cell
        pool = self.pool
        if cell is None or pool is None or cell.finished:
            return
        with self._lock:
            if cell.interrupted_at is None:
                cell.interrupted_at = time.monotonic()
        for r in cell.pending():  # the cell is named: a rank may not have taken it off its socket yet
            try:
                pool.send(r, "interrupt_request", {"cell": cell.msg_id}, timeout=0.5)
            except ConnectionError as e:
                self.log.warning("interrupt: %s", e)

    def _maybe_escalate(self, cell: CellRun) -> None:
        """Called on every tick: ranks that ignore an interrupt get SIGTERM, then SIGKILL; the pool restarts."""
        if cell.interrupted_at is None or self.pool is None:
            return
        waited = time.monotonic() - cell.interrupted_at
        stuck = cell.pending()
        if not stuck or waited < self.interrupt_grace:
            return
        if not cell.escalated:
            cell.escalated = list(stuck)
            self._restarting.set()
            self.log.warning("ranks %s ignored the interrupt for %.1f s: SIGTERM", stuck, waited)
            self.pool.signal_ranks(stuck, signal.SIGTERM)
            pool = self.pool
            threading.Thread(target=self._escalate_more, args=(pool, cell, stuck), daemon=True).start()

    def _escalate_more(self, pool: Pool, cell: CellRun, stuck: list[int]) -> None:
        try:
            deadline = time.monotonic() + 2.0
            while time.monotonic() < deadline and any(r not in pool.dead for r in stuck):
                time.sleep(0.05)
            pool.signal_ranks([r for r in stuck if r not in pool.dead], signal.SIGKILL)
            deadline = time.monotonic() + 3.0
            while not cell.done.is_set() and time.monotonic() < deadline:
                time.sleep(0.05)
            with self._lock:
                if not cell.finished and not cell.done.is_set():
                    known = {d.rank for d in cell.deaths}
                    cell.deaths.extend(Death(r, pool.ranks[r].pid if r in pool.ranks else -1, "?", None,
                                             "was terminated after ignoring the interrupt")
                                       for r in stuck if r not in known)
                    cell.loop.call_soon_threadsafe(cell.done.set)
            # bring the pool back automatically
            if self.pool is pool:
                self.stop_pool()
                self.start_pool()
        finally:
            self._restarting.clear()

    async def interrupt_request(self, stream: Any, ident: Any, parent: dict[str, Any]) -> None:
        self._interrupt()
        self.session.send(stream, "interrupt_reply", {"status": "ok"}, parent, ident=ident)

    def _interrupt(self) -> None:
        """Interrupt whatever runs: the cell on the ranks, a wait for the pool, or a %%local cell."""
        self._interrupted.set()
        if self._local_running:
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)  # type: ignore[arg-type]
        else:
            self.interrupt_cell()

    def _on_sigint(self, signum: int, frame: Any) -> None:
        """SIGINT in the kernel process: from _interrupt (a %%local cell) or from outside (interrupt_mode signal)."""
        if self._local_running:
            raise KeyboardInterrupt
        self._interrupted.set()
        self.interrupt_cell()

    def start(self) -> None:
        super().start()
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, self._on_sigint)

    def pre_handler_hook(self) -> None:
        # ipykernel installs default_int_handler while a shell handler runs; a KeyboardInterrupt raised in the
        # event loop while we await the ranks would lose the cell, so SIGINT keeps going to _on_sigint
        self.saved_sigint_handler = signal.signal(signal.SIGINT, self._on_sigint)

    # --------------------------------------------------------------------------- requests to one rank
    async def request(self, rank: int, msg_type: str, content: dict[str, Any],
                      buffers: list[bytes] | None = None, timeout: float = REQUEST_TIMEOUT) -> Event:
        pool = self.pool
        if pool is None or not pool.ready.is_set() or self.pool_down:
            raise PoolStartError(self.pool_down or "the pool is not running")
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Event] = loop.create_future()
        msg_id = uuid.uuid4().hex
        with self._lock:
            self._requests[msg_id] = (loop, fut)
        try:
            pool.send(rank, msg_type, content, buffers=buffers, msg_id=msg_id)
            return await asyncio.wait_for(fut, timeout)
        finally:
            with self._lock:
                self._requests.pop(msg_id, None)

    async def do_complete(self, code: str, cursor_pos: int | None) -> dict[str, Any]:
        try:
            # a rank's first completion loads jedi: on a fresh, loaded machine a 2 s limit once fell back to the
            # kernel's own namespace, which does not know the ranks' variables
            ev = await self.request(self._first_rank(), "complete_request", {"code": code, "cursor_pos": cursor_pos},
                                    timeout=REQUEST_TIMEOUT)
            return ev.msg["content"]
        except Exception:
            return super().do_complete(code, cursor_pos)

    async def do_inspect(self, code: str, cursor_pos: int, detail_level: int = 0,
                         omit_sections: Any = ()) -> dict[str, Any]:
        try:
            ev = await self.request(self._first_rank(), "inspect_request",
                                    {"code": code, "cursor_pos": cursor_pos, "detail_level": detail_level},
                                    timeout=REQUEST_TIMEOUT)
            return ev.msg["content"]
        except Exception:
            return super().do_inspect(code, cursor_pos, detail_level, omit_sections)

    def do_history(self, hist_access_type: str, output: bool, raw: bool, session: int = 0, start: int = 0,
                   stop: int | None = None, n: int | None = None, pattern: str | None = None,
                   unique: bool = False) -> dict[str, Any]:
        reply = super().do_history(hist_access_type, output, raw, session, start, stop, n, pattern, unique)
        # IPython reports the running session as 0 in ranges; name it, as tail and search do
        current = self.shell.history_manager.session_number
        reply["history"] = [(s or current, *rest) for s, *rest in reply["history"]]
        return reply

    def _first_rank(self) -> int:
        pool = self.pool
        alive = pool.alive_ranks() if pool else [0]
        return alive[0] if alive else 0

    async def do_shutdown(self, restart: bool) -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self.stop_pool)
        return super().do_shutdown(restart)


def _wait_clear(event: threading.Event, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while event.is_set() and time.monotonic() < deadline:
        time.sleep(0.02)


def _resolve(fut: asyncio.Future[Event], ev: Event) -> None:
    if not fut.done():
        fut.set_result(ev)


class _DisplayWriter:
    """A file for tqdm that shows its bar as one updatable display in the cell."""

    def __init__(self, kernel: SuperKernel, parent: dict[str, Any], display_id: str) -> None:
        self.kernel, self.parent, self.display_id = kernel, parent, display_id
        self.shown = False

    def write(self, text: str) -> None:
        line = [s for s in text.replace("\n", "\r").split("\r") if s.strip()]
        if not line:
            return
        kind = "update_display_data" if self.shown else "display_data"
        self.shown = True
        self.kernel._send(kind, {"data": {"text/plain": line[-1]}, "metadata": {},
                                 "transient": {"display_id": self.display_id}}, self.parent)

    def flush(self) -> None:
        pass


def main() -> None:
    from ipykernel.kernelapp import IPKernelApp

    os.environ["SUPERKERNEL_FRONTEND"] = "1"
    IPKernelApp.launch_instance(kernel_class=SuperKernel)


if __name__ == "__main__":
    main()
