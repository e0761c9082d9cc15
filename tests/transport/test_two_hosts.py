"""Two hosts for real: two network namespaces joined by a veth pair, two ranks in each. Inside a host the
ranks talk over shared memory, between the hosts over TCP, and every collective is correct."""
from __future__ import annotations

import json

import pytest

from tests.netns.hosts import TwoHosts, run_torch_job, unavailable_reason
from tests.transport.world import HERE

REASON = unavailable_reason()
FAMILIES = ["all_reduce", "reduce", "broadcast", "all_gather", "gather_scatter", "reduce_scatter", "all_to_all",
            "send_recv", "misc"]
_reports: list[dict] = []


def reports() -> list[dict]:
    if not _reports:
        with TwoHosts() as hosts:
            results = run_torch_job(hosts, str(HERE / "collective_suite.py"), ["--large"], nproc_per_host=2,
                                    timeout=900, env={"SUPERKERNEL_TRANSPORT": "auto", "SUPERKERNEL_FRONTEND": "0"})
        for res in results:
            found = [json.loads(line[7:]) for line in res.stdout.splitlines() if line.startswith("REPORT ")]
            assert len(found) == 2, (f"host {res.host} exit {res.returncode} timed_out={res.timed_out}\n"
                                     f"{res.stdout[-2000:]}\n{res.stderr[-4000:]}")
            _reports.extend(found)
    return _reports


@pytest.mark.skipif(REASON is not None, reason=f"two namespace hosts unavailable: {REASON}")
def test_shm_inside_hosts_tcp_between() -> None:
    for rep in reports():
        r = rep["rank"]
        for peer, t in enumerate(rep["transports"]):
            want = "self" if peer == r else ("shm" if peer // 2 == r // 2 else "tcp")
            assert t == want, f"rank {r} reaches rank {peer} over {t}, expected {want}"


@pytest.mark.skipif(REASON is not None, reason=f"two namespace hosts unavailable: {REASON}")
@pytest.mark.parametrize("family", FAMILIES)
def test_every_collective_across_hosts(family: str) -> None:
    problems = [f"rank {rep['rank']}: {f}" for rep in reports() for f in rep["failures"].get(family, [])]
    assert not problems, "\n".join(problems[:20])
