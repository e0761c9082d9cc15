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
    deadline = time.monotonic() + timeout
    results = []
    for r, p in enumerate(procs):
        try:
            out, err = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                try:
                    os.killpg(q.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            out, err = p.communicate()
            err += f"\n[world.py] rank {r} killed after the {timeout:.0f}s timeout"
        results.append(RankResult(r, p.returncode, out, err))
    return results


def run_world(n: int, script: str, args: list[str], timeout: float = 300, env: dict[str, str] | None = None,
              per_rank_env: dict[int, dict[str, str]] | None = None) -> list[RankResult]:
    return collect(start_world(n, script, args, env, per_rank_env), timeout)
