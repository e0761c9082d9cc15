"""Two hosts for real: two network namespaces joined by a veth pair, two ranks in each. Inside a host the
ranks talk over shared memory, between the hosts over TCP, and every collective is correct."""
from __future__ import annotations


import pytest

from tests.netns.hosts import TwoHosts, rank_reports, route_problems, run_torch_job, unavailable_reason
from tests.transport.world import HERE

REASON = unavailable_reason()
FAMILIES = ["all_reduce", "reduce", "broadcast", "all_gather", "gather_scatter", "reduce_scatter", "all_to_all",
            "send_recv", "misc"]
_reports: list[dict] = []


def reports() -> list[dict]:
    if not _reports:
        with TwoHosts() as hosts:
            results = run_torch_job(hosts, str(HERE / "collective_suite.py"), ["--large", "--per-host", "2"],
                                    nproc_per_host=2, timeout=900, env={"SUPERKERNEL_TRANSPORT": "auto", "SUPERKERNEL_FRONTEND": "0"})
        _reports.extend(rank_reports(results, per_host=2))
    return _reports


@pytest.mark.skipif(REASON is not None, reason=f"two namespace hosts unavailable: {REASON}")
def test_shm_inside_hosts_tcp_between() -> None:
    problems = [p for rep in reports() for p in route_problems(rep, per_host=2)]
    assert not problems, "\n".join(problems)


@pytest.mark.skipif(REASON is not None, reason=f"two namespace hosts unavailable: {REASON}")
@pytest.mark.parametrize("family", FAMILIES)
def test_every_collective_across_hosts(family: str) -> None:
    problems = [f"rank {rep['rank']}: {f}" for rep in reports() for f in rep["failures"].get(family, [])]
    assert not problems, "\n".join(problems[:20])
