"""Launch a local world of N ranks running a script, the way torchrun would (env:// rendezvous through
torch's TCPStore), and collect each rank's exit code and output. Every wait has a timeout; on timeout the
whole process group of every rank is killed."""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


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
                per_rank_env: dict[int, dict[str, str]] | None = None) -> list[subprocess.Popen]:
    port = free_port()
    procs = []
    for r in range(n):
        e = dict(os.environ)
        e.pop("SUPERKERNEL_FRONTEND", None)  # ranks load the backend, whatever the test process set for kernels
        e.update({"RANK": str(r), "WORLD_SIZE": str(n), "LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": str(n),
                  "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
                  "PYTHONUNBUFFERED": "1"})
        e.update(env or {})
        e.update((per_rank_env or {}).get(r, {}))
        p = subprocess.Popen([sys.executable, str(HERE / script), *args], env=e, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, start_new_session=True)
        p.master_port = port  # type: ignore[attr-defined]  (torch's TCPStore, hosted by rank 0)
        procs.append(p)
    return procs


def collect(procs: list[subprocess.Popen], timeout: float) -> list[RankResult]:
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
