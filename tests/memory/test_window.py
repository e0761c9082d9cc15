"""One-sided windows (superkernel.memory.Window) for world sizes 2-4, over shared memory and over TCP.
Each world runs tests/memory/window_suite.py once; each family's result is asserted by its own test, so a
failure names the family, world size and transport."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.netns.hosts import TwoHosts, rank_reports, route_problems, run_torch_job, unavailable_reason
from tests.transport.world import run_world

SUITE = str(Path(__file__).resolve().parent / "window_suite.py")
WORLDS = [(2, "shm"), (2, "tcp"), (3, "shm"), (3, "tcp"), (4, "shm"), (4, "tcp")]
FAMILIES = ["put_get", "accumulate", "fetch_add", "compare_swap", "notify", "fence", "async_ops", "errors",
            "fast_ops", "subgroup", "one_sided"]
_cache: dict[tuple[int, str, bool], list] = {}


def reports(world: int, transport: str, die: bool = False) -> list[dict]:
    key = (world, transport, die)
    if key not in _cache:
        _cache[key] = run_world(world, SUITE, ["--die"] if die else [], timeout=240,
                                env={"SUPERKERNEL_TRANSPORT": transport})
    results = _cache[key]
    return [r.report() for r in results if not (die and r.rank == 1)]


@pytest.mark.parametrize("world,transport", WORLDS, ids=[f"{w}ranks-{t}" for w, t in WORLDS])
def test_transport_choice(world: int, transport: str) -> None:
    for rep in reports(world, transport):
        peers = [t for i, t in enumerate(rep["transports"]) if i != rep["rank"]]
        assert all(t == transport for t in peers), f"rank {rep['rank']} transports {rep['transports']}"


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("world,transport", WORLDS, ids=[f"{w}ranks-{t}" for w, t in WORLDS])
def test_family(world: int, transport: str, family: str) -> None:
    problems = [f"rank {rep['rank']}: {f}" for rep in reports(world, transport)
                for f in rep["failures"].get(family, [])]
    assert not problems, "\n".join(problems[:20])


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_dead_target_raises_peer_error(transport: str) -> None:
    problems = [f"rank {rep['rank']}: {f}" for rep in reports(2, transport, die=True)
                for f in rep["failures"].get("die", [])]
    assert not problems, "\n".join(problems[:20])


TWO_HOSTS_REASON = unavailable_reason()


@pytest.mark.skipif(TWO_HOSTS_REASON is not None, reason=f"two namespace hosts unavailable: {TWO_HOSTS_REASON}")
def test_two_hosts_every_family() -> None:
    """Two network-namespace hosts with two ranks each: one window reached over shm inside a host and over
    tcp between them (so direct and progress-thread atomics meet on the same memory); rank 0 sleeps while
    ranks 1-3 operate on it."""
    with TwoHosts() as hosts:
        results = run_torch_job(hosts, SUITE, [], nproc_per_host=2, timeout=300,
                                env={"SUPERKERNEL_TRANSPORT": "auto", "SUPERKERNEL_FRONTEND": "0"})
    reps = rank_reports(results, per_host=2)
    problems = []
    for rep in reps:
        r = rep["rank"]
        problems += route_problems(rep, per_host=2)
        problems += [f"rank {r} {fam}: {f}" for fam, fs in rep["failures"].items() for f in fs]
    assert not problems, "\n".join(problems[:20])
