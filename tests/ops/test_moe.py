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
