"""TensorStore across ranks over shared memory and TCP: put/get across ranks, concurrent puts from every
rank, keys(prefix), delete and reuse of space, a full pool's error (nothing evicted), large tensors, every
dtype, and the error cases. Each world runs every case once (store_suite.py); each test asserts one case."""
from __future__ import annotations


import pytest

from tests.netns.hosts import TwoHosts, rank_reports, route_problems, run_torch_job, unavailable_reason
from tests.transport.world import HERE as TRANSPORT_DIR, run_world

SUITE = str((TRANSPORT_DIR.parent / "memory" / "store_suite.py").resolve())
WORLDS = [(2, "shm", 64 << 20), (3, "tcp", 16 << 20), (3, "shm", 16 << 20)]
CASES = ["cross_rank", "concurrent", "keys_delete_reuse", "keys_log", "reuse", "full", "large", "dtypes", "errors", "subgroup",
         "uneven", "in_place", "publishing", "cold_get", "lock_waits"]
_cache: dict[tuple[int, str], list] = {}


def reports(world: int, transport: str, large: int) -> list[dict]:
    if (world, transport) not in _cache:
        _cache[(world, transport)] = run_world(world, SUITE, [str(large)], timeout=240,
                                               env={"SUPERKERNEL_TRANSPORT": transport})
    return [r.report() for r in _cache[(world, transport)]]


@pytest.mark.parametrize("world,transport,large", WORLDS, ids=[f"{w}ranks-{t}" for w, t, _ in WORLDS])
@pytest.mark.parametrize("case", CASES)
def test_store(world: int, transport: str, large: int, case: str) -> None:
    reps = reports(world, transport, large)
    assert len(reps) == world
    for rep in reps:
        peers = [t for i, t in enumerate(rep["transports"]) if i != rep["rank"]]
        assert all(t == transport for t in peers), rep["transports"]
        assert case in rep["cases"]
        assert not rep["failures"].get(case), "\n".join(rep["failures"][case])


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_dead_lock_holder_raises_peer_error(transport: str) -> None:
    """A rank that dies holding an allocator lock: the next put needing that lock raises PeerError naming the
    holder within seconds (the store's timeout is 60 s), and stored tensors stay readable."""
    results = run_world(2, SUITE, ["--dead-holder"], timeout=120, env={"SUPERKERNEL_TRANSPORT": transport})
    reps = [r.report() for r in results if r.rank == 0]
    assert len(reps) == 1 and reps[0]["cases"] == ["dead_holder"]
    assert not reps[0]["failures"].get("dead_holder"), "\n".join(reps[0]["failures"]["dead_holder"])
    assert "dead_holder_message" in reps[0]["timings"]


@pytest.mark.parametrize("mode", ["publish", "inplace"])
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_dead_writer_raises_peer_error(transport: str, mode: str) -> None:
    """A rank that dies while writing a tensor (a new one after its record went out, or one in place): a get
    raises PeerError naming it within seconds, and the key can be deleted and put again."""
    results = run_world(2, SUITE, [f"--dead-writer={mode}"], timeout=120, env={"SUPERKERNEL_TRANSPORT": transport})
    reps = [r.report() for r in results if r.rank == 0]
    assert len(reps) == 1 and reps[0]["cases"] == ["dead_writer"]
    assert not reps[0]["failures"].get("dead_writer"), "\n".join(reps[0]["failures"]["dead_writer"])
    assert "dead_writer_message" in reps[0]["timings"]


TWO_HOSTS_REASON = unavailable_reason()


@pytest.mark.skipif(TWO_HOSTS_REASON is not None, reason=f"two namespace hosts unavailable: {TWO_HOSTS_REASON}")
def test_two_hosts_every_case() -> None:
    """Two network-namespace hosts with two ranks each: one store whose allocators and data are reached over
    shm inside a host and over tcp between hosts, every case of the suite."""
    with TwoHosts() as hosts:
        results = run_torch_job(hosts, SUITE, [str(16 << 20)], nproc_per_host=2, timeout=240,
                                env={"SUPERKERNEL_TRANSPORT": "auto", "SUPERKERNEL_FRONTEND": "0"})
    reps = rank_reports(results, per_host=2)
    problems = []
    for rep in reps:
        r = rep["rank"]
        problems += route_problems(rep, per_host=2)
        assert set(rep["cases"]) == set(CASES)
        problems += [f"rank {r} {case}: {f}" for case, fs in rep["failures"].items() for f in fs]
    assert not problems, "\n".join(problems[:20])
