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


_RING_TRACE = re.compile(r"\[mk (gemm_allreduce|gemm_reducescatter) rank (\d+) call \d+\] m=(\d+) "
                         r"k_r=\d+ n=\d+ .* ring=(\d)")


def ring_calls(stderr: str, world: int, over_tcp: bool) -> list[tuple[str, int, int, bool, bool]]:
    """Every traced gemm_allreduce / gemm_reducescatter call (SUPERKERNEL_OPS_TRACE) in ``stderr`` as (op,
    rank, m, ran the transport ring, should have). The rule: with a peer over TCP, gemm_reducescatter always
    rings, gemm_allreduce when the world size divides m (m > 0); with every peer on this host neither does."""
    calls = []
    for op, rank, m, ring in _RING_TRACE.findall(stderr):
        want = over_tcp and (op == "gemm_reducescatter" or (int(m) > 0 and int(m) % world == 0))
        calls.append((op, int(rank), int(m), ring == "1", want))
    return calls
