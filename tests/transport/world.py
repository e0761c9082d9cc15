"""Launch a local world of N ranks running a script, the way torchrun would (env:// rendezvous through
torch's TCPStore), and collect each rank's exit code and output. Every wait has a timeout; on timeout the
whole process group of every rank is killed.

Ranks are forked by a fork server that has imported torch once (forkserver.py), which saves each rank most of
its start (~2.5 s of CPU, on 2 cores); SUPERKERNEL_TEST_FORKSERVER=0 starts every rank as a new interpreter
instead, and so does a rank whose environment differs from the server's in anything read before the script
runs (the interpreter's, the dynamic linker's, or torch's and its math libraries' variables)."""
from __future__ import annotations

import array
import dataclasses
import json
import os
import re
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

# variables read before a rank's script runs (by the interpreter, the loader, torch's import or its libraries
# when they load): a rank whose values differ from the fork server's is started as a new interpreter
_READ_AT_START = re.compile(r"^(PYTHON|LD_|TORCH_|ATEN_|MKL_|KMP_|GOMP_|DNNL_|ONEDNN_|OPENBLAS_|CUDA_"
                            r"|OMP_(?!NUM_THREADS$))")


class ForkedRank:
    """A rank forked by the fork server, with the parts of subprocess.Popen the tests use: pid, stdout and
    stderr (text pipes), returncode, poll(), wait(timeout), communicate(), send_signal(), kill()."""

    def __init__(self, pid: int, stdout: int, stderr: int, report: socket.socket, pending: bytes = b"") -> None:
        self.pid = pid
        self.stdout = os.fdopen(stdout, "r")
        self.stderr = os.fdopen(stderr, "r")
        self.returncode: int | None = None
        self._report = report
        self._pending = pending  # what the server reported after the pid

    def _read_exit(self, timeout: float | None) -> bool:
        while b"\n" not in self._pending:
            ready, _, _ = select.select([self._report], [], [], timeout)
            if not ready:
                return False
            chunk = self._report.recv(64)
            if not chunk:
                raise RuntimeError(f"fork server went away before reporting how rank pid {self.pid} exited")
            self._pending += chunk
        word, code = self._pending.split(b"\n", 1)[0].split()
        assert word == b"exit", self._pending
        self.returncode = int(code)
        self._report.close()
        return True

    def poll(self) -> int | None:
        if self.returncode is None:
            self._read_exit(0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None and not self._read_exit(timeout):
            raise subprocess.TimeoutExpired(f"rank pid {self.pid}", timeout or 0)
        assert self.returncode is not None
        return self.returncode

    def communicate(self) -> tuple[str, str]:
        err: list[str] = []
        reader = threading.Thread(target=lambda: err.append(self.stderr.read()), daemon=True)
        reader.start()
        out = self.stdout.read()
        reader.join()
        self.stdout.close()
        self.stderr.close()
        self.wait()
        return out, err[0]

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """The session's fork server (started at the first rank it forks; it exits with this process)."""

    def __init__(self) -> None:
        # as start_world's ranks have it (their stdio unbuffered); their thread count is applied after the fork
        self.env = {**{k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}, "PYTHONUNBUFFERED": "1"}
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.proc = subprocess.Popen([sys.executable, str(HERE / "forkserver.py"), str(theirs.fileno())],
                                     env=self.env, pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL,
                                     start_new_session=True)  # (a ^C to pytest is not its to handle)
        theirs.close()
        self.control = ours
        self.lock = threading.Lock()

    def suits(self, env: dict[str, str]) -> bool:
        """Whether a rank with ``env`` starts as it would in a new interpreter (see _READ_AT_START)."""
        keys = {k for k in (*env, *self.env) if _READ_AT_START.match(k)}
        return self.proc.poll() is None and all(env.get(k) == self.env.get(k) for k in keys)

    def spawn(self, argv: list[str], env: dict[str, str]) -> ForkedRank:
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        report, theirs = socket.socketpair()
        try:
            request = json.dumps({"argv": argv, "env": env, "cwd": os.getcwd()}).encode()
            with self.lock:
                self.control.sendmsg([request], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                                  array.array("i", [out_w, err_w, theirs.fileno()]))])
        finally:
            os.close(out_w)
            os.close(err_w)
            theirs.close()
        report.settimeout(60)
        got = b""
        while b"\n" not in got:
            try:
                chunk = report.recv(64)
            except TimeoutError:
                raise RuntimeError(f"fork server (pid {self.proc.pid}) did not fork {argv[0]} within 60 s") from None
            if not chunk:
                raise RuntimeError(f"fork server (pid {self.proc.pid}) exited before forking {argv[0]}")
            got += chunk
        report.settimeout(None)
        line, rest = got.split(b"\n", 1)  # (a rank that exited at once: its exit line may be here too)
        word, pid = line.split()
        assert word == b"pid", got
        return ForkedRank(int(pid), out_r, err_r, report, rest)


_server: ForkServer | None = None
_server_lock = threading.Lock()


def fork_server() -> ForkServer | None:
    """The session's fork server, or None when SUPERKERNEL_TEST_FORKSERVER=0."""
    global _server
    if os.environ.get("SUPERKERNEL_TEST_FORKSERVER", "1") == "0":
        return None
    with _server_lock:
        if _server is None or _server.proc.poll() is not None:
            _server = ForkServer()
        return _server


@dataclasses.dataclass
class RankResult:
    rank: int
    returncode: int | None
    stdout: str
    stderr: str

    def report(self) -> dict:
        """The JSON object the rank printed on its last 'REPORT ' line."""
        for line in reversed(self.stdout.splitlines()):
            if line.startswith("REPORT "):
                return json.loads(line[len("REPORT "):])
        raise AssertionError(f"rank {self.rank} printed no report (exit {self.returncode}):\n"
                             f"--- stdout\n{self.stdout[-3000:]}\n--- stderr\n{self.stderr[-3000:]}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_world(n: int, script: str, args: list[str], env: dict[str, str] | None = None,
                per_rank_env: dict[int, dict[str, str]] | None = None) -> list[subprocess.Popen | ForkedRank]:
    port = free_port()
    server = fork_server()
    procs: list[subprocess.Popen | ForkedRank] = []
    for r in range(n):
        e = dict(os.environ)
        e.pop("SUPERKERNEL_FRONTEND", None)  # ranks load the backend, whatever the test process set for kernels
        e.update({"RANK": str(r), "WORLD_SIZE": str(n), "LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": str(n),
                  "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
                  "PYTHONUNBUFFERED": "1"})
        e.update(env or {})
        e.update((per_rank_env or {}).get(r, {}))
        argv = [str(HERE / script), *args]
        if server is not None and server.suits(e):
            p: subprocess.Popen | ForkedRank = server.spawn(argv, e)
        else:
            p = subprocess.Popen([sys.executable, *argv], env=e, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True, start_new_session=True)
        p.master_port = port  # type: ignore[attr-defined]  (torch's TCPStore, hosted by rank 0)
        procs.append(p)
    return procs


def collect(procs: list[subprocess.Popen | ForkedRank], timeout: float) -> list[RankResult]:
    """Every rank's output and exit code. All ranks' pipes are read at once (one thread each): a rank that
    writes more than a pipe holds (64 KiB; a traced suite does) while another is still being waited for
    would otherwise block in its write, and its peers in their collectives with it. Ranks still running at
    the deadline are killed (all of them)."""
    outputs: list[tuple[str, str]] = [("", "")] * len(procs)

    def drain(r: int) -> None:
        outputs[r] = procs[r].communicate()

    readers = [threading.Thread(target=drain, args=(r,), daemon=True) for r in range(len(procs))]
    for t in readers:
        t.start()
    deadline = time.monotonic() + timeout
    for t in readers:
        t.join(max(0.0, deadline - time.monotonic()))
    late = [r for r, t in enumerate(readers) if t.is_alive()]
    if late:
        for q in procs:
            try:
                os.killpg(q.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for t in readers:
        t.join()
    results = []
    for r, p in enumerate(procs):
        out, err = outputs[r]
        if r in late:
            err += f"\n[world.py] rank {r} killed after the {timeout:.0f}s timeout"
        results.append(RankResult(r, p.returncode, out, err))
    return results


def run_world(n: int, script: str, args: list[str], timeout: float = 300, env: dict[str, str] | None = None,
              per_rank_env: dict[int, dict[str, str]] | None = None) -> list[RankResult]:
    return collect(start_world(n, script, args, env, per_rank_env), timeout)
