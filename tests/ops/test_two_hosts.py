"""The fused ops between two hosts for real: two network namespaces joined by a veth pair, two ranks in each
(world 4). On mk a rank reaches its own host's peer over shared memory and the other host's over TCP, so
the ops take their cross-host paths (rings over the transport, no shared-memory agreement board); on Gloo
every collective is Gloo's. Each op family's rank suite (tests/ops/*_suite.py: float64 references, every
dtype, awkward shapes, gradients, mismatch errors) runs once per backend as one torch job of two torchruns.
"""
from __future__ import annotations

import re

import pytest

from tests.netns.hosts import TwoHosts, rank_reports, run_torch_job, unavailable_reason
from tests.ops.ops_world import HERE, RING_ON_SMALL_SHAPES, ring_calls

REASON = unavailable_reason()
PER_HOST = 2
# suite -> (its failure families, extra arguments)
SUITES = {
    "gemm_suite.py": (["allgather_gemm", "gemm_allreduce", "gemm_reducescatter", "empty", "grad", "errors"],
                      ["--errors"]),
    "moe_suite.py": (["dispatch", "combine", "grad", "errors"], []),
    "attention_suite.py": (["attention", "grad", "errors"], []),
}
_runs: dict[tuple[str, str], tuple[list[dict], list[str], tuple[int, int]]] = {}


def run(suite: str, backend: str) -> tuple[list[dict], list[str], tuple[int, int]]:
    """(every rank's REPORT, each host's stderr, bytes host a received and sent on its veth) of one job."""
    key = (suite, backend)
    if key not in _runs:
        with TwoHosts() as hosts:
            before = hosts.a.link_bytes()
            results = run_torch_job(hosts, str(HERE / suite), ["--backend", backend, *SUITES[suite][1]],
                                    nproc_per_host=PER_HOST, timeout=600,
                                    env={"SUPERKERNEL_OPS_TRACE": "1", "SUPERKERNEL_FRONTEND": "0",
                                         **RING_ON_SMALL_SHAPES})
            after = hosts.a.link_bytes()
        reports = rank_reports(results, per_host=PER_HOST)
        _runs[key] = (reports, [r.stderr for r in results], (after[0] - before[0], after[1] - before[1]))
    return _runs[key]


CASES = [(s, b) for s in SUITES for b in ("mk", "gloo")]


@pytest.mark.skipif(REASON is not None, reason=f"two namespace hosts unavailable: {REASON}")
@pytest.mark.netns
@pytest.mark.slow
@pytest.mark.parametrize("suite,backend", CASES, ids=[f"{s.removesuffix('_suite.py')}-{b}" for s, b in CASES])
def test_matches_reference_across_hosts(suite: str, backend: str) -> None:
    reports, _, (rx, tx) = run(suite, backend)
    assert sorted(rep["rank"] for rep in reports) == [0, 1, 2, 3]
    problems = [f"rank {rep['rank']}: {family}: {f}" for rep in reports for family in SUITES[suite][0]
                for f in rep["failures"].get(family, [])]
    assert not problems, "\n".join(problems[:20])
    # every family ran on every rank (gemm_suite times each family's checks; the others list every family,
    # empty when it passed, once they reach their end)
    missing = [(rep["rank"], f) for rep in reports for f in SUITES[suite][0]
               if not (rep["timings"].get(f, 0) > 0 if "timings" in rep else f in rep["failures"])]
    assert not missing, missing
    # the data crossed the link between the hosts, both ways
    assert rx > 64 << 10 and tx > 64 << 10, (rx, tx)


@pytest.mark.skipif(REASON is not None, reason=f"two namespace hosts unavailable: {REASON}")
@pytest.mark.netns
@pytest.mark.slow
@pytest.mark.parametrize("backend", ["mk", "gloo"])
def test_gemm_results_identical_on_every_rank(backend: str) -> None:
    """allgather_gemm and gemm_allreduce return the same bytes on all four ranks of both hosts."""
    reports, _, _ = run("gemm_suite.py", backend)
    first = next(rep for rep in reports if rep["rank"] == 0)
    assert first["digests"], "rank 0 recorded no digests"
    for rep in reports:
        differ = [k for k, v in first["digests"].items() if rep["digests"].get(k) != v]
        assert not differ, f"rank {rep['rank']} differs from rank 0 on {differ[:5]}"


@pytest.mark.skipif(REASON is not None, reason=f"two namespace hosts unavailable: {REASON}")
@pytest.mark.netns
@pytest.mark.slow
def test_mk_takes_the_cross_host_paths() -> None:
    """With a peer on the other host, the GEMM ops run their transport rings (gemm_reducescatter always,
    gemm_allreduce when 4 divides m) and agree by messages, never on the one-host shared-memory board."""
    _, stderrs, _ = run("gemm_suite.py", "mk")
    calls = [line for err in stderrs
             for line in re.findall(r"\[mk (?:allgather_gemm|gemm_allreduce|gemm_reducescatter) rank \d call \d+\] "
                                    r"m=.*", err)]
    assert calls, "no op trace lines (SUPERKERNEL_OPS_TRACE)"
    on_board = [c for c in calls if "agreement=board" in c]
    assert not on_board, on_board[:3]
    rings: dict[tuple[str, bool], int] = {}
    for err in stderrs:
        for op, rank, m, ring, want in ring_calls(err, 2 * PER_HOST, over_tcp=True, min_rows=1):
            assert ring == want, f"rank {rank}: {op} m={m} between hosts: ring={int(ring)}"
            rings[(op, ring)] = rings.get((op, ring), 0) + 1
    assert rings.get(("gemm_reducescatter", True)) and rings.get(("gemm_allreduce", True)), rings
    assert rings.get(("gemm_allreduce", False)), rings
