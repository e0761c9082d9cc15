"""Every collective of the mk backend against a float64/int64 reference, for world sizes 1-4, over shared
memory and over TCP. Each world is launched once (a session fixture) and the per-family results are
asserted by separate tests, so a failure names the family, world size and transport."""
from __future__ import annotations

import pytest

from tests.transport.world import run_world

WORLDS = [(1, "auto"), (2, "shm"), (2, "tcp"), (3, "shm"), (3, "tcp"), (4, "shm"), (4, "tcp")]
FAMILIES = ["all_reduce", "reduce", "broadcast", "all_gather", "gather_scatter", "reduce_scatter", "all_to_all",
            "send_recv", "p2p_waits", "misc"]
_cache: dict[tuple[int, str], list] = {}


def reports(world: int, transport: str) -> list[dict]:
    # launched once per world, even when it fails (the failure is then reported by every test of it)
    if (world, transport) not in _cache:
        _cache[(world, transport)] = run_world(world, "collective_suite.py", ["--large"] if world <= 3 else [],
                                               timeout=900, env={"SUPERKERNEL_TRANSPORT": transport})
    return [r.report() for r in _cache[(world, transport)]]


@pytest.mark.parametrize("world,transport", WORLDS, ids=[f"{w}ranks-{t}" for w, t in WORLDS])
def test_transport_choice(world: int, transport: str) -> None:
    for rep in reports(world, transport):
        peers = [t for i, t in enumerate(rep["transports"]) if i != rep["rank"]]
        want = "tcp" if transport == "tcp" else "shm"
        assert all(t == want for t in peers), f"rank {rep['rank']} transports {rep['transports']}"


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("world,transport", WORLDS, ids=[f"{w}ranks-{t}" for w, t in WORLDS])
def test_family(world: int, transport: str, family: str) -> None:
    problems = []
    for rep in reports(world, transport):
        for f in rep["failures"].get(family, []):
            problems.append(f"rank {rep['rank']}: {f}")
    assert not problems, "\n".join(problems[:20])
