"""The folded agreement between two hosts (network namespaces joined by a veth pair; the protocol in
csrc/kernels/pipeline.h, Pipeline::fold_note), on Gloo (gemm_allreduce) and on mk (gemm_allreduce,
gemm_reducescatter and allgather_gemm): alike calls arm the group, later ones ride their collective without
agreeing, and any call that differs (other shapes on one rank or on all, another op, an argument error) disarms it
so the usual agreement runs: an error on every rank where the ranks differ, the right result where they all changed.
Checked with tests/ops/fold_world.py: results against float64, exactly which calls rode, the errors, one rank
refusing (SUPERKERNEL_OPS_FOLD=0), and a rank that stays away or exits while its peer rides."""
from __future__ import annotations

import re

import pytest

from tests.netns.hosts import ProcResult, TwoHosts, rank_reports, run_torch_job, unavailable_reason
from tests.ops.ops_world import HERE

REASON = unavailable_reason()
SCRIPT = str(HERE / "fold_world.py")
TRACE = {"SUPERKERNEL_OPS_TRACE": "1"}
hosts_needed = pytest.mark.skipif(REASON is not None, reason=f"two namespace hosts unavailable: {REASON}")

# fold_world.py's calls (0-based, per group) that ride: call 1 opens the side channel and settles it, and with
# call 0 arms the group (2 alike); a disarming makes it 4 until 4 calls rode, so each later phase of 8 alike
# calls ends with 4 that ride. Calls: fp32 0-9, bf16 10-17 (10 vetoes), shape 18, rearm 19-26, both 27,
# rearm2 28-35, order 36, rearm3 37-44, args 45, after 46, flip 47-54 (never armed), vary 55-62 (ranks other
# than 0 ask for another chunk count every other call: the group still arms, and flip's last call is alike).
SHARED = [*range(2, 10), *range(14, 18), *range(23, 27), *range(32, 36), *range(41, 45)]
RIDES = [*SHARED, *range(58, 63)]
# Four ranks (two per host): bfloat16 products are gathered and summed on each rank (not one allreduce), so the
# bf16 phase neither rides nor arms, and "shape" meets a disarmed group (its error comes from the agreement).
RIDES_4 = [*range(2, 10), *range(23, 27), *range(32, 36), *range(41, 45), *range(58, 63)]
# mk (2 or 4 ranks: its half-type allreduce sums bf16 products, so the bf16 phase rides too), then
# gemm_reducescatter: rs 55-62 (arms after 4 alike), rs_shape 63 (rank 1 vetoes), rs_after 64-75 (arms after 4);
# allgather_gemm: ag 76-83 (76 vetoes the reduce-scatter's arming), ag_shape 84 (rank 1 vetoes), ag_after 85-96;
# then vary 97-104.
RIDES_MK = [*SHARED, *range(59, 63), *range(68, 76), *range(80, 84), *range(89, 97), *range(101, 105)]
BACKENDS = {"gloo": {}, "mk": {"SUPERKERNEL_OPS_RING_MIN_ROWS": "100000"}}  # (mk: the one collective, no ring)


def rode(stderr: str, rank: int) -> list[int]:
    return [int(c) for c in re.findall(rf"\[mk \w+ rank {rank} call (\d+)\] m=.* agreement=fold", stderr)]


def two_host_job(mode: str, host_env: tuple[dict, dict] = ({}, {}), timeout: float = 240,
                 per_host: int = 1, backend: str = "gloo") -> list[ProcResult]:
    with TwoHosts() as hosts:
        return run_torch_job(hosts, SCRIPT, ["--mode", mode, "--backend", backend], nproc_per_host=per_host,
                             timeout=timeout, env={**TRACE, **BACKENDS[backend]}, host_env=host_env)


def check_errors(rep: dict, backend: str) -> None:
    r = rep["rank"]
    assert rep["wrong"] == [], f"rank {r}: wrong results at {rep['wrong']}"
    shape = rep["shape_error"]
    assert shape and "gemm_allreduce" in shape and "m differs" in shape, f"rank {r}: {shape}"
    order = rep["order_error"]
    assert order and "different fused-op calls" in order, f"rank {r}: {order}"
    args = rep["args_error"]
    want = "b is Double" if r == 1 else "rank 1 rejected its arguments"
    assert args and "gemm_allreduce" in args and want in args, f"rank {r}: {args}"
    if backend == "mk":  # (vetoes carried by the armed reduce-scatter and allgather)
        for op, key in (("gemm_reducescatter", "rs_shape_error"), ("allgather_gemm", "ag_shape_error")):
            err = rep[key]
            assert err and op in err and "m differs" in err, f"rank {r}: {err}"


@hosts_needed
@pytest.mark.netns
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("per_host", [1, 2])
def test_alike_calls_ride_and_any_difference_agrees_as_usual(per_host: int, backend: str) -> None:
    results = two_host_job("fold", per_host=per_host, backend=backend)
    if backend == "mk":
        rides, disarmed = RIDES_MK, [10, 18, 27, 36, 45, 63, 76, 84, 97]
    else:
        rides, disarmed = (RIDES, [10, 18, 27, 36, 45]) if per_host == 1 else (RIDES_4, [10, 27, 36, 45])
    reports = rank_reports(results, per_host=per_host)
    for rep in reports:
        r = rep["rank"]
        res = results[r // per_host]
        assert res.returncode == 0, f"rank {r}: exit {res.returncode}\n{res.stderr[-3000:]}"
        check_errors(rep, backend)
        assert rode(res.stderr, r) == rides, f"rank {r}: rode {rode(res.stderr, r)}"
        vetoes = re.findall(rf"\[mk \w+ rank {r} call \d+\] fold: call (\d+) does not ride", res.stderr)
        landed_not = re.findall(rf"\[mk \w+ rank {r} call \d+\] fold: rank (\d+) did not ride call (\d+)",
                                res.stderr)
        # each disarming: a rank whose call differs vetoes, a rank that rode sees it (all veto on "both")
        assert sorted({int(c) for c in vetoes} | {int(c) for _, c in landed_not}) == disarmed, \
            f"rank {r}: vetoes {vetoes}, saw {landed_not}"


@hosts_needed
@pytest.mark.netns
@pytest.mark.parametrize("backend", BACKENDS)
def test_one_rank_refusing_the_fold_keeps_the_agreement(backend: str) -> None:
    results = two_host_job("fold", host_env=({}, {"SUPERKERNEL_OPS_FOLD": "0"}), backend=backend)
    for rep, res in zip(rank_reports(results, per_host=1), results):
        r = rep["rank"]
        assert res.returncode == 0, f"rank {r}: exit {res.returncode}\n{res.stderr[-3000:]}"
        check_errors(rep, backend)
        assert rode(res.stderr, r) == [] and "fold:" not in res.stderr, f"rank {r}: {res.stderr[-3000:]}"


@hosts_needed
@pytest.mark.netns
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", ["timeout", "exit"])
def test_a_ride_without_its_peer_ends(mode: str, backend: str) -> None:
    """Rank 0 rides while rank 1 makes no call: the 2 s group timeout, or rank 1's exit, ends rank 0's wait
    with an error naming the op."""
    results = two_host_job(mode, timeout=120, backend=backend)
    (rep,) = rank_reports(results[:1], per_host=1)
    assert rep["wrong"] == [], rep
    assert rode(results[0].stderr, 0), "no call rode"
    err = rep["error"]
    assert err and "gemm_allreduce" in err, rep
    assert rep["seconds"] <= 15, rep
    if mode == "timeout":
        # (Gloo's own timeout or the op's wait, whichever says so first)
        assert "timed out" in err.lower() and rep["seconds"] >= 1.5, rep
