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
from tests.ops.ops_world import HERE, RING_ON_SMALL_SHAPES, gemm_paths

REASON = unavailable_reason()
PER_HOST = 2
# suite -> (its failure families, extra arguments)
SUITES = {
    "gemm_suite.py": (["allgather_gemm", "gemm_allreduce", "gemm_reducescatter", "empty", "grad", "errors"],
                      ["--errors"]),
    "moe_suite.py": (["dispatch", "combine", "grad", "errors"], []),
    "attention_suite.py": (["attention", "grad", "errors"], []),
}
_runs: dict[tuple[str, str, bool], tuple[list[dict], list[str], tuple[int, int]]] = {}


def run(suite: str, backend: str, defaults: bool = False) -> tuple[list[dict], list[str], tuple[int, int]]:
    """(every rank's REPORT, each host's stderr, bytes host a received and sent on its veth) of one job: with
    the rings on the suite's small shapes, or with ``defaults`` the default path rules (small calls carried
    in the agreement)."""
    key = (suite, backend, defaults)
    if key not in _runs:
        with TwoHosts() as hosts:
            before = hosts.a.link_bytes()
            results = run_torch_job(hosts, str(HERE / suite), ["--backend", backend, *SUITES[suite][1]],
                                    nproc_per_host=PER_HOST, timeout=600,
                                    env={"SUPERKERNEL_OPS_TRACE": "1", "SUPERKERNEL_FRONTEND": "0",
                                         **({} if defaults else RING_ON_SMALL_SHAPES)})
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
        for op, rank, m, took, want, per_peer in gemm_paths(err, 2 * PER_HOST, over_tcp=True, min_rows=1):
            assert took == want, f"rank {rank}: {op} m={m} between hosts: {took}, not {want}"
            rings[(op, took == "ring")] = rings.get((op, took == "ring"), 0) + 1
    assert rings.get(("gemm_reducescatter", True)) and rings.get(("gemm_allreduce", True)), rings
    assert rings.get(("gemm_allreduce", False)), rings


@pytest.mark.skipif(REASON is not None, reason=f"two namespace hosts unavailable: {REASON}")
@pytest.mark.netns
@pytest.mark.slow
@pytest.mark.parametrize("backend", ["mk", "gloo"])
def test_carries_small_calls_between_hosts(backend: str) -> None:
    """With the default rules, small calls carry their payload inside the agreement's messages: on mk to the
    other host's ranks over TCP and to this host's over shared memory, every call taking the path the rules
    give; on Gloo in the agreement's send/recv to every rank, under the GEMM ops' 256 KiB rule there, every
    call alike. The suite (float64 references, gradients, mismatch errors) passes with identical results
    everywhere."""
    reports, stderrs, _ = run("gemm_suite.py", backend, defaults=True)
    problems = [f"rank {rep['rank']}: {family}: {f}" for rep in reports for family in SUITES["gemm_suite.py"][0]
                for f in rep["failures"].get(family, [])]
    assert not problems, "\n".join(problems[:20])
    paths: dict[tuple[str, str], int] = {}
    for err in stderrs:
        gloo = backend == "gloo"
        for op, rank, m, took, want, per_peer in gemm_paths(err, 2 * PER_HOST, over_tcp=True, min_rows=64, gloo=gloo,
                                                            carry=True):
            assert took == want, f"rank {rank}: {op} m={m} between hosts: {took}, not {want}"
            paths[(op, took)] = paths.get((op, took), 0) + 1
    for op in ("allgather_gemm", "gemm_allreduce", "gemm_reducescatter"):
        assert paths.get((op, "carried")), paths
    first = next(rep for rep in reports if rep["rank"] == 0)
    for rep in reports:
        differ = [k for k, v in first["digests"].items() if rep["digests"].get(k) != v]
        assert not differ, f"rank {rep['rank']} differs from rank 0 on {differ[:5]}"


# the traced calls of the MoE and attention ops, and whether they carried
_CARRIED_TRACE = re.compile(r"^\[mk (moe_dispatch_gemm|moe_combine|ring_attention) rank \d+ call \d+\] (.*)$",
                            re.MULTILINE)


@pytest.mark.skipif(REASON is not None, reason=f"two namespace hosts unavailable: {REASON}")
@pytest.mark.netns
@pytest.mark.slow
@pytest.mark.parametrize("suite", ["moe_suite.py", "attention_suite.py"])
@pytest.mark.parametrize("backend", ["mk", "gloo"])
def test_moe_and_attention_carry_between_hosts(suite: str, backend: str) -> None:
    """With the default rules the MoE ops and ring_attention carry small calls inside the agreement (mk: to
    the other host over TCP and to this host's peer over shared memory, sizes per pair for the MoE ops; Gloo:
    in the agreement's send/recv): carried calls of every op of the suite, and the suite's references,
    gradients and errors pass on all four ranks. On mk attention carries a block of up to 64 KiB of K/V (sent
    to each of the three peers, more than 64 KiB in all), and a larger one is gathered after the agreement."""
    reports, stderrs, _ = run(suite, backend, defaults=True)
    problems = [f"rank {rep['rank']}: {family}: {f}" for rep in reports for family in SUITES[suite][0]
                for f in rep["failures"].get(family, [])]
    assert not problems, "\n".join(problems[:20])
    carried: dict[str, int] = {}
    gathered_large = carried_above_one_peer = 0
    for err in stderrs:
        for op, rest in _CARRIED_TRACE.findall(err):
            if rest.endswith(" carried") or rest.startswith("carried"):
                carried[op] = carried.get(op, 0) + 1
            kv = re.search(r"\(K/V (\d+) B a rank\)", rest)
            if kv and backend == "mk":
                if rest.startswith("carried"):
                    assert int(kv.group(1)) <= 65536, rest
                    carried_above_one_peer += 3 * int(kv.group(1)) > 65536
                else:
                    assert rest.startswith("short blocks") and int(kv.group(1)) > 65536, rest
                    gathered_large += 1
    if suite == "attention_suite.py" and backend == "mk":
        assert gathered_large, "no call with more than 64 KiB of K/V to each peer took the gather path"
        assert carried_above_one_peer, "no call with more than 64 KiB of K/V in all was carried"
    ops = ["moe_dispatch_gemm", "moe_combine"] if suite == "moe_suite.py" else ["ring_attention"]
    assert all(carried.get(op) for op in ops), carried


@pytest.mark.skipif(REASON is not None, reason=f"two namespace hosts unavailable: {REASON}")
@pytest.mark.netns
@pytest.mark.slow
def test_mk_rings_move_half_types_in_half_the_bytes() -> None:
    """One rank per host, the rings of gemm_allreduce and gemm_reducescatter across the hosts, bytes each host
    sends per call (tests/ops/ring_bytes.py). fp32 sends at least its terms (2 ranks: the reduce-scatter's
    block and the allgather's, 4 bytes an element). A half type multiplied as it is travels as made and
    gemm_allreduce's reduced blocks as rounded: about half of fp32's bytes. Widened (a processor without
    oneDNN support for it) the reduce-scatter step sends fp32 and only the allgather halves. mk's own
    all_reduce and reduce_scatter of half-type tensors (one rank per host: every term travels as it is, sums
    in fp32) send about half of fp32's bytes too."""
    with TwoHosts() as hosts:
        # (the threshold set, at its default: the rings on every call, never the tuner's plain path)
        results = run_torch_job(hosts, str(HERE / "ring_bytes.py"), [], nproc_per_host=1, timeout=300,
                                env={"SUPERKERNEL_FRONTEND": "0", "SUPERKERNEL_OPS_RING_MIN_ROWS": "64"})
    reports = rank_reports(results, per_host=1)
    for rep in reports:
        m, _, n = rep["shape"]
        sent = rep["bytes_per_call"]
        assert sent["gemm_allreduce float32"] >= m * n * 4, sent
        assert sent["gemm_reducescatter float32"] >= m // 2 * n * 4, sent
        assert sent["all_reduce float32"] >= m * n * 4 and sent["reduce_scatter float32"] >= m // 2 * n * 4, sent
        for dtype, native in rep["native"].items():
            for op in ("all_reduce", "reduce_scatter"):
                ratio = sent[f"{op} {dtype}"] / sent[f"{op} float32"]
                assert ratio < 0.6, (rep["rank"], op, dtype, ratio, sent)
            ar = sent[f"gemm_allreduce {dtype}"] / sent["gemm_allreduce float32"]
            rs = sent[f"gemm_reducescatter {dtype}"] / sent["gemm_reducescatter float32"]
            if native:
                assert ar < 0.6 and rs < 0.6, (rep["rank"], dtype, ar, rs, sent)
            else:
                assert ar < 0.85 and rs > 0.9, (rep["rank"], dtype, ar, rs, sent)


@pytest.mark.skipif(REASON is not None, reason=f"two namespace hosts unavailable: {REASON}")
@pytest.mark.netns
@pytest.mark.slow
def test_mk_half_allreduce_with_two_ranks_per_host_sends_its_partial_sums_once() -> None:
    """Two ranks per host: the host's partial sum of fp16/bf16 terms is fp32 (a sum of two terms), so the
    leaders' ring sends it as fp32 on its reduce-scatter step and the reduced segments, rounded, in the half
    type: 3 bytes an element at 2 hosts, against 4 for fp32 (the buffer widened to fp32 for the whole way
    sent as many bytes as fp32, ratio 1.0)."""
    with TwoHosts() as hosts:
        results = run_torch_job(hosts, str(HERE / "ring_bytes.py"), ["--collectives-only"], nproc_per_host=2,
                                timeout=300, env={"SUPERKERNEL_FRONTEND": "0"})
    reports = rank_reports(results, per_host=2)
    for rep in reports:
        m, _, n = rep["shape"]
        sent = rep["bytes_per_call"]
        assert sent["all_reduce float32"] >= m * n * 4, sent
        for dtype in ("float16", "bfloat16"):
            ratio = sent[f"all_reduce {dtype}"] / sent["all_reduce float32"]
            assert 0.7 < ratio < 0.85, (rep["rank"], dtype, ratio, sent)
