"""mk.moe_dispatch_gemm / mk.moe_combine against the unfused float64 computation (moe_suite.py) for world
sizes 1-4, over shared memory and TCP (SUPERKERNEL_TRANSPORT), and on Gloo (the backend's own send/recv).
Each world is started once and runs every case; the per-family results are asserted by separate tests so a
failure names the family, world and transport. opcheck runs in the 2-rank shm world, torch.compile
(fullgraph) in the 1-rank world."""
from __future__ import annotations

import pytest

from tests.ops.ops_world import MK_WORLDS, WorldCache, failures_of

WORLDS = MK_WORLDS + [(3, "gloo")]
FAMILIES = ["dispatch", "combine", "errors", "opcheck", "compile"]
worlds = WorldCache("moe_suite.py", timeout=240)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("world,transport", WORLDS, ids=[f"{w}ranks-{t}" for w, t in WORLDS])
def test_moe(world: int, transport: str, family: str) -> None:
    args = {(2, "shm"): ["--opcheck"], (1, "auto"): ["--compile"]}.get((world, transport), [])
    problems = failures_of(worlds.reports(world, transport, args), family)
    assert not problems, "\n".join(problems[:20])
