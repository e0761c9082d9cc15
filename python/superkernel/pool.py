"""Launches and supervises the rank pool: torchrun (torch flavour), mpirun (MPI flavour) or plain processes.

A :class:`Pool` owns the kernel end of the channels and one dispatcher thread which

* receives every worker event, handles ``hello`` and ``heartbeat`` itself and hands the rest to the
  listener (the kernel);
* watches processes: the launcher (our child) and, for a local pool, every worker pid, so a rank that
  dies is reported within a few hundred milliseconds with its signal or exit code (read from the
  launcher's own failure report: torchrun's ``failed (exitcode: -9) local_rank: 1 (pid: ...)`` or
  mpirun's ``... exited on signal 9``, which Open MPI prints only after its 1 s sigkill timeout, so an
  mpirun pool's report takes about a second); for remote ranks a missing heartbeat does the same, more slowly;
* calls the listener's ``on_tick`` every few tens of milliseconds (live output merging).

Workers run in their own sessions (torchrun does that; plain workers get ``start_new_session``), so a
SIGINT to the kernel's process group never reaches them. ``close()`` asks the ranks to exit, then
escalates SIGTERM -> SIGKILL over the whole process tree; nothing is left behind. If the kernel process
itself is killed, every worker notices within a heartbeat (its kernel pid is gone) and exits, and the
launcher exits with them. (PR_SET_PDEATHSIG is not used: it fires when the *thread* that started the
launcher ends, not the kernel process.)
"""
from __future__ import annotations

import collections
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import psutil

from superkernel.join import JoinSpec, spans_hosts
from superkernel.protocol import SYNC, Event, KernelChannels

log = logging.getLogger("superkernel.pool")

HEARTBEAT_TIMEOUT = 10.0
TICK = 0.025
PING_INTERVAL = 1.0  # the kernel's "I am alive" to ranks on other hosts (they cannot watch its pid)


@dataclass
class PoolSpec:
    flavor: str = "torch"            # torch | mpi | plain
    nranks: int = 2
    backend: str | None = None      # SUPERKERNEL_BACKEND for the workers (torch flavour)
    launcher_args: list[str] = field(default_factory=list)  # extra torchrun/mpirun arguments
    bind_ip: str = "127.0.0.1"
    start_timeout: float = 180.0
    join_file: str | None = None     # where a pool spanning hosts writes its join file (default: runtime dir)
    launcher: str | None = None      # torch flavour: torchrun (default) or srun (Slurm)

    @property
    def local(self) -> bool:
        return self.bind_ip.startswith("127.")

    @property
    def multi_host(self) -> bool:
        return self.flavor == "torch" and self.launcher != "srun" and spans_hosts(self.launcher_args)

    def world_size_guess(self) -> int:
        """The world size before the first rank reports it: nproc × nnodes when --nnodes is a number."""
        if not self.multi_host:
            return self.nranks
        for i, a in enumerate(self.launcher_args):
            name, _, value = a.partition("=")
            if name == "--nnodes":
                value = value or (self.launcher_args[i + 1] if i + 1 < len(self.launcher_args) else "")
                if value.isdigit():
                    return self.nranks * int(value)
        return self.nranks


@dataclass
class RankInfo:
    rank: int
    pid: int
    host: str
    local_rank: int
    world_size: int
    backend: str
    device: str
    last_beat: float = 0.0
    busy: bool = False


@dataclass
class Death:
    rank: int
    pid: int
    host: str
    exitcode: int | None      # negative: killed by signal -exitcode
    detail: str = ""
    root_cause: bool = False  # the launcher names this rank as the first failure

    @property
    def order(self) -> tuple[int, int, int]:
        """Sort key: the root cause first, then ranks that did not just get the launcher's SIGTERM."""
        return (0 if self.root_cause else 1, 1 if self.exitcode == -signal.SIGTERM else 0, self.rank)

    def describe(self) -> str:
        if self.exitcode is None:
            how = self.detail or "exited (exit status not reported by the launcher)"
        elif self.exitcode < 0:
            try:
                name = signal.Signals(-self.exitcode).name
            except ValueError:
                name = f"signal {-self.exitcode}"
            how = f"was killed by signal {-self.exitcode} ({name})"
        else:
            how = f"exited with code {self.exitcode}"
        return f"rank {self.rank} (pid {self.pid} on {self.host}) {how}"


class PoolListener(Protocol):
    def on_event(self, event: Event) -> None: ...
    def on_death(self, deaths: list[Death]) -> None: ...
    def on_tick(self) -> None: ...


class PoolStartError(RuntimeError):
    pass


_TORCHRUN_FAIL = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+) \(pid: (\d+)\)")
_TORCHRUN_SIGNAL = re.compile(r"Signal (\d+) \(\w+\) received by PID (\d+)")
_MPI_SIGNAL = re.compile(r"rank (\d+) with PID (\d+) on node \S+ exited on\s+signal (\d+)")
_SRUN_FAIL = re.compile(r"srun: error: \S+: tasks? ([\d,\-]+): (Killed|Terminated|Exited with exit code (\d+))")
_MPI_EXIT = re.compile(r"rank (\d+) with PID (\d+) on node \S+ exited .*?status (\d+)", re.S)
# mpirun's first words when a rank fails; the line naming the rank and its signal follows once the
# other ranks are gone, after Open MPI's odls_base_sigkill_timeout (1 s by default; 1.0 s after the kill here,
# sometimes 2.0 s)
_MPI_ABORTING = re.compile(r"Primary job\s+terminated normally, but \d+ process(es)? returned|"
                           r"the job has been aborted")
# how long to wait for the launcher to say how a rank ended: 1.2 s, or this once mpirun is aborting
MPI_REPORT_WAIT = 3.2


class Pool:
    def __init__(self, spec: PoolSpec, listener: PoolListener) -> None:
        self.spec = spec
        self.listener = listener
        self.channels = KernelChannels(bind_ip=spec.bind_ip)
        self.ranks: dict[int, RankInfo] = {}
        self.dead: dict[int, Death] = {}
        self.ready = threading.Event()
        self.expected = spec.world_size_guess()  # until the ranks report the world size themselves
        self.failed: str | None = None
        self.started_at = 0.0
        self.ready_at = 0.0
        self._procs: list[subprocess.Popen[bytes]] = []
        self._launcher_output: collections.deque[str] = collections.deque(maxlen=200)
        self._exit_codes: dict[int, int] = {}   # pid -> exit code, from the launcher's report
        self._root_cause_pid: int | None = None
        self._rank_exit_codes: dict[int, int] = {}  # rank -> exit code (mpirun reports ranks, often PID 0)
        self._launcher_aborting = False  # mpirun announced a failed rank; its report is on the way
        self._stop = threading.Event()
        self._closing = False
        self._lock = threading.Lock()
        self._dir = tempfile.mkdtemp(prefix="superkernel-pool-")
        self._conn_file = os.path.join(self._dir, "connection.json")
        self.channels.info.write(self._conn_file)
        self._thread = threading.Thread(target=self._dispatch_loop, name="superkernel-pool", daemon=True)
        self.join_file: str | None = None  # written by start() when the pool spans hosts
        self._host = hostname()

    # ------------------------------------------------------------------------------------------- start
    def worker_command(self) -> list[str]:
        return [sys.executable, "-m", "superkernel.worker", "--connection-file", self._conn_file,
                "--flavor", self.spec.flavor]

    def launch_commands(self) -> list[list[str]]:
        n = self.spec.nranks
        if self.spec.flavor == "torch" and self.spec.launcher == "srun":
            srun = shutil.which("srun")
            if srun is None:
                raise PoolStartError("the srun launcher needs Slurm's srun on PATH (Debian: slurm-client)")
            # one job step of n tasks; Slurm numbers them (SLURM_PROCID = rank) and, with --kill-on-bad-exit,
            # ends the whole step when one rank dies, as torchrun does
            return [[srun, f"--ntasks={n}", "--kill-on-bad-exit=1", "--job-name=superkernel",
                     *self.spec.launcher_args, *self.worker_command()]]
        if self.spec.launcher not in (None, "torchrun", "mpirun"):
            raise PoolStartError(f"unknown launcher {self.spec.launcher!r} for the {self.spec.flavor} flavour "
                                 "(torch: torchrun or srun; mpi: mpirun)")
        if self.spec.flavor == "torch":
            extra = self.spec.launcher_args
            rdzv = [] if self.spec.multi_host else ["--standalone"]  # several hosts: the user's rendezvous
            return [[sys.executable, "-m", "torch.distributed.run", *rdzv, f"--nproc-per-node={n}",
                     "--monitor-interval=0.1", *extra, "-m", "superkernel.worker",
                     "--connection-file", self._conn_file, "--flavor", "torch"]]
        if self.spec.flavor == "mpi":
            mpirun = shutil.which("mpirun") or shutil.which("mpiexec")
            if mpirun is None:
                raise PoolStartError("the MPI flavour needs mpirun (Debian: apt-get install openmpi-bin)")
            root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
            return [[mpirun, *root, "--oversubscribe", "--bind-to", "none", "-np", str(n),
                     *self.spec.launcher_args, *self.worker_command()]]
        if self.spec.flavor == "plain":
            return [self.worker_command() for _ in range(n)]
        raise PoolStartError(f"unknown pool flavour {self.spec.flavor!r} (torch|mpi|plain)")

    def start(self) -> None:
        env = dict(os.environ)
        env["SUPERKERNEL_FRONTEND"] = "1"   # the worker module imports cleanly; it loads the backend itself
        env.setdefault("PYTHONUNBUFFERED", "1")
        env.setdefault("OMP_NUM_THREADS", "1")
        if self.spec.backend:
            env["SUPERKERNEL_BACKEND"] = self.spec.backend
        for k in ("PYTEST_CURRENT_TEST", "JPY_PARENT_PID", "MPLBACKEND"):
            env.pop(k, None)
        env["MPLBACKEND"] = "module://matplotlib_inline.backend_inline"
        if self.spec.launcher == "srun":
            env["MASTER_PORT"] = str(_free_port())  # rank 0's node hosts the store (see worker.rendezvous_env)
            env.pop("MASTER_ADDR", None)
        if self.spec.flavor == "mpi" and os.geteuid() == 0:
            env["OMPI_ALLOW_RUN_AS_ROOT"] = env["OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"] = "1"
        self.started_at = time.monotonic()
        if self.spec.multi_host:
            self._write_join_file()
        for i, cmd in enumerate(self.launch_commands()):
            penv = env
            if self.spec.flavor == "plain":
                penv = dict(env, RANK=str(i), WORLD_SIZE=str(self.spec.nranks), LOCAL_RANK=str(i))
            log.info("starting pool: %s", " ".join(cmd))
            with self._lock:
                if self._closing:  # closed while starting: launch nothing more
                    return
                proc = subprocess.Popen(cmd, env=penv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, start_new_session=True)
                self._procs.append(proc)
            threading.Thread(target=self._read_launcher, args=(proc,), daemon=True,
                             name=f"superkernel-launcher-{proc.pid}").start()
        if not self._thread.is_alive():
            self._thread.start()

    def _write_join_file(self) -> None:
        if self.spec.local:
            raise PoolStartError(
                "this pool spans several hosts (SUPERKERNEL_LAUNCHER_ARGS has --nnodes/--rdzv-endpoint) but the "
                "kernel listens on loopback only: set SUPERKERNEL_BIND to this host's address that the other "
                "hosts can reach")
        path = self.spec.join_file
        if not path:
            from jupyter_core.paths import jupyter_runtime_dir

            os.makedirs(jupyter_runtime_dir(), exist_ok=True)
            path = os.path.join(jupyter_runtime_dir(), f"superkernel-join-{self.channels.pool_id}.json")
        JoinSpec(self.channels.info, list(self.spec.launcher_args), self.spec.nranks, self.spec.backend).write(path)
        self.join_file = path
        log.info("pool spans hosts: on every other host run `superkernel join %s`", path)

    def wait_ready(self, timeout: float | None = None,
                   progress: Callable[[int, int], None] | None = None,
                   cancel: threading.Event | None = None) -> None:
        """Block until every rank said hello; raise PoolStartError with the launcher's output otherwise.

        Setting ``cancel`` (an interrupt) stops the wait, not the start-up."""
        deadline = time.monotonic() + (timeout or self.spec.start_timeout)
        seen = -1
        while not self.ready.wait(0.05):
            if self._closing:
                raise PoolStartError("the pool was closed while it was starting")
            if cancel is not None and cancel.is_set():
                raise PoolStartError(f"interrupted while the pool was starting ({len(self.ranks)}/"
                                     f"{self.expected} ranks ready); it keeps starting in the background")
            if progress and len(self.ranks) != seen:
                seen = len(self.ranks)
                progress(seen, self.expected)
            if self.failed:
                raise PoolStartError(self.failed)
            if time.monotonic() > deadline:
                raise PoolStartError(f"pool did not start within {timeout or self.spec.start_timeout:.0f} s; "
                                     f"{len(self.ranks)}/{self.spec.nranks} ranks ready.\n" + self.launcher_failure())
        if progress:
            progress(self.expected, self.expected)

    def launcher_tail(self, n: int = 30) -> str:
        return "\n".join(list(self._launcher_output)[-n:])

    def launcher_failure(self) -> str:
        """The first traceback a rank printed (why it failed), then the end of the launcher's output."""
        lines = list(self._launcher_output)
        first: list[str] = []
        for i, line in enumerate(lines):
            if line.lstrip().startswith("Traceback (most recent call last)"):
                block = [line]
                for nxt in lines[i + 1:]:
                    block.append(nxt)
                    if nxt and not nxt[0].isspace() and not nxt.startswith("Traceback"):
                        break  # the exception line ends the traceback
                if not any("torch/distributed/run.py" in b or "elastic" in b for b in block):
                    first = block[-12:]
                    break
        tail = lines[-8:]
        return "\n".join(first + (["..."] if first else []) + tail)

    # ---------------------------------------------------------------------------------------- requests
    def send(self, rank: int, msg_type: str, content: dict[str, Any], **kw: Any) -> dict[str, Any]:
        return self.channels.send(rank, msg_type, content, **kw)

    @property
    def world_size(self) -> int:
        return self.expected

    def alive_ranks(self) -> list[int]:
        return [r for r in range(self.expected) if r not in self.dead]

    def signal_ranks(self, ranks: list[int], sig: int) -> None:
        for r in ranks:
            info = self.ranks.get(r)
            if info is None or not self.is_here(info):
                continue
            try:
                os.kill(info.pid, sig)
            except ProcessLookupError:
                pass

    # ------------------------------------------------------------------------------------- supervision
    def _read_launcher(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        for raw in iter(proc.stdout.readline, b""):
            line = raw.decode(errors="replace").rstrip("\n").replace(SYNC, "")
            self._launcher_output.append(line)
            log.debug("[launcher] %s", line)
            m = _TORCHRUN_FAIL.search(line)
            if m:
                self._exit_codes[int(m.group(3))] = int(m.group(1))
                self._root_cause_pid = int(m.group(3))
            m = _TORCHRUN_SIGNAL.search(line)
            if m:
                self._exit_codes.setdefault(int(m.group(2)), -int(m.group(1)))
            if _MPI_ABORTING.search(line):
                self._launcher_aborting = True
            m = _MPI_SIGNAL.search(line)
            if m:
                self._rank_exit_codes[int(m.group(1))] = -int(m.group(3))
                if self._root_cause_pid is None:
                    self._root_cause_pid = -1 - int(m.group(1))  # marks the rank, see _known_code
            m = _SRUN_FAIL.search(line)
            if m:
                how = m.group(2)
                code = int(m.group(3)) if m.group(3) else (-signal.SIGKILL if how == "Killed" else -signal.SIGTERM)
                for rank in _expand_ranks(m.group(1)):
                    self._rank_exit_codes.setdefault(rank, code)
                    if self._root_cause_pid is None and how != "Terminated":
                        self._root_cause_pid = -1 - rank

    def _dispatch_loop(self) -> None:
        next_check = next_ping = 0.0
        while not self._stop.is_set():
            try:
                ev = self.channels.recv(TICK)
                while ev is not None:
                    self._handle(ev)
                    ev = self.channels.recv_nowait()
            except Exception:
                if self._stop.is_set():
                    return
                log.exception("pool dispatcher: receiving failed")
            now = time.monotonic()
            if self.spec.multi_host and now >= next_ping:
                next_ping = now + PING_INTERVAL
                self._ping_remote()
            if now >= next_check:
                next_check = now + 0.1
                try:
                    self._check_processes(now)
                except Exception:
                    log.exception("pool dispatcher: process check failed")
            try:
                self.listener.on_tick()
            except Exception:
                log.exception("pool dispatcher: listener tick failed")

    def _handle(self, ev: Event) -> None:
        kind = ev.msg_type
        if kind == "hello":
            c = ev.msg["content"]
            if c.get("pool_id") != self.channels.pool_id:
                log.warning("hello from rank %d of another pool ignored", ev.rank)
                return
            self.ranks[ev.rank] = RankInfo(ev.rank, c["pid"], c["host"], c["local_rank"], c["world_size"],
                                           c["backend"], c["device"], last_beat=time.monotonic())
            log.info("rank %d ready: pid %d on %s, %s", ev.rank, c["pid"], c["host"], c["backend"])
            self.expected = int(c["world_size"])
            if len(self.ranks) == self.expected:
                self.ready_at = time.monotonic()
                self.ready.set()
            return
        info = self.ranks.get(ev.rank)
        if info is not None:
            info.last_beat = time.monotonic()
        if kind == "heartbeat":
            if info is not None:
                info.busy = bool(ev.msg["content"].get("busy"))
            return
        self.listener.on_event(ev)

    def _check_processes(self, now: float) -> None:
        if self._closing:
            return
        if not self.ready.is_set():
            for proc in self._procs:
                if proc.poll() is not None and not self.failed:
                    time.sleep(0.2)  # let the reader thread collect the last lines
                    self.failed = (f"pool launcher exited with code {proc.returncode} before all ranks started "
                                   f"({len(self.ranks)}/{self.spec.nranks} ready):\n" + self.launcher_failure())
            return
        gone: list[RankInfo] = []
        for r, info in self.ranks.items():
            if r in self.dead:
                continue
            if self.is_here(info):
                if not _pid_alive(info.pid):
                    gone.append(info)
            elif now - info.last_beat > HEARTBEAT_TIMEOUT:
                gone.append(info)
        if not gone:
            return
        # give the launcher a moment to report how the rank(s) ended; longer once mpirun said it is aborting
        start = time.monotonic()
        while any(self._known_code(g) is None for g in gone):
            if self._plain_exit_code(gone):
                break
            waited = time.monotonic() - start
            if waited >= (MPI_REPORT_WAIT if self._launcher_aborting else 1.2):
                break
            if self._launcher_aborting and all(p.poll() is not None for p in self._procs):
                time.sleep(0.1)  # the launcher is gone: let the reader thread take its last lines
                break
            time.sleep(0.02)
        self._plain_exit_code(gone)
        deaths = []
        for g in gone:
            code = self._known_code(g)
            detail = "" if code is not None or self.is_here(g) else f"no heartbeat for {HEARTBEAT_TIMEOUT:.0f} s"
            root = self._root_cause_pid in (g.pid, -1 - g.rank)
            d = Death(g.rank, g.pid, g.host, code, detail, root_cause=root)
            self.dead[g.rank] = d
            deaths.append(d)
        deaths.sort(key=lambda d: d.order)
        self.listener.on_death(deaths)

    def is_here(self, info: RankInfo) -> bool:
        """Does this rank run on the kernel's host (so its pid can be watched and signalled)?"""
        return self.spec.local or info.host == self._host

    def _ping_remote(self) -> None:
        for r, info in list(self.ranks.items()):
            if r in self.dead or self.is_here(info):
                continue
            try:
                self.channels.send(r, "ping", {}, timeout=0)
            except Exception:
                pass  # not connected (yet, or any more): its heartbeat decides

    def _known_code(self, info: RankInfo) -> int | None:
        code = self._exit_codes.get(info.pid)
        return code if code is not None else self._rank_exit_codes.get(info.rank)

    def _plain_exit_code(self, gone: list[RankInfo]) -> bool:
        """Plain workers are our children: their exit status is exact."""
        found = False
        for proc in self._procs:
            if proc.poll() is not None and any(g.pid == proc.pid for g in gone):
                self._exit_codes[proc.pid] = proc.returncode
                found = True
        return found

    # ---------------------------------------------------------------------------------------- teardown
    def process_tree(self) -> list[psutil.Process]:
        procs: list[psutil.Process] = []
        for p in self._procs:
            try:
                root = psutil.Process(p.pid)
                procs.append(root)
                procs.extend(root.children(recursive=True))
            except psutil.NoSuchProcess:
                pass
        pids = {p.pid for p in procs}
        for info in self.ranks.values():
            if info.pid not in pids and self.is_here(info):
                try:
                    procs.append(psutil.Process(info.pid))
                except psutil.NoSuchProcess:
                    pass
        return procs

    def close(self, grace: float = 3.0) -> None:
        """Ask every rank to exit, then SIGTERM and SIGKILL whatever is left of the process tree."""
        with self._lock:
            self._closing = True
        tree = self.process_tree()
        for r in list(self.ranks):
            if r in self.dead:
                continue
            try:
                self.channels.send(r, "shutdown_request", {}, timeout=0.2)
            except Exception:
                pass
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(p.poll() is None for p in self._procs):
            time.sleep(0.02)
        for sig, wait in ((signal.SIGTERM, 2.0), (signal.SIGKILL, 2.0)):
            alive = [p for p in tree if _proc_alive(p)]
            if not alive:
                break
            for p in alive:
                try:
                    p.send_signal(sig)
                except psutil.NoSuchProcess:
                    pass
            psutil.wait_procs(alive, timeout=wait)
        for p in self._procs:
            try:
                p.wait(timeout=1)
            except subprocess.TimeoutExpired:
                pass
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=2)
        self.channels.close()
        shutil.rmtree(self._dir, ignore_errors=True)
        if self.join_file:  # it holds the pool's key, which dies with the pool
            try:
                os.unlink(self.join_file)
            except OSError:
                pass


def _pid_alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _proc_alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def default_nranks() -> int:
    """One rank per GPU, else 2 CPU ranks (the kernel never imports torch to count GPUs)."""
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=5)
        n = sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))
        if n:
            return n
    except (OSError, subprocess.TimeoutExpired):
        pass
    return 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _expand_ranks(spec: str) -> list[int]:
    """Slurm's task list ``0-2,5`` -> [0, 1, 2, 5]."""
    out: list[int] = []
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


def hostname() -> str:
    return socket.gethostname()
