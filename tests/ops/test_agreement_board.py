"""The fused ops' argument agreement on groups whose ranks share this host, on Gloo and on mk: after the first
agreements (a collective of Gloo, or mk's point-to-point messages, that also set the board up) the
descriptors travel through shared memory
(csrc/kernels/agreement_board.h). Checked here: it switches on at the same call on every rank, the results
stay right, mismatched shapes and mismatched ops still raise on every rank, a rank that stays away ends the
wait by the group timeout, by an interrupt or by its exit, and a rank that refuses the board
(SUPERKERNEL_OPS_BOARD=0) keeps the whole group on the collective."""
from __future__ import annotations

import re

import pytest

from tests.ops.ops_world import HERE
from tests.transport.world import RankResult, run_world

SCRIPT = str(HERE / "board_world.py")
TRACE = {"SUPERKERNEL_OPS_TRACE": "1"}


def board_calls(res: RankResult) -> tuple[list[int], list[int]]:
    """Call numbers of this rank's GEMM-op calls whose agreement used the board, and of those that did not."""
    on, off = [], []
    for call, rest in re.findall(r"\[mk (?:allgather_gemm|gemm_allreduce|gemm_reducescatter) rank \d+ call (\d+)\] "
                                 r"(m=.*)", res.stderr):
        (on if "agreement=board" in rest else off).append(int(call))
    return on, off


BACKENDS = ["gloo", "mk"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("world", [2, 3])
def test_board_in_use_and_errors_on_every_rank(world: int, backend: str) -> None:
    results = run_world(world, SCRIPT, ["--mode", "agree", "--backend", backend], timeout=120, env=TRACE)
    for res in results:
        assert res.returncode == 0, f"rank {res.rank}: exit {res.returncode}\n{res.stderr[-3000:]}"
        rep = res.report()
        assert rep["wrong"] == [], f"rank {res.rank}: wrong results at calls {rep['wrong']}"
        on, off = board_calls(res)
        # calls 0 and 1 travel as Gloo collectives (addresses, then "mapped"); from call 2 on, the board
        assert off == [0, 1] and on and min(on) == 2, f"rank {res.rank}: board calls {on}, collective calls {off}"
        shape = rep["shape_error"]
        assert shape and "gemm_allreduce" in shape and "m differs" in shape, f"rank {res.rank}: {shape}"
        order = rep["order_error"]
        assert order and "different fused-op calls" in order, f"rank {res.rank}: {order}"
        assert rep["after_ok"], f"rank {res.rank}: the call after the errors returned a wrong result"


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_rank_refusing_the_board_keeps_the_collective(backend: str) -> None:
    results = run_world(2, SCRIPT, ["--mode", "agree", "--backend", backend], timeout=120, env=TRACE,
                        per_rank_env={1: {"SUPERKERNEL_OPS_BOARD": "0"}})
    for res in results:
        assert res.returncode == 0, f"rank {res.rank}: exit {res.returncode}\n{res.stderr[-3000:]}"
        rep = res.report()
        assert rep["wrong"] == [] and rep["after_ok"], rep
        on, off = board_calls(res)
        assert not on and len(off) >= 6, f"rank {res.rank}: board calls {on}"
        assert rep["shape_error"] and "m differs" in rep["shape_error"], rep


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", ["timeout", "cancel", "exit"])
def test_wait_on_the_board_ends(mode: str, backend: str) -> None:
    """Rank 0 calls gemm_allreduce with the board in use, rank 1 does not: the 2 s group timeout, an interrupt
    after 1 s, or rank 1's exit ends rank 0's wait with an error naming the op."""
    results = run_world(2, SCRIPT, ["--mode", mode, "--backend", backend], timeout=90, env=TRACE)
    rep = results[0].report()
    assert rep["wrong"] == [], rep
    assert board_calls(results[0])[0], "the board was never used"
    err = rep["error"]
    assert err and "gemm_allreduce" in err and "rank 1" in err, rep
    if mode == "timeout":
        assert "timed out" in err and 1.5 <= rep["seconds"] <= 15, rep
    elif mode == "cancel":
        assert "interrupt" in err and rep["seconds"] <= 10, rep
    else:
        assert "exited" in err and rep["seconds"] <= 10, rep


@pytest.mark.parametrize("backend", BACKENDS)
def test_destroyed_groups_release_their_boards(backend: str) -> None:
    """30 groups created, used past the board's set-up and destroyed: the open descriptors stay flat (each
    board holds a memfd and a pidfd per peer until its group's state is dropped), and so do the threads (the
    backend's own end with destroy_process_group, an mk group's lane with the next group's first op)."""
    results = run_world(2, SCRIPT, ["--mode", "groups", "--backend", backend], timeout=300, env=TRACE)
    for res in results:
        assert res.returncode == 0, f"rank {res.rank}: exit {res.returncode}\n{res.stderr[-3000:]}"
        assert board_calls(res)[0], f"rank {res.rank}: the board was never used"
        rep = res.report()
        assert rep["wrong"] == [], f"rank {res.rank}: wrong results {rep['wrong']}"
        fds = rep["fds"]
        assert fds[-1] - fds[4] <= 4, f"rank {res.rank}: open descriptors per round {fds}"
        # Threads: those from before the first new group, plus at most one lane of an mk group (joined by
        # the next group's first op). A reference that outlived destroy_process_group kept the destroyed
        # group's backend, and so Gloo's run loops or mk's progress threads, alive.
        threads = rep["threads"]
        assert max(threads) <= rep["threads_before"] + (1 if backend == "mk" else 0), (
            f"rank {res.rank}: threads per round {threads}; now {rep['thread_names']}")


def test_descriptor_version_problem() -> None:
    """A peer's descriptor that starts with this build's word is accepted; "mkagree" with another version digit
    (a build whose descriptors mean something else) names both versions and asks for one build; any other
    word is a malformed descriptor."""
    from superkernel import _C

    ours = int.from_bytes(b"mkagree9", "big")
    assert _C.descriptor_version_problem(ours, 3) == ""
    older = _C.descriptor_version_problem(int.from_bytes(b"mkagree8", "big"), 3)
    assert older == ("rank 3 runs a superkernel build whose argument descriptors are version 8, this rank's are "
                     "version 9; every rank of a job must run the same build"), older
    assert _C.descriptor_version_problem(0, 1) == "rank 1 sent a malformed argument descriptor"
    assert _C.descriptor_version_problem(int.from_bytes(b"mkagreeX", "big"), 1) == \
        "rank 1 sent a malformed argument descriptor"
