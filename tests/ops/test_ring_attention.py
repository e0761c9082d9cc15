"""mk.ring_attention and its backward against float64 scaled_dot_product_attention (and its autograd) over the
whole sequence (attention_suite.py) for world sizes 1-4, over shared memory and TCP (SUPERKERNEL_TRANSPORT), and on Gloo
for 2-4 ranks (the backend's own send/recv: Gloo cannot coalesce p2p; NCCL's coalesced ring steps are
covered by test_nccl_ops.py, on hosts with 2 GPUs).
Each world is started once and runs every case; the per-family results are asserted by separate tests so a
failure names the family, world and transport. opcheck runs in the 2-rank shm world."""
from __future__ import annotations

import re

import pytest

from superkernel import _C

from tests.ops.ops_world import MK_WORLDS, WorldCache, failures_of, tuner_records, without_rule_changes

WORLDS = MK_WORLDS + [(2, "gloo"), (3, "gloo"), (4, "gloo")]
FAMILIES = ["attention", "grad", "errors", "opcheck"]
# (carrying off and the ring from one position on: the suite's shapes are small enough to travel inside the
# agreement, or to be gathered, which the tests below cover; these worlds test the ring itself)
worlds = WorldCache("attention_suite.py", timeout=240,
                    env={"SUPERKERNEL_OPS_TRACE": "1", "SUPERKERNEL_OPS_CARRY_BYTES": "0",
                         "SUPERKERNEL_OPS_ATTENTION_RING_MIN_SEQ": "1"})
_TRACE = {"SUPERKERNEL_OPS_TRACE": "1"}
_carry = WorldCache("attention_suite.py", timeout=240, env=_TRACE, gloo_env={**_TRACE, "SUPERKERNEL_OPS_BOARD": "0"})
_PATH = re.compile(r"^\[mk ring_attention rank (\d+) call \d+\] ((?:carried|short blocks), (?:no mask|causal)"
                   r"|ring|one host, no mask)", re.MULTILINE)


def paths_taken(stderr: str) -> list[str]:
    """The path of every traced call, except those made while the suite had changed the path rules."""
    return [p for _, p in _PATH.findall(without_rule_changes(stderr))]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("world,transport", WORLDS, ids=[f"{w}ranks-{t}" for w, t in WORLDS])
def test_ring_attention(world: int, transport: str, family: str) -> None:
    args = ["--opcheck"] if (world, transport) == (2, "shm") else []
    problems = failures_of(worlds.reports(world, transport, args), family)
    assert not problems, "\n".join(problems[:20])


MULTI = [(w, t) for w, t in MK_WORLDS if w > 1]


@pytest.mark.parametrize("world,transport", MULTI, ids=[f"{w}ranks-{t}" for w, t in MULTI])
def test_one_host_unmasked_path(world: int, transport: str) -> None:
    """Over shared memory an unmasked call gathers K/V and runs one attention call (the op trace says so);
    between hosts (tcp) the blocks circulate."""
    seen = 0
    for res in worlds.results(world, transport, ["--opcheck"] if (world, transport) == (2, "shm") else []):
        gathered = re.findall(r"\[mk ring_attention rank \d+ call \d+\] one host, no mask", res.stderr)
        if transport == "tcp":
            assert not gathered, f"rank {res.rank}: the gather path ran over tcp"
            assert "ring" in paths_taken(res.stderr), f"rank {res.rank}: no ring over tcp"
        seen += len(gathered)
    if transport != "tcp":
        assert seen, "no call took the one-host gather path"


@pytest.mark.parametrize("world,transport", [(2, "tcp"), (3, "tcp"), (2, "gloo"), (3, "gloo")],
                         ids=["2ranks-tcp", "3ranks-tcp", "2ranks-gloo", "3ranks-gloo"])
def test_small_calls_carried(world: int, transport: str) -> None:
    """With the default carry rule (at most 64 KiB of K/V, which goes to every peer), each rank's packed K/V
    travels inside the argument agreement: no ring steps follow, and one attention call covers the gathered
    sequence (causal: masked from the global positions, zigzag or not). Over tcp exactly the calls under the
    rule carry, at 3 ranks some with more than 64 KiB in all; the suite's largest shape (128 KiB a rank in
    float32) is gathered after the agreement (its blocks are under the ring threshold). The same on Gloo (with
    the board off). Outputs and gradients match float64 SDPA; argument errors are still raised on every rank."""
    results = _carry.results(world, transport, [])
    for res in results:
        paths = paths_taken(res.stderr)
        assert "carried, no mask" in paths and "carried, causal" in paths, f"rank {res.rank}: {set(paths)}"
        traced = re.findall(r"\] (carried|short blocks), .* \(K/V (\d+) B a rank\)",
                            without_rule_changes(res.stderr))
        for path, kv in traced:
            fits = int(kv) <= 65536
            assert (path == "carried") == fits, f"rank {res.rank}: {transport}: {path} with {kv} B of K/V"
        if world > 2:  # the limit is per peer: 64 KiB to each of 2 peers is carried
            assert any(p == "carried" and (world - 1) * int(kv) > 65536 for p, kv in traced), f"rank {res.rank}"
        if transport == "tcp":
            assert set(paths) <= {"carried, no mask", "carried, causal", "short blocks, no mask", "short blocks, causal"}
            assert any(p == "short blocks" for p, _ in traced), f"rank {res.rank}: no call above the rule"
    reps = [r.report() for r in results]
    for family in ("attention", "grad", "errors"):
        problems = failures_of(reps, family)
        assert not problems, "\n".join(problems[:20])


_short = WorldCache("attention_suite.py", timeout=240, env={**_TRACE, "SUPERKERNEL_OPS_CARRY_BYTES": "0"})


@pytest.mark.parametrize("world", [2, 3])
def test_short_blocks_gathered(world: int) -> None:
    """Across hosts (tcp) with carrying off and the default ring threshold (256 positions per rank, above every
    shape of the suite), K/V is gathered after the agreement and one attention call covers the sequence
    (causal: masked by global positions): every traced call says so, and the results match float64 SDPA."""
    results = _short.results(world, "tcp", [])
    for res in results:
        paths = set(paths_taken(res.stderr))
        assert paths == {"short blocks, no mask", "short blocks, causal"}, f"rank {res.rank}: {paths}"
    reps = [r.report() for r in results]
    for family in ("attention", "grad", "errors"):
        problems = failures_of(reps, family)
        assert not problems, "\n".join(problems[:20])


def test_unmasked_path_tuned_between_hosts() -> None:
    """Across hosts (tcp), with the default ring threshold and carrying off, an unmasked call at the threshold
    (256 positions per rank) takes the ring or the gather as the chunk tuner finds faster: while tuning both
    run, every rank takes the same path on every call (rank 0's proposal), tuning ends within its bound and
    then one path stays, each tuning call recorded on both ranks as the slower rank's time; every result
    matches float64 SDPA."""
    calls = 1 + _C.tuner_limits(2)["most_calls"] + 6
    results = _short.results(2, "tcp", ["--tune-path", str(calls)])
    per_rank = []
    for res in results:
        traced = re.findall(r"\[mk ring_attention rank \d+ call (\d+)\] (ring|tuned gather)", res.stderr)
        assert len(traced) == calls, f"rank {res.rank}: {len(traced)} traced calls of {calls}"
        per_rank.append([path for _, path in traced])
    assert per_rank[0] == per_rank[1], "the ranks took different paths"
    paths = per_rank[0]
    assert set(paths[: calls - 6]) == {"ring", "tuned gather"}, paths
    assert len(set(paths[-6:])) == 1, f"still switching after tuning: {paths[-6:]}"
    problems = tuner_records(results)
    assert not problems, "\n".join(problems[:20])
    reps = [r.report() for r in results]
    problems = failures_of(reps, "attention")
    assert not problems, "\n".join(problems[:20])


_widened = WorldCache("attention_suite.py", timeout=240,
                      env={"SUPERKERNEL_OPS_CARRY_BYTES": "0", "SUPERKERNEL_OPS_ATTENTION_RING_MIN_SEQ": "1",
                           "SUPERKERNEL_OPS_WIDEN_HALF": "1"})


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_half_types_widened(transport: str) -> None:
    """With SUPERKERNEL_OPS_WIDEN_HALF=1 (as on a processor whose oneDNN does not multiply the half type, where
    the ops make it in fp32): bf16 and fp16 outputs and gradients still match float64 SDPA, on one host (the
    backward's one call over every block) and between hosts (the own block apart from the gathered ones)."""
    reps = _widened.reports(2, transport, [])
    for family in ("attention", "grad"):
        problems = failures_of(reps, family)
        assert not problems, "\n".join(problems[:20])


def test_an_interrupt_ends_the_waits_on_gloo() -> None:
    """With the peer stopped while the ops run on Gloo, an interrupt (cancel_waits) ends the op's wait at once
    instead of after the 60 s timeout. The argument agreement is kept off the shared board, so every wait
    the stop can catch (for the peer's next descriptor, most often, or for a block) is a Gloo send/recv,
    which only a CancelHook's abort cuts short."""
    from pathlib import Path

    from tests.transport.world import run_world

    results = run_world(2, str(Path(__file__).with_name("cancel_midway.py")), [], timeout=120,
                        env={"SUPERKERNEL_OPS_BOARD": "0"})
    rep = results[0].report()
    assert rep["error"] is not None, "the op returned although its peer was stopped"
    assert "cancelled by an interrupt" in rep["error"] and "ring_attention" in rep["error"], rep["error"]
    assert rep["seconds"] < 5, rep
