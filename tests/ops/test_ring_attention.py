"""mk.ring_attention against float64 scaled_dot_product_attention on the whole sequence (attention_suite.py) for
world sizes 1-4, over shared memory and TCP (SUPERKERNEL_TRANSPORT), and on Gloo (the backend's own
send/recv). Each world is started once and runs every case; the per-family results are asserted by separate
tests so a failure names the family, world and transport."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.transport.world import run_world

SUITE = str(Path(__file__).resolve().parent / "attention_suite.py")
# (world size, backend, SUPERKERNEL_TRANSPORT); opcheck runs in the 2-rank shm world
WORLDS = [(1, "mk", "auto"), (2, "mk", "shm"), (2, "mk", "tcp"), (3, "mk", "shm"), (3, "mk", "tcp"),
          (4, "mk", "shm"), (4, "mk", "tcp"), (3, "gloo", "auto")]
IDS = [f"{w}ranks-{b}-{t}" for w, b, t in WORLDS]
FAMILIES = ["attention", "errors", "opcheck"]
_cache: dict[tuple, list] = {}


def reports(world: int, backend: str, transport: str) -> list[dict]:
    key = (world, backend, transport)
    if key not in _cache:  # started once, even when it fails (every test of it then reports the failure)
        args = ["--backend", backend] + (["--opcheck"] if key == (2, "mk", "shm") else [])
        _cache[key] = run_world(world, SUITE, args, timeout=240, env={"SUPERKERNEL_TRANSPORT": transport})
    return [r.report() for r in _cache[key]]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("world,backend,transport", WORLDS, ids=IDS)
def test_ring_attention(world: int, backend: str, transport: str, family: str) -> None:
    problems = [f"rank {rep['rank']}: {f}" for rep in reports(world, backend, transport)
                for f in rep["failures"].get(family, [])]
    assert not problems, "\n".join(problems[:20])
