"""Start a world for a fused-op rank script (tests/ops/*_suite.py) once per configuration and cache its
reports, so the many tests of one configuration share a single world start (~2-3 s each)."""
from __future__ import annotations

import re
from pathlib import Path

from tests.transport.world import RankResult, run_world

HERE = Path(__file__).resolve().parent

# (world size, transport or backend): mk over shm and over tcp for 1-4 ranks, and Gloo.
MK_WORLDS = [(1, "auto"), (2, "shm"), (2, "tcp"), (3, "shm"), (3, "tcp"), (4, "shm"), (4, "tcp")]


class WorldCache:
    """Runs ``script`` (in tests/ops) with ``args(world, transport)`` once per (world, transport)."""

    def __init__(self, script: str, timeout: float = 300, gloo_env: dict[str, str] | None = None,
                 env: dict[str, str] | None = None) -> None:
        self.script = str(HERE / script)
        self.timeout = timeout
        self.gloo_env = gloo_env or {}  # extra environment of the gloo worlds (e.g. SUPERKERNEL_OPS_TRACE)
        self.env = env or {}            # extra environment of every world
        self._results: dict[tuple[int, str, tuple[str, ...]], list[RankResult]] = {}

    def results(self, world: int, transport: str, args: list[str]) -> list[RankResult]:
        """Every rank's result; ``transport`` 'gloo' runs the gloo backend, else mk with that transport."""
        key = (world, transport, tuple(args))
        if key not in self._results:
            extra = ["--backend", "gloo"] if transport == "gloo" else []
            env = {**self.env, **(self.gloo_env if transport == "gloo" else {"SUPERKERNEL_TRANSPORT": transport})}
            self._results[key] = run_world(world, self.script, [*args, *extra], timeout=self.timeout, env=env)
        return self._results[key]

    def reports(self, world: int, transport: str, args: list[str]) -> list[dict]:
        """Every rank's REPORT (see results())."""
        return [r.report() for r in self.results(world, transport, args)]


def failures_of(reports: list[dict], family: str) -> list[str]:
    """'rank r: problem' for every failure of ``family`` on any rank."""
    return [f"rank {rep['rank']}: {f}" for rep in reports for f in rep["failures"].get(family, [])]


_RING_TRACE = re.compile(r"\[mk (allgather_gemm|gemm_allreduce|gemm_reducescatter) rank (\d+) call \d+\] m=(\d+) "
                         r"k(?:_r)?=\d+ n=\d+ .* ring=(\d)")

# Tests that run the rings on small shapes set this (csrc/kernels/gemm_collectives.cc: ring_min_rows).
RING_ON_SMALL_SHAPES = {"SUPERKERNEL_OPS_RING_MIN_ROWS": "1"}


def ring_calls(stderr: str, world: int, over_tcp: bool, min_rows: int) -> list[tuple[str, int, int, bool, bool]]:
    """Every traced GEMM op call (SUPERKERNEL_OPS_TRACE) in ``stderr`` as (op, rank, m, ran the transport ring,
    should have). The rule: with a peer over TCP, gemm_reducescatter rings when its blocks (m / R rows) have
    ``min_rows`` rows (SUPERKERNEL_OPS_RING_MIN_ROWS, 64 by default), gemm_allreduce when moreover the world
    size divides m (m > 0), allgather_gemm when a shard has ``min_rows`` rows; with every peer on this host none
    does."""
    calls = []
    for op, rank, m, ring in _RING_TRACE.findall(stderr):
        m = int(m)
        if op == "allgather_gemm":
            want = world > 1 and m >= min_rows
        elif op == "gemm_reducescatter":
            want = m // world >= min_rows
        else:
            want = m > 0 and m % world == 0 and m // world >= min_rows
        calls.append((op, int(rank), m, ring == "1", over_tcp and want))
    return calls
