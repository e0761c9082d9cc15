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
                 env: dict[str, str] | None = None, per_rank_env: dict[int, dict[str, str]] | None = None) -> None:
        self.script = str(HERE / script)
        self.timeout = timeout
        self.gloo_env = gloo_env or {}  # extra environment of the gloo worlds (e.g. SUPERKERNEL_OPS_TRACE)
        self.env = env or {}            # extra environment of every world
        self.per_rank_env = per_rank_env or {}  # and of some ranks only
        self._results: dict[tuple[int, str, tuple[str, ...]], list[RankResult]] = {}

    def results(self, world: int, transport: str, args: list[str]) -> list[RankResult]:
        """Every rank's result; ``transport`` 'gloo' runs the gloo backend, else mk with that transport."""
        key = (world, transport, tuple(args))
        if key not in self._results:
            extra = ["--backend", "gloo"] if transport == "gloo" else []
            env = {**self.env, **(self.gloo_env if transport == "gloo" else {"SUPERKERNEL_TRANSPORT": transport})}
            self._results[key] = run_world(world, self.script, [*args, *extra], timeout=self.timeout, env=env,
                                           per_rank_env=self.per_rank_env)
        return self._results[key]

    def reports(self, world: int, transport: str, args: list[str]) -> list[dict]:
        """Every rank's REPORT (see results())."""
        return [r.report() for r in self.results(world, transport, args)]


def failures_of(reports: list[dict], family: str) -> list[str]:
    """'rank r: problem' for every failure of ``family`` on any rank."""
    return [f"rank {rep['rank']}: {f}" for rep in reports for f in rep["failures"].get(family, [])]


_RING_TRACE = re.compile(r"\[mk (allgather_gemm|gemm_allreduce|gemm_reducescatter) rank (\d+) call \d+\] m=(\d+) "
                         r"k(?:_r)?=(\d+) n=(\d+) (\w+) chunks=(\d+|plain) \(proposed (?:\d+|plain), (automatic|requested \d+)\).* "
                         r"ring=(\d)(?: half_products=(\d))?(?: small_half_limit=\d+)?(?: packs_b=\d)?"
                         r"( agreement=(?:board|side))?( carried)?$", re.MULTILINE)

# Tests that run the rings on small shapes set this (csrc/kernels/gemm_collectives.cc: ring_rows; the
# attention ring's threshold in ring_attention.cc), with carrying off (pipeline.h's CarryLimit), which would
# otherwise take most of those calls.
RING_ON_SMALL_SHAPES = {"SUPERKERNEL_OPS_RING_MIN_ROWS": "1", "SUPERKERNEL_OPS_ATTENTION_RING_MIN_SEQ": "1",
                        "SUPERKERNEL_OPS_CARRY_BYTES": "0"}
DEFAULT_RING_ROWS = 64  # SUPERKERNEL_OPS_RING_MIN_ROWS' default
CARRY_BYTES = 64 << 10  # SUPERKERNEL_OPS_CARRY_BYTES's default (and kCarryMax, the most sent to one peer)
_ELEMENT_BYTES = {"Float": 4, "BFloat16": 2, "Half": 2}


def without_rule_changes(stderr: str) -> str:
    """``stderr`` without the calls a rank script made while it had changed the path rules on some rank
    (rank_tensors.py's path_rules_changed marks them)."""
    return re.sub(r"\[rank suite\] path rules changed.*?\[rank suite\] path rules restored", "", stderr,
                  flags=re.DOTALL)


_OWN_TIME = re.compile(r"^\[mk (\w+) rank (\d+) call (\d+)\] tuner: chunks=(-?\d+|plain) took ([\d.e+-]+) ms here$",
                       re.MULTILINE)
_RECORDED = re.compile(r"^\[mk (\w+) rank (\d+) call (\d+)\] tuner: call (\d+) chunks=(-?\d+|plain) took ([\d.e+-]+) ms "
                       r"on (the slowest rank|this rank)(?:; tuned, using chunks=(-?\d+|plain))?$", re.MULTILINE)


def tuner_records(results: list[RankResult]) -> list[str]:
    """What is wrong with the chunk tuner's records in the ranks' traces (SUPERKERNEL_OPS_TRACE): every call
    timed while tuning (its own time on each rank, "took X ms here") must be recorded on every rank, in the
    next call of the op, as the same time, the largest of the ranks' own ("on the slowest rank"), and every
    rank's tuner must finish with the same choice. [] when all is well; raises when nothing was tuned."""
    own: dict[tuple[str, int, str], dict[int, float]] = {}
    recorded: dict[tuple[str, int, str], dict[int, float]] = {}
    chosen: dict[tuple[str, int], dict[int, str]] = {}  # (op, the call that ended tuning): choice per rank
    for res in results:
        for op, rank, call, chunks, ms in _OWN_TIME.findall(res.stderr):
            own.setdefault((op, int(call), chunks), {})[int(rank)] = float(ms)
        for op, rank, now, call, chunks, ms, whose, choice in _RECORDED.findall(res.stderr):
            recorded.setdefault((op, int(call), chunks), {})[int(rank)] = float(ms) if whose == "the slowest rank" else -1
            if choice:
                chosen.setdefault((op, int(now)), {})[int(rank)] = choice
    assert own, "no tuning calls traced"
    ranks = set(range(len(results)))
    problems = []
    for key, times in sorted(own.items()):
        got = recorded.get(key, {})
        if set(times) != ranks:
            problems.append(f"{key}: timed on ranks {sorted(times)} only")
        elif set(got) != ranks:
            problems.append(f"{key}: recorded on ranks {sorted(got)} of {sorted(ranks)} (own times {times})")
        elif any(abs(v - max(times.values())) > 1e-3 for v in got.values()):
            problems.append(f"{key}: recorded {got}, not the slowest rank's of {times}")
    for key in set(recorded) - set(own):
        problems.append(f"{key}: recorded {recorded[key]} but never timed")
    if not chosen:
        problems.append("no tuner finished")
    for key, per_rank in chosen.items():
        if set(per_rank) != ranks or len(set(per_rank.values())) != 1:
            problems.append(f"{key}: the ranks' tuners chose {per_rank}")
    return problems


GLOO_GEMM_CARRY_BYTES = 256 << 10  # kCarryMaxOther: gemm_allreduce's and gemm_reducescatter's limit on other backends
GLOO_GATHER_CARRY_BYTES = 4 << 20  # kCarryMaxGather: allgather_gemm's there
GLOO_PAIR_CARRY_BYTES = 512 << 10  # kPairCarryBytes: gemm_allreduce's and gemm_reducescatter's there on two ranks


def gemm_paths(stderr: str, world: int, over_tcp: bool, min_rows: int,
               carry: bool = False, gloo: bool = False) -> list[tuple[str, int, int, str, str, int]]:
    """Every traced GEMM op call (SUPERKERNEL_OPS_TRACE) in ``stderr`` as (op, rank, m, the path it took, the path it
    should have, the bytes it sends each peer when carried), a path being "carried", "ring", "plain" or "collective". With a
    peer over TCP: with ``carry`` (SUPERKERNEL_OPS_CARRY_BYTES unset; without it, carrying is off), carried when the
    chunk count is automatic and the bytes a rank sends to each peer (allgather_gemm its shard, m k elements;
    gemm_allreduce its whole product, m n; gemm_reducescatter one block of it, m / R n; a product's element 2 bytes
    when the trace says half_products=1, else 4) are at most 64 KiB, and for gemm_allreduce also times R - 1 (its
    direct sends cost more than its ring; the other two send what their collective sends, pipeline.h's CarryTotal);
    else a ring when gemm_reducescatter's blocks (m / R rows) have ``min_rows`` rows (SUPERKERNEL_OPS_RING_MIN_ROWS,
    64 by default), gemm_allreduce's when moreover R divides m (m > 0), allgather_gemm's shard has ``min_rows``
    rows. With the default threshold (``min_rows`` 64: the variable unset) a call that should ring with an
    automatic chunk count may instead take the plain path the tuner also times (chunks=plain in the trace: the
    collective path with one chunk); both are then what it should have. With every peer on this host: the
    collective paths. ``gloo``: the rules on Gloo with CPU tensors (and the board off): carried as over TCP but
    with 256 KiB to a peer (allgather_gemm 4 MiB, the other two on two ranks 512 KiB), otherwise the collective
    path (no rings)."""
    calls = []
    stderr = without_rule_changes(stderr)
    traced = re.findall(r"^\[mk (?:allgather_gemm|gemm_allreduce|gemm_reducescatter) rank \d+ call \d+\] m=.*$", stderr,
                        flags=re.MULTILINE)
    unread = [line for line in traced if not _RING_TRACE.fullmatch(line)]
    assert not unread, f"trace lines gemm_paths cannot read: {unread[:3]}"
    for op, rank, m, k, n, dtype, agreed, chunks, ring, half, _board, carried in _RING_TRACE.findall(stderr):
        m, k, n = int(m), int(k), int(n)
        product_bytes = 2 if half == "1" else 4
        if op == "allgather_gemm":
            want_ring = world > 1 and m >= min_rows
            per_peer = m * k * _ELEMENT_BYTES[dtype]
        elif op == "gemm_reducescatter":
            want_ring = m // world >= min_rows
            per_peer = m // world * n * product_bytes
        else:
            want_ring = m > 0 and m % world == 0 and m // world >= min_rows
            per_peer = m * n * product_bytes
        most = (CARRY_BYTES if not gloo else GLOO_GATHER_CARRY_BYTES if op == "allgather_gemm"
                else GLOO_PAIR_CARRY_BYTES if world == 2 else GLOO_GEMM_CARRY_BYTES)
        total = most if op == "gemm_allreduce" else (world - 1) * most
        want_carried = (carry and world > 1 and chunks == "automatic" and 0 < per_peer <= most
                        and (world - 1) * per_peer <= total)
        took = "carried" if carried else "plain" if agreed == "plain" else "ring" if ring == "1" else "collective"
        if gloo:
            want = "carried" if want_carried else "collective"
        else:
            want = "carried" if over_tcp and want_carried else "ring" if over_tcp and want_ring else "collective"
            if want == "ring" and took == "plain" and chunks == "automatic" and min_rows == DEFAULT_RING_ROWS:
                want = "plain"
        calls.append((op, int(rank), m, took, want, per_peer))
    return calls
