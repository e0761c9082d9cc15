"""ProcessGroupMK's worker releases a finished task's tensors without holding the group's lock
(tests/transport/release_world.py): a Python thread that holds the GIL and waits for that lock
(collective_runs) would otherwise deadlock with a worker that needs the GIL to drop a tensor Python made."""
from __future__ import annotations

from tests.transport.world import HERE, run_world


def test_worker_drops_tensors_outside_its_lock() -> None:
    results = run_world(2, str(HERE / "release_world.py"), [], timeout=60, env={"SUPERKERNEL_TRANSPORT": "shm"})
    for res in results:
        assert res.returncode == 0, f"rank {res.rank}: exit {res.returncode}\n{res.stderr[-3000:]}"
        rep = res.report()
        assert rep["sum"] == [3.0] * 4, rep
        # every one of the 300 large collectives went to the worker (else this tests nothing)
        assert rep["worker_runs"] >= 300, rep
