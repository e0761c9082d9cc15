"""mk.moe_dispatch_gemm / mk.moe_combine against the unfused float64 computation (moe_suite.py) for world
sizes 1-4, over shared memory and TCP (SUPERKERNEL_TRANSPORT), and on Gloo for 2-4 ranks (rows moved by the
backend's alltoall_base with uneven splits, the path NCCL takes too; the op's trace proves it ran).
Each world is started once and runs every case; the per-family results are asserted by separate tests so a
failure names the family, world and transport. opcheck runs in the 2-rank shm world, torch.compile
(fullgraph) in the 1-rank world."""
from __future__ import annotations

import re

import pytest

from tests.ops.ops_world import MK_WORLDS, WorldCache, failures_of

GLOO_WORLDS = [(2, "gloo"), (3, "gloo"), (4, "gloo")]
WORLDS = MK_WORLDS + GLOO_WORLDS
FAMILIES = ["dispatch", "combine", "grad", "errors", "opcheck", "compile"]
worlds = WorldCache("moe_suite.py", timeout=240, gloo_env={"SUPERKERNEL_OPS_TRACE": "1"})


def args_for(world: int, transport: str) -> list[str]:
    return {(2, "shm"): ["--opcheck"], (1, "auto"): ["--compile"]}.get((world, transport), [])


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("world,transport", WORLDS, ids=[f"{w}ranks-{t}" for w, t in WORLDS])
def test_moe(world: int, transport: str, family: str) -> None:
    problems = failures_of(worlds.reports(world, transport, args_for(world, transport)), family)
    assert not problems, "\n".join(problems[:20])


@pytest.mark.parametrize("world,transport", GLOO_WORLDS, ids=[f"{w}ranks-{t}" for w, t in GLOO_WORLDS])
def test_gloo_moves_rows_by_alltoall(world: int, transport: str) -> None:
    """On Gloo both ops took the alltoall_base path: dispatch in one or more steps when rows cross ranks
    (and none when every row stays local), combine once per call; never the point-to-point path."""
    for res in worlds.results(world, transport, args_for(world, transport)):
        dispatch = re.findall(r"moe_dispatch_gemm rank \d+ call \d+\] alltoall_base path: (\d+) rows cross ranks "
                              r"in (\d+) steps", res.stderr)
        combine = re.findall(r"moe_combine rank \d+ call \d+\] alltoall_base path", res.stderr)
        assert dispatch and combine, f"rank {res.rank}: no alltoall_base trace:\n{res.stderr[-2000:]}"
        assert any(int(steps) > 1 for _, steps in dispatch), "no dispatch was pipelined over several steps"
        assert any(rows == "0" and steps == "0" for rows, steps in dispatch), "no all-local dispatch"
        assert all((rows == "0") == (steps == "0") for rows, steps in dispatch)


_TRACE = {"SUPERKERNEL_OPS_TRACE": "1"}
# every dispatch and combine with the default carry rules: over tcp, and on Gloo with the board off (on one
# host the board takes the agreement from the third call on, and carried data never rides on it)
_carry = WorldCache("moe_suite.py", timeout=240, env=_TRACE, gloo_env={**_TRACE, "SUPERKERNEL_OPS_BOARD": "0"})
_MOE_TRACE = re.compile(r"^\[mk (moe_dispatch_gemm|moe_combine) rank (\d+) call (\d+)\] t=(\d+) k=(\d+) E_r=(\d+)"
                        r"(?: h=(\d+))? f=(\d+) (\w+) sends (\d+)/(\d+)( carried)?$", re.MULTILINE)
CARRY_BYTES = 64 << 10  # the most a MoE call carries to one peer (kCarryMax); to all: R - 1 times that


def _carry_paths(stderrs: list[str], world: int) -> dict[tuple[str, bool, bool], int]:
    """Checks every traced call's path against the carry rule and counts its calls by (op, carried, what a
    rank sent to all peers together passed 64 KiB). Each rank traces what it would carry: the most to one peer
    and the sum over its peers (a dispatch's expert counts and rows, a combine's rows going back). A call
    carries (mk over tcp, and Gloo with the board off: from the first call of a size on) exactly when every
    rank's most to one peer is within 64 KiB, whatever the sums."""
    calls: dict[tuple[str, int], list[tuple[int, int, int, bool]]] = {}
    for stderr in stderrs:
        for op, rank, call, _t, _k, _er, _h, _f, _dtype, most, total, carried in _MOE_TRACE.findall(stderr):
            calls.setdefault((op, int(call)), []).append((int(rank), int(most), int(total), bool(carried)))
    assert calls, "no traced MoE call with its carry sizes"
    seen: dict[tuple[str, bool, bool], int] = {}
    for (op, call), ranks in calls.items():
        assert sorted(r for r, *_ in ranks) == list(range(world)), f"{op} call {call}: traced by ranks {ranks}"
        carried = {c for *_, c in ranks}
        assert len(carried) == 1, f"{op} call {call}: carried on some ranks only: {ranks}"
        want = max(most for _, most, _, _ in ranks) <= CARRY_BYTES
        assert carried == {want}, f"{op} call {call}: carried {carried.pop()}, the rule says {want}: {ranks}"
        key = (op, want, max(total for _, _, total, _ in ranks) > CARRY_BYTES)
        seen[key] = seen.get(key, 0) + 1
    return seen


@pytest.mark.parametrize("world,transport", [(2, "tcp"), (3, "tcp"), (2, "gloo"), (3, "gloo")],
                         ids=["2ranks-tcp", "3ranks-tcp", "2ranks-gloo", "3ranks-gloo"])
def test_small_calls_carried(world: int, transport: str) -> None:
    """Across hosts (tcp) and on Gloo, a small dispatch carries its expert counts and routed rows inside the
    argument agreement, and a small combine the rows going back (one exchange instead of the agreement's
    round trip and the op's own: two for a dispatch, whose counts were an allgather). Every traced call takes
    the path the rule gives; the results (forward and backward) match the float64 reference and the argument
    errors are still raised on every rank."""
    results = _carry.results(world, transport, [])
    seen = _carry_paths([res.stderr for res in results], world)
    for op in ("moe_dispatch_gemm", "moe_combine"):
        carried = sum(n for (o, c, _), n in seen.items() if o == op and c)
        assert carried and sum(n for (o, c, _), n in seen.items() if o == op and not c), seen
        if world > 2:  # the rule is per peer: calls whose sends to all peers pass 64 KiB carry too
            assert seen.get((op, True, True)), seen
    reps = [r.report() for r in results]
    for family in ("dispatch", "combine", "grad", "errors"):
        problems = failures_of(reps, family)
        assert not problems, "\n".join(problems[:20])
