"""What PyTorch builds on torch.distributed, run on an mk default group and checked against the same
computation on one rank (tests/transport/torch_stack_suite.py): DistributedDataParallel, FSDP2's
fully_shard, DTensor on a DeviceMesh, batch_isend_irecv, the functional collectives (eager and under
torch.compile) and dist.split_group, at 2-4 ranks over shared memory and over TCP, with
TORCH_DISTRIBUTED_DEBUG=DETAIL (torch's checking wrapper in front of mk) and without. Each world is launched
once; the tests read its per-family report, so a failure names the family, the world and the transport."""
from __future__ import annotations

import pytest

from tests.transport.world import RankResult, run_world

# (ranks, transport, TORCH_DISTRIBUTED_DEBUG): with DETAIL torch wraps mk in its checking wrapper
WORLDS = [(2, "shm", "OFF"), (3, "tcp", "OFF"), (4, "shm", "OFF"), (2, "tcp", "DETAIL"), (3, "shm", "DETAIL")]
IDS = [f"{w}ranks-{t}" + ("-detail" if d == "DETAIL" else "") for w, t, d in WORLDS]
FAMILIES = ["ddp", "fsdp2", "dtensor", "batch_p2p", "funcol", "split_group", "debug"]
# families whose traffic is collectives, which the group counts (batch_isend_irecv is point to point)
COLLECTIVE = {"ddp", "fsdp2", "dtensor", "funcol", "debug"}
_cache: dict[tuple[int, str, str], list[RankResult]] = {}


def reports(world: int, transport: str, debug: str) -> list[dict]:
    if (world, transport, debug) not in _cache:
        _cache[(world, transport, debug)] = run_world(
            world, "torch_stack_suite.py", [], timeout=600,
            env={"SUPERKERNEL_TRANSPORT": transport, "TORCH_DISTRIBUTED_DEBUG": debug})
    return [r.report() for r in _cache[(world, transport, debug)]]


@pytest.mark.parametrize("world,transport,debug", WORLDS, ids=IDS)
def test_every_rank_reports_on_the_transport_asked_for(world: int, transport: str, debug: str) -> None:
    reps = reports(world, transport, debug)
    assert sorted(rep["rank"] for rep in reps) == list(range(world))
    for rep in reps:
        peers = [t for i, t in enumerate(rep["transports"]) if i != rep["rank"]]
        assert peers and all(t == transport for t in peers), rep["transports"]
        assert rep["debug"].endswith(debug), rep["debug"]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("world,transport,debug", WORLDS, ids=IDS)
def test_family_matches_one_rank(world: int, transport: str, debug: str, family: str) -> None:
    problems = []
    for rep in reports(world, transport, debug):
        problems += [f"rank {rep['rank']}: {p}" for p in rep["failures"].get(family, [])]
        if family in COLLECTIVE and not rep["runs"].get(family):
            problems.append(f"rank {rep['rank']}: the mk group ran no collective for {family}")
    assert not problems, "\n".join(problems[:20])
