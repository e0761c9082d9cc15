"""The fused ops' argument agreement on Gloo between two hosts (network namespaces joined by a veth pair): after
the first agreements through Gloo, the descriptors travel on a communicator of the mk transport of their own
(csrc/kernels/side_channel.h), not through Gloo. Checked here, with tests/ops/board_world.py: it switches on
at the same call on every rank, the results stay right, mismatched shapes and ops still raise on every rank,
a rank that stays away ends the wait by the group timeout, by an interrupt or by its exit, destroyed groups
release it, a rank that refuses it (SUPERKERNEL_OPS_SIDE_CHANNEL=0) or cannot open it keeps the whole group
on Gloo, and ranks on one host never open it (the shared-memory board takes their agreements)."""
from __future__ import annotations

import re

import pytest

from tests.netns.hosts import ProcResult, TwoHosts, rank_reports, run_torch_job, unavailable_reason
from tests.ops.ops_world import HERE
from tests.transport.world import run_world

REASON = unavailable_reason()
SCRIPT = str(HERE / "board_world.py")
TRACE = {"SUPERKERNEL_OPS_TRACE": "1"}
hosts_needed = pytest.mark.skipif(REASON is not None, reason=f"two namespace hosts unavailable: {REASON}")


def agreement_calls(stderr: str, rank: int) -> dict[str, list[int]]:
    """Call numbers of rank ``rank``'s GEMM-op calls by where their agreement went: "side", "board" or
    "backend"."""
    out: dict[str, list[int]] = {"side": [], "board": [], "backend": []}
    for call, rest in re.findall(rf"\[mk (?:allgather_gemm|gemm_allreduce|gemm_reducescatter) rank {rank} "
                                 rf"call (\d+)\] (m=.*)", stderr):
        where = re.search(r" agreement=(side|board)", rest)
        out[where.group(1) if where else "backend"].append(int(call))
    return out


def two_host_job(mode: str, host_env: tuple[dict, dict] = ({}, {}), timeout: float = 180) -> list[ProcResult]:
    """board_world.py on Gloo, one rank in each namespace host (rank 0 in host a); each host's result."""
    with TwoHosts() as hosts:
        return run_torch_job(hosts, SCRIPT, ["--mode", mode, "--backend", "gloo"], nproc_per_host=1,
                             timeout=timeout, env=TRACE, host_env=host_env)


def check_agree(results: list[ProcResult], side: bool) -> list[dict[str, list[int]]]:
    """The "agree" mode's results and errors on both ranks; returns each rank's agreement_calls. ``side``: the
    side channel must be in use from call 2 on (else never)."""
    reports = rank_reports(results, per_host=1)
    out = []
    for rep, res in zip(reports, results):
        r = rep["rank"]
        assert res.returncode == 0, f"rank {r}: exit {res.returncode}\n{res.stderr[-3000:]}"
        assert rep["wrong"] == [], f"rank {r}: wrong results at calls {rep['wrong']}"
        calls = agreement_calls(res.stderr, r)
        if side:
            # call 0 through Gloo says every rank may open it; call 1 opens it and says so; from call 2 on, it
            assert calls["backend"] == [0, 1] and calls["side"] and min(calls["side"]) == 2, f"rank {r}: {calls}"
        else:
            assert not calls["side"] and len(calls["backend"]) >= 6, f"rank {r}: {calls}"
        assert not calls["board"], f"rank {r}: {calls}"
        shape = rep["shape_error"]
        assert shape and "gemm_allreduce" in shape and "m differs" in shape, f"rank {r}: {shape}"
        order = rep["order_error"]
        assert order and "different fused-op calls" in order, f"rank {r}: {order}"
        assert rep["after_ok"], f"rank {r}: the call after the errors returned a wrong result"
        out.append(calls)
    return out


@hosts_needed
@pytest.mark.netns
def test_side_channel_in_use_and_errors_on_every_rank() -> None:
    results = two_host_job("agree")
    check_agree(results, side=True)
    for res in results:
        assert "could not be opened" not in res.stderr, res.stderr[-3000:]


@hosts_needed
@pytest.mark.netns
def test_one_rank_refusing_the_side_channel_keeps_gloo() -> None:
    check_agree(two_host_job("agree", host_env=({}, {"SUPERKERNEL_OPS_SIDE_CHANNEL": "0"})), side=False)


@hosts_needed
@pytest.mark.netns
def test_a_side_channel_that_cannot_open_leaves_gloo_in_charge() -> None:
    """Rank 1 cannot listen (no such interface): it warns at once; rank 0 waits for its address at most a
    quarter of the group's timeout (15 s here; kSideOpenTimeout, 60 s, at most), warns, and both keep Gloo."""
    results = two_host_job("agree", host_env=({}, {"SUPERKERNEL_SOCKET_IFNAME": "sk-no-such-if"}))
    check_agree(results, side=False)
    b = results[1].stderr
    assert "rank 1: the fused ops' agreement channel" in b and "sk-no-such-if" in b and "stay on gloo" in b, b[-3000:]
    assert "rank 0: the fused ops' agreement channel" in results[0].stderr, results[0].stderr[-3000:]


@hosts_needed
@pytest.mark.netns
@pytest.mark.parametrize("mode", ["timeout", "cancel", "exit"])
def test_wait_on_the_side_channel_ends(mode: str) -> None:
    """Rank 0 calls gemm_allreduce with the side channel in use, rank 1 does not: the 2 s group timeout, an
    interrupt after 1 s, or rank 1's exit ends rank 0's wait with an error naming the op and the peer."""
    results = two_host_job(mode, timeout=120)
    (rep,) = rank_reports(results[:1], per_host=1)
    assert rep["wrong"] == [], rep
    assert agreement_calls(results[0].stderr, 0)["side"], "the side channel was never used"
    err = rep["error"]
    assert err and "gemm_allreduce" in err and "peer 1" in err, rep
    if mode == "timeout":
        assert "timed out" in err and 1.5 <= rep["seconds"] <= 15, rep
    elif mode == "cancel":
        assert "interrupt" in err and rep["seconds"] <= 10, rep
    else:
        assert "closed the connection" in err and rep["seconds"] <= 10, rep


@hosts_needed
@pytest.mark.netns
def test_destroyed_groups_release_their_side_channels() -> None:
    """30 groups between the hosts, used past the side channel's opening and destroyed: open descriptors and
    threads stay flat (a destroyed group's channel goes with the next group's first op)."""
    results = two_host_job("groups", timeout=400)
    for rep, res in zip(rank_reports(results, per_host=1), results):
        r = rep["rank"]
        assert res.returncode == 0, f"rank {r}: exit {res.returncode}\n{res.stderr[-3000:]}"
        assert rep["wrong"] == [], f"rank {r}: wrong results {rep['wrong']}"
        assert len(agreement_calls(res.stderr, r)["side"]) > 30 * 4, f"rank {r}: the side channel was not used"
        fds, threads = rep["fds"], rep["threads"]
        assert fds[-1] - fds[4] <= 4, f"rank {r}: open descriptors per round {fds}"
        assert max(threads) - threads[4] <= 1, f"rank {r}: threads per round {threads}; now {rep['thread_names']}"


def test_ranks_on_one_host_never_open_it() -> None:
    """On one host the board takes Gloo's agreements (from call 2 on); no side channel is opened."""
    for res in run_world(2, SCRIPT, ["--mode", "agree", "--backend", "gloo"], timeout=120, env=TRACE):
        assert res.returncode == 0, f"rank {res.rank}: exit {res.returncode}\n{res.stderr[-3000:]}"
        calls = agreement_calls(res.stderr, res.rank)
        assert not calls["side"] and calls["board"] and min(calls["board"]) == 2, calls
