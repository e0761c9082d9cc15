"""Which thread runs an mk collective (tests/ops/caller_world.py): small ones on the caller, large ones on
the backend's worker, a fused op's last collective on the op's own thread whatever its size (it waits for
it at once: a hand-off to the worker only adds thread switches), and the worker idle, so the next collective
may run on the caller, as soon as a queued one is over. Counted by superkernel.backend.collective_runs."""
from __future__ import annotations

import pytest

from tests.ops.ops_world import HERE
from tests.transport.world import run_world

SCRIPT = str(HERE / "caller_world.py")


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_collectives_run_on_the_caller_when_it_waits_at_once(transport: str) -> None:
    # (in-place shm paths of the op off: both transports take the collective path, one allreduce per chunk)
    env = {"SUPERKERNEL_TRANSPORT": transport, "SUPERKERNEL_OPS_IN_PLACE": "0"}
    results = run_world(2, SCRIPT, [], timeout=120, env=env)
    for res in results:
        assert res.returncode == 0, f"rank {res.rank}: exit {res.returncode}\n{res.stderr[-3000:]}"
        rep = res.report()
        r = rep["rank"]
        assert rep["wrong"] == [], f"rank {r}: {rep['wrong']}"
        runs = rep["runs"]
        assert runs["large"] == [0, 1], f"rank {r}: {runs}"
        assert runs["small"] == [1, 0], f"rank {r}: {runs}"
        assert runs["after_async"] == [1, 1], f"rank {r}: {runs}"
        # the op's one allreduce on its thread; with two chunks the first from its lane (queued: the lane is
        # not the caller that waits), the last on its thread
        assert runs["op_one_chunk"] == [1, 0], f"rank {r}: {runs}"
        assert runs["op_two_chunks"] == [1, 1], f"rank {r}: {runs}"
        assert sum(runs["mixed"]) == 2, f"rank {r}: {runs}"
