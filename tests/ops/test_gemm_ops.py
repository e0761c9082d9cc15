"""allgather_gemm, gemm_allreduce and gemm_reducescatter (torch.ops.mk.*) against the unfused reference in
float64, for world sizes 1-4 over shm and tcp and once over Gloo; cross-rank mismatch errors on every
rank; torch.library.opcheck in a 1-rank and a 2-rank world; a torch.compile(fullgraph=True) trace through
the fake kernels. One world start per configuration (tests/ops/gemm_suite.py runs every case)."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

from superkernel import _C
from tests.ops.ops_world import (CARRY_BYTES, HERE, MK_WORLDS, RING_ON_SMALL_SHAPES,
                                 WorldCache, failures_of, gemm_paths, tuner_records)

WORLDS = MK_WORLDS + [(2, "gloo"), (3, "gloo")]
OPS = ["allgather_gemm", "gemm_allreduce", "gemm_reducescatter", "empty", "grad"]
# (the rings across hosts also on the suite's small shapes, whose blocks have fewer rows than the default
# SUPERKERNEL_OPS_RING_MIN_ROWS, and which would otherwise be carried in the agreement:
# test_ring_rows_threshold checks the default ring rule, test_small_calls_carried the default rules)
_worlds = WorldCache("gemm_suite.py", timeout=300,
                     env={"SUPERKERNEL_OPS_TRACE": "1", **RING_ON_SMALL_SHAPES})
_ring_rule = WorldCache("gemm_suite.py", timeout=300,
                        env={"SUPERKERNEL_OPS_TRACE": "1", "SUPERKERNEL_OPS_CARRY_BYTES": "0"})
# rank 1's model gives another chunk count than rank 0's (as its own link estimate or compute rate can)
_models_apart = WorldCache("gemm_suite.py", timeout=300,
                           env={"SUPERKERNEL_OPS_TRACE": "1", "SUPERKERNEL_OPS_CARRY_BYTES": "0"},
                           per_rank_env={1: {"SUPERKERNEL_TEST_MODELED_CHUNKS": "3"}})
_default_rules = WorldCache("gemm_suite.py", timeout=300, env={"SUPERKERNEL_OPS_TRACE": "1"})
# (Gloo agrees through its shared-memory board from the third call on one host: off, so every agreement is the
# allgather that carries)
_gloo_carry = WorldCache("gemm_suite.py", timeout=300, env={"SUPERKERNEL_OPS_TRACE": "1", "SUPERKERNEL_OPS_BOARD": "0"})
# half types multiplied on operands widened to fp32 (the path of processors without oneDNN bf16/fp16)
_widened = WorldCache("gemm_suite.py", timeout=300, env={"SUPERKERNEL_OPS_WIDEN_HALF": "1"})


# rank 1 alone widens, as one host of a cluster whose processors differ in oneDNN bf16/fp16 support (the others
# multiply every half type oneDNN supports as it is, without measuring which is faster)
_mixed = WorldCache("gemm_suite.py", timeout=300, env={"SUPERKERNEL_OPS_WIDEN_HALF": "0"})


# rank 0 makes every half-type GEMM it can widened (SUPERKERNEL_OPS_SMALL_HALF_GEMM at its cap), rank 1 none
_limits = WorldCache("gemm_suite.py", timeout=300, env={"SUPERKERNEL_OPS_WIDEN_HALF": "0"})


def args_for(world: int, transport: str) -> list[str]:
    args = ["--errors"]
    if world <= 2 and transport in ("auto", "shm"):
        args += ["--opcheck", "--compile"]
    if (world == 2 and transport == "shm") or (world == 4 and transport == "shm"):
        args.append("--large")
    return args


def reports(world: int, transport: str) -> list[dict]:
    return _worlds.reports(world, transport, args_for(world, transport))


IDS = [f"{w}ranks-{t}" for w, t in WORLDS]


@pytest.mark.parametrize("family", OPS)
@pytest.mark.parametrize("world,transport", WORLDS, ids=IDS)
def test_matches_float64_reference(world: int, transport: str, family: str) -> None:
    reps = reports(world, transport)
    problems = failures_of(reps, family)
    assert not problems, "\n".join(problems[:20])


def assert_exact_half_sums(reps: list[dict]) -> None:
    """The suite checked half-type sums bit for bit (at least 4 results per half type) and none failed; skips
    where this processor has oneDNN support for neither half type (the ops then widen)."""
    if not reps[0]["exact_half_types"]:
        pytest.skip("oneDNN on this processor multiplies neither bfloat16 nor float16 as it is: the ops widen")
    for rep in reps:
        assert rep["exact_half_sums"] >= 4 * len(rep["exact_half_types"]), rep["exact_half_sums"]
    for family in ("gemm_allreduce", "gemm_reducescatter"):
        problems = failures_of(reps, family)
        assert not problems, "\n".join(problems[:20])


@pytest.mark.parametrize("world", [2, 3])
def test_gloo_half_sums_are_exact(world: int) -> None:
    """On Gloo the half-type products are summed on each rank (fp32, rank order, rounded once): with one chunk
    gemm_allreduce and gemm_reducescatter return exactly that sum of `a @ b` (checked inside the suite's cases,
    failures under their families); here, that the check ran."""
    assert_exact_half_sums(reports(world, "gloo"))


@pytest.mark.parametrize("world", [2, 3, 4])
def test_mk_half_sums_are_exact_on_one_host(world: int) -> None:
    """On mk over shared memory the half-type products travel as made and mk's collective sums them in fp32, in
    rank order, rounding once: with one chunk gemm_allreduce and gemm_reducescatter return exactly that sum of
    `a @ b` whenever a rank's whole product fits one staging slot (checked inside the suite's cases, failures
    under their families); here, that the check ran."""
    assert_exact_half_sums(reports(world, "shm"))


@pytest.mark.parametrize("world,transport", [(2, "shm"), (3, "tcp"), (2, "gloo")],
                         ids=["2ranks-shm", "3ranks-tcp", "2ranks-gloo"])
def test_widened_half_types_match_float64(world: int, transport: str) -> None:
    """With SUPERKERNEL_OPS_WIDEN_HALF=1 the ops multiply bfloat16 and float16 on operands widened to fp32, as on
    a processor without oneDNN support for them (this one may have it): every op, dtype and gradient of the suite
    still matches the float64 reference, and the results are the same bytes on every rank."""
    reps = _widened.reports(world, transport, ["--large"] if transport == "shm" else [])
    for family in OPS:
        problems = failures_of(reps, family)
        assert not problems, "\n".join(problems[:20])
    for rep in reps[1:]:
        differ = [k for k, v in reps[0]["digests"].items() if rep["digests"].get(k) != v]
        assert not differ, f"rank {rep['rank']} differs from rank 0 on {differ[:5]}"


@pytest.mark.parametrize("value,bf16,fp16", [("", None, None), ("0", None, None), ("1", False, False),
                                              ("bfloat16", False, None), ("float16", None, False),
                                              ("float16,bfloat16", False, False)])
def test_widen_half_variable(value: str, bf16: bool | None, fp16: bool | None) -> None:
    """SUPERKERNEL_OPS_WIDEN_HALF names the half types the ops widen (None: multiplied as they are where oneDNN
    supports them on this processor); the forward ops (C++) and the backward formulas (Python) follow it."""
    script = ("import torch, superkernel\nfrom superkernel import _C\nfrom superkernel.ops import autograd\n"
              "print(_C.half_gemm_native('bfloat16'), _C.half_gemm_native('float16'),"
              " sorted(str(t) for t in autograd._WIDENED_ON_CPU))")
    out = subprocess.run([sys.executable, "-c", script], env={**os.environ, "SUPERKERNEL_OPS_WIDEN_HALF": value},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    got_bf16, got_fp16, widened = out.stdout.split(" ", 2)
    want_bf16 = torch.ops.mkldnn._is_mkldnn_bf16_supported() if bf16 is None else bf16
    want_fp16 = torch.ops.mkldnn._is_mkldnn_fp16_supported() if fp16 is None else fp16
    assert (got_bf16, got_fp16) == (str(want_bf16), str(want_fp16)), out.stdout
    want_widened = sorted(name for name, native in (("torch.bfloat16", want_bf16), ("torch.float16", want_fp16))
                          if not native)
    assert widened.strip() == str(want_widened), out.stdout


@pytest.mark.parametrize("value", ["bf16", "bfloat16,", "yes"])
def test_widen_half_variable_rejects_unknown_values(value: str) -> None:
    """A value that names no half type fails `import superkernel` on every rank with the variable named, before
    any op runs (a rank that decided alone would leave the others waiting in an agreement)."""
    out = subprocess.run([sys.executable, "-c", "import superkernel"],
                         env={**os.environ, "SUPERKERNEL_OPS_WIDEN_HALF": value},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert f"SUPERKERNEL_OPS_WIDEN_HALF={value}: expected 1, 0, or bfloat16 and/or float16" in out.stderr, \
        out.stderr[-2000:]


@pytest.mark.skipif(not (torch.ops.mkldnn._is_mkldnn_bf16_supported()
                         or torch.ops.mkldnn._is_mkldnn_fp16_supported()),
                    reason="this processor widens bfloat16 and float16 anyway: every rank would multiply alike")
@pytest.mark.parametrize("world,transport", [(2, "shm"), (2, "gloo"), (3, "gloo"), (3, "tcp")],
                         ids=["2ranks-shm", "2ranks-gloo", "3ranks-gloo", "3ranks-tcp"])
def test_ranks_that_multiply_half_types_differently(world: int, transport: str) -> None:
    """A cluster whose processors differ: rank 1 widens bf16/fp16 to fp32 (SUPERKERNEL_OPS_WIDEN_HALF=1 there
    only) while the others multiply them with oneDNN, so its partial products are fp32 and theirs the half type.
    Every op, dtype, chunk count and gradient of the suite still matches float64 (carried, collective, in-place
    shm and Gloo's own-summing paths: each is chosen from every rank's product type), and the results are the
    same bytes on every rank (allgather_gemm widens on every rank then)."""
    reps = _mixed.reports(world, transport, ["--widen-half-on", "1"])
    onednn = {"torch.bfloat16": torch.ops.mkldnn._is_mkldnn_bf16_supported(),
              "torch.float16": torch.ops.mkldnn._is_mkldnn_fp16_supported()}
    for rep in reps:  # (the variable reached rank 1's process, and only it)
        assert rep["half_native"] == ({t: False for t in onednn} if rep["rank"] == 1 else onednn), rep["half_native"]
    for family in OPS:
        problems = failures_of(reps, family)
        assert not problems, "\n".join(problems[:20])
    keys = list(reps[0]["digests"])
    assert any("torch.bfloat16" in k for k in keys) and any("torch.float16" in k for k in keys), keys[:5]
    for rep in reps[1:]:
        differ = [k for k in keys if rep["digests"].get(k) != reps[0]["digests"][k]]
        assert not differ, f"rank {rep['rank']} differs from rank 0 on {differ[:5]}"


@pytest.mark.skipif(not (torch.ops.mkldnn._is_mkldnn_bf16_supported()
                         or torch.ops.mkldnn._is_mkldnn_fp16_supported()),
                    reason="this processor widens bfloat16 and float16 anyway: no small-GEMM limit applies")
@pytest.mark.parametrize("world,transport,limits", [(2, "shm", f"0:{1 << 23},1:0"), (3, "gloo", f"0:{1 << 23},1:0"),
                                                     (3, "gloo", "0:0,1:1,2:1")],
                         ids=["2ranks-shm", "3ranks-gloo", "3ranks-gloo-native"])
def test_ranks_with_different_small_gemm_limits(world: int, transport: str, limits: str) -> None:
    """Ranks that measured different small-GEMM limits (here set: rank 0 at 2^23, rank 1 at 0): each makes its
    own partial products by its own limit, and the half-type sums are still exact against every rank's products
    as that rank makes them; allgather_gemm multiplies every block by rank 0's limit on every rank, so its
    results are the same bytes everywhere (the suite's k = 2048 cases make the two forms differ).
    "native": every limit makes every product as it is, but ranks 1 and 2 hold another value than rank 0's, so on
    Gloo they cannot use their own rows' early product; they still multiply block by block as rank 0 does (as one
    GEMM they returned other bytes on an Intel VM with AMX, whose bf16 GEMM rounds by the rows it is given)."""
    reps = _limits.reports(world, transport, ["--small-half-gemm-on", limits])
    set_on = {int(r): int(v) for r, v in (item.split(":") for item in limits.split(","))}
    for rep in reps:  # (each rank given one holds its limit, for a type it multiplies as it is; others measure)
        for t, native in rep["half_native"].items():
            if rep["rank"] in set_on:
                assert rep["small_limits"][t] == (set_on[rep["rank"]] if native else 0), (rep["rank"], t, rep)
    for family in OPS:
        problems = failures_of(reps, family)
        assert not problems, "\n".join(problems[:20])
    assert_exact_half_sums(reps)
    for rep in reps[1:]:
        differ = [k for k, v in reps[0]["digests"].items() if rep["digests"].get(k) != v]
        assert not differ, f"rank {rep['rank']} differs from rank 0 on {differ[:5]}"
    assert any("/2048/" in k for k in reps[0]["digests"]), "no k = 2048 allgather_gemm digest"


@pytest.mark.parametrize("world,transport", WORLDS, ids=IDS)
def test_results_identical_on_every_rank(world: int, transport: str) -> None:
    """allgather_gemm and gemm_allreduce return the same bytes on every rank."""
    reps = reports(world, transport)
    assert reps[0]["digests"], "rank 0 recorded no digests"
    for rep in reps[1:]:
        differ = [k for k, v in reps[0]["digests"].items() if rep["digests"].get(k) != v]
        assert not differ, f"rank {rep['rank']} differs from rank 0 on {differ[:5]}"


@pytest.mark.parametrize("world,transport", WORLDS, ids=IDS)
def test_errors_on_every_rank(world: int, transport: str) -> None:
    """Shapes/dtypes that disagree across ranks, and a bad argument on one rank, raise on every rank naming
    the op and the ranks; the group stays usable."""
    problems = failures_of(reports(world, transport), "errors")
    assert not problems, "\n".join(problems[:20])


@pytest.mark.parametrize("world", [1, 2])
def test_opcheck(world: int) -> None:
    transport = "auto" if world == 1 else "shm"
    problems = failures_of(reports(world, transport), "opcheck")
    assert not problems, "\n".join(problems[:20])
    assert all(rep["timings"].get("opcheck", 0) > 0 for rep in reports(world, transport))


@pytest.mark.parametrize("world", [1, 2])
def test_compile_fullgraph(world: int) -> None:
    transport = "auto" if world == 1 else "shm"
    problems = failures_of(reports(world, transport), "compile")
    assert not problems, "\n".join(problems[:20])
    assert all(rep["timings"].get("compile", 0) > 0 for rep in reports(world, transport))


@pytest.mark.parametrize("mode", ["timeout", "cancel"])
def test_waits_end_by_timeout_or_interrupt(mode: str) -> None:
    """A rank whose peer never calls the op gets an error naming the op: after the group timeout (2 s), or at
    once on an interrupt (cancel_waits), never a hang."""
    from tests.transport.world import run_world

    results = run_world(2, str(HERE / "gemm_stuck.py"), ["--mode", mode], timeout=60)
    rep = results[0].report()
    assert rep["error"] is not None, "gemm_allreduce returned although rank 1 never called it"
    assert "gemm_allreduce" in rep["error"], rep["error"]
    if mode == "timeout":
        assert 1.5 <= rep["seconds"] <= 15, rep
    else:
        assert "cancel" in rep["error"].lower(), rep["error"]
        assert rep["seconds"] <= 10, rep


def test_own_failure_mid_op_ends_every_rank() -> None:
    """The op's own work fails on one rank after the collective began (an allocation of its in-place GEMM,
    a half type on one host): that rank reports the failure, and the peer, already inside the collective, gets
    an error at once (the communicator is aborted) instead of waiting out the group timeout (60 s)."""
    from tests.transport.world import run_world

    # The failing allocation is the widening of a chunk of a, made for a half type that oneDNN cannot
    # multiply on this processor (the ops multiply the others as they are), or that the ops are told to widen.
    widened = [name for name, fast in (("float16", torch.ops.mkldnn._is_mkldnn_fp16_supported()),
                                       ("bfloat16", torch.ops.mkldnn._is_mkldnn_bf16_supported())) if not fast]
    env = {"SUPERKERNEL_OPS_TRACE": "1"}
    if not widened:
        widened, env["SUPERKERNEL_OPS_WIDEN_HALF"] = ["float16"], "1"
    results = run_world(2, str(HERE / "gemm_stuck.py"), ["--mode", "oom", "--dtype", widened[0]], timeout=120,
                        env=env)
    reps = {r.rank: r.report() for r in results}
    assert "in place" in results[1].stderr, results[1].stderr[-2000:]
    failed, peer = reps[1], reps[0]
    assert failed["error"] and "allocate" in failed["error"], failed
    assert peer["error"] and "gemm_allreduce" in peer["error"] and "abort" in peer["error"], peer
    assert "peer 1" in peer["error"], peer
    assert peer["seconds"] < 15 and failed["seconds"] < 15, reps


MULTI = [(w, t) for w, t in MK_WORLDS if w > 1]


@pytest.mark.parametrize("world,transport", MULTI, ids=[f"{w}ranks-{t}" for w, t in MULTI])
def test_ring_paths(world: int, transport: str) -> None:
    """Rings straight over the transport: gemm_allreduce over tcp when R divides m (reduce-scatter, then
    allgather of the reduced blocks); gemm_reducescatter over tcp. Otherwise (one host) each chunk's
    collective is an mk collective, and an automatic chunk count is 1. The op trace (SUPERKERNEL_OPS_TRACE)
    shows the agreed path and chunk count of every call."""
    seen: dict[tuple[str, bool], int] = {}
    for res in _worlds.results(world, transport, args_for(world, transport)):
        for line in re.findall(r"\[mk (?:allgather_gemm|gemm_allreduce|gemm_reducescatter) rank \d+ call \d+\] .*",
                               res.stderr):
            auto = re.search(r" chunks=(\d+) \(proposed \d+, automatic\)", line)
            if auto and transport != "tcp":
                assert auto.group(1) == "1", f"rank {res.rank}: automatic chunk count on one host: {line}"
                seen[("automatic", False)] = seen.get(("automatic", False), 0) + 1
        for op, rank, m, took, want, per_peer in gemm_paths(res.stderr, world, transport == "tcp", min_rows=1):
            assert took == want, f"rank {rank}: {op} m={m} over {transport}: {took}, not {want}"
            seen[(op, want == "ring")] = seen.get((op, want == "ring"), 0) + 1
    if transport == "tcp":
        assert seen.get(("gemm_allreduce", True)) and seen.get(("gemm_allreduce", False)), seen
        assert seen.get(("gemm_reducescatter", True)), seen
    else:
        assert seen.get(("gemm_allreduce", False)), seen
        assert seen.get(("gemm_reducescatter", False)) and seen.get(("automatic", False)), seen


@pytest.mark.parametrize("world", [2, 3])
def test_ring_rows_threshold(world: int) -> None:
    """With the default SUPERKERNEL_OPS_RING_MIN_ROWS (64), the rings across hosts are taken only for blocks
    of 64 rows or more (the suite's m=130 and mb=130/256 cases); smaller calls run one GEMM and mk's
    collective, and still match the float64 reference."""
    results = _ring_rule.results(world, "tcp", [])
    seen: dict[tuple[str, bool], int] = {}
    for res in results:
        for op, rank, m, took, want, per_peer in gemm_paths(res.stderr, world, over_tcp=True, min_rows=64):
            assert took == want, f"rank {rank}: {op} m={m}: {took}, not {want}, with 64-row blocks the threshold"
            seen[(op, took == "ring")] = seen.get((op, took == "ring"), 0) + 1
    for op in ("allgather_gemm", "gemm_allreduce", "gemm_reducescatter"):
        assert seen.get((op, False)), seen
    assert seen.get(("allgather_gemm", True)) and seen.get(("gemm_reducescatter", True)), seen
    if world == 2:  # (m = 130 is the suite's one shape with 64-row blocks that 2 divides)
        assert seen.get(("gemm_allreduce", True)), seen
    for family in ("allgather_gemm", "gemm_allreduce", "gemm_reducescatter"):
        problems = failures_of([r.report() for r in results], family)
        assert not problems, "\n".join(problems[:20])


@pytest.mark.parametrize("models", ["alike", "apart"])
def test_rings_tuned_against_the_plain_path(models: str) -> None:
    """Across hosts (tcp) with the default ring threshold and an automatic chunk count, each GEMM op times its
    plain path (one GEMM and mk's collective) beside the ring's chunk counts: while tuning both run, every rank
    takes the same path on every call (rank 0's proposal), tuning ends within its bound and then one path
    stays; every result matches the float64 reference, and allgather_gemm's and gemm_allreduce's are the same
    bytes on both ranks. Each tuning call is recorded on both ranks as the slower rank's time, so both tuners
    choose alike at the same call, also when rank 1's model gives another count than rank 0's ('apart': it
    takes rank 0's candidates from its first proposal; before, its tuner never finished), and from then on
    rank 1 proposes what rank 0 does."""
    calls = 1 + _C.tuner_limits()["most_calls"] + 6
    results = (_ring_rule if models == "alike" else _models_apart).results(2, "tcp", ["--tune-plain", str(calls)])
    trace = re.compile(r"\[mk (allgather_gemm|gemm_allreduce|gemm_reducescatter) rank \d+ call \d+\] m=(?:96|128) "
                       r"k(?:_r)?=\d+ n=24 (\w+) chunks=(\d+|plain) \(proposed (\d+|plain), automatic\)")
    per_rank = []
    for res in results:
        agreed: dict[tuple[str, str], list[str]] = {}
        for op, dtype, chunks, proposed in trace.findall(res.stderr):
            # (every rank's tuner proposes the count agreed, rank 0's, but another rank on the first call)
            assert proposed == chunks or (res.rank != 0 and (op, dtype) not in agreed), \
                f"rank {res.rank}: {op} {dtype} call {len(agreed.get((op, dtype), []))}: proposed {proposed}, " \
                f"agreed {chunks}"
            agreed.setdefault((op, dtype), []).append(chunks)
        assert len(agreed) == 6 and all(len(v) == calls for v in agreed.values()), \
            f"rank {res.rank}: {[(k, len(v)) for k, v in agreed.items()]}"
        per_rank.append(agreed)
        for op, rank, m, took, want, per_peer in gemm_paths(res.stderr, 2, over_tcp=True, min_rows=64):
            assert took == want, f"rank {rank}: {op} m={m}: {took}, not {want}"
    assert per_rank[0] == per_rank[1], "the ranks took different paths"
    problems = tuner_records(results)
    assert not problems, "\n".join(problems[:20])
    for key, paths in per_rank[0].items():
        tuning = set(paths[: calls - 6])
        assert "plain" in tuning and tuning - {"plain"}, f"{key}: {paths}"
        assert len(set(paths[-6:])) == 1, f"{key}: still switching after tuning: {paths[-6:]}"
    reps = [r.report() for r in results]
    for family in ("allgather_gemm", "gemm_allreduce", "gemm_reducescatter"):
        problems = failures_of(reps, family)
        assert not problems, "\n".join(problems[:20])
    assert any(k.startswith("tune/ar/") for k in reps[0]["digests"]), "rank 0 recorded no digests"
    differ = [k for k, v in reps[0]["digests"].items() if reps[1]["digests"].get(k) != v]
    assert not differ, f"rank 1 differs from rank 0 on {differ[:5]}"


@pytest.mark.parametrize("world", [2, 3, 4])
def test_small_calls_carried(world: int) -> None:
    """Across hosts (tcp) with the default rules, a call whose payload is small (at most 64 KiB sent to each
    peer; gemm_allreduce, whose direct sends cost more than its ring, at most 64 KiB in all) and whose chunk
    count is automatic carries it inside the argument agreement: one exchange instead of two. Every traced
    call takes the path the rules give (carried, ring or collective); from 3 ranks on, some allgather_gemm and
    gemm_reducescatter calls carry more than 64 KiB in all. The carried results match the float64 reference,
    are the same bytes on every rank, and the mismatch errors are still raised on every rank with the group
    usable after them."""
    results = _default_rules.results(world, "tcp", ["--errors"])
    seen: dict[tuple[str, str], int] = {}
    # (op, path) of the calls within 64 KiB to each peer but above it in all (took == want checks their rule)
    above_one_peer: set[tuple[str, str]] = set()
    for res in results:
        for op, rank, m, took, want, per_peer in gemm_paths(res.stderr, world, over_tcp=True, min_rows=64,
                                                            carry=True):
            assert took == want, f"rank {rank}: {op} m={m}: {took}, not {want}"
            seen[(op, took)] = seen.get((op, took), 0) + 1
            if per_peer <= CARRY_BYTES < (world - 1) * per_peer:
                above_one_peer.add((op, took))
    for op in ("allgather_gemm", "gemm_allreduce", "gemm_reducescatter"):
        assert seen.get((op, "carried")) and seen.get((op, "collective")), seen
    if world > 2:  # the suite's 48 KiB per peer calls
        want = {("allgather_gemm", "carried"), ("gemm_reducescatter", "carried"), ("gemm_allreduce", "collective")}
        assert want <= above_one_peer, above_one_peer
    reps = [r.report() for r in results]
    for family in ("allgather_gemm", "gemm_allreduce", "gemm_reducescatter", "grad", "empty", "errors"):
        problems = failures_of(reps, family)
        assert not problems, "\n".join(problems[:20])
    assert reps[0]["digests"], "rank 0 recorded no digests"
    for rep in reps[1:]:
        differ = [k for k, v in reps[0]["digests"].items() if rep["digests"].get(k) != v]
        assert not differ, f"rank {rep['rank']} differs from rank 0 on {differ[:5]}"


@pytest.mark.parametrize("world", [2, 3])
def test_gloo_small_calls_carried(world: int) -> None:
    """On Gloo the agreement's messages are the backend's send/recv, each receive posted 4 MiB past the descriptor,
    so every call under the GEMM ops' rule there (an automatic chunk count, at most 256 KiB to a peer, allgather_gemm
    4 MiB, and gemm_allreduce at most that in all; 512 KiB to the peer on two ranks) carries its payload, from its first call and whatever earlier
    calls sent; every other call takes the collective path. Some carried calls are above mk's 64 KiB, an
    allgather_gemm shard above 256 KiB is carried and one above 4 MiB is not; results match the float64 reference,
    are the same bytes on every rank, and the errors are raised on every rank with the group usable after them."""
    results = _gloo_carry.results(world, "gloo", ["--errors"])
    carried: dict[str, int] = {}
    big_shards: dict[tuple[int, str], int] = {}
    pair_products: dict[tuple[int, str], int] = {}  # the suite's fp32 m=256/257 k=8 n=512 gemm_allreduce
    above_mk = 0
    for res in results:
        for op, rank, m, took, want, per_peer in gemm_paths(res.stderr, world, over_tcp=True, min_rows=64,
                                                            carry=True, gloo=True):
            assert took == want, f"rank {rank}: {op} m={m} on Gloo: {took}, not {want}"
            if took == "carried":
                carried[op] = carried.get(op, 0) + 1
                above_mk += op == "gemm_allreduce" and m == 96  # the suite's m=96 k=8 n=256 product: 96 KiB
            big_shards[(m, took)] = big_shards.get((m, took), 0) + (op == "allgather_gemm" and m in (320, 1040))
            if op == "gemm_allreduce" and per_peer == m * 512 * 4 and m in (256, 257):
                pair_products[(m, took)] = pair_products.get((m, took), 0) + 1
    assert set(carried) == {"allgather_gemm", "gemm_allreduce", "gemm_reducescatter"}, carried
    assert above_mk, "no call above mk's 64 KiB limit was carried (the suite's m=96 k=8 n=256 gemm_allreduce)"
    # the suite's fp32 shards of 320 x 1024 (1.25 MiB) and 1040 x 1024 (4.06 MiB), on every rank
    assert big_shards.get((320, "carried")) == world and big_shards.get((1040, "collective")) == world, big_shards
    # two ranks carry gemm_allreduce's product up to 512 KiB (kPairCarryBytes), more ranks 256 KiB in all
    assert pair_products == ({(256, "carried"): 2, (257, "collective"): 2} if world == 2
                             else {(256, "collective"): world, (257, "collective"): world}), pair_products
    reps = [r.report() for r in results]
    for family in ("allgather_gemm", "gemm_allreduce", "gemm_reducescatter", "grad", "empty", "errors"):
        problems = failures_of(reps, family)
        assert not problems, "\n".join(problems[:20])
    for rep in reps[1:]:
        differ = [k for k, v in reps[0]["digests"].items() if rep["digests"].get(k) != v]
        assert not differ, f"rank {rep['rank']} differs from rank 0 on {differ[:5]}"


_REQUESTED = re.compile(r"\[mk (allgather_gemm|gemm_allreduce|gemm_reducescatter) rank \d+ call \d+\] m=(\d+) .* "
                        r"chunks=(\d+) \(proposed (\d+), requested (\d+)\)(?: return_gathered=\d)?(?: ring=(\d))?")


MULTIRANK = [(w, t) for w, t in WORLDS if w > 1]


@pytest.mark.parametrize("world,transport", MULTIRANK, ids=[f"{w}ranks-{t}" for w, t in MULTIRANK])
def test_requested_chunks_are_used(world: int, transport: str) -> None:
    """chunks=N is used as asked, bounded by the rows there are to split (m for allgather_gemm and
    gemm_allreduce, m/R per block for gemm_reducescatter and for gemm_allreduce's ring), on every backend and
    path. (gemm_allreduce once clamped every request to 1 off its ring path: on Gloo it never overlapped.)"""
    seen: dict[str, int] = {}
    for res in _worlds.results(world, transport, args_for(world, transport)):
        for op, m, agreed, proposed, requested, ring in _REQUESTED.findall(res.stderr):
            m, requested = int(m), int(requested)
            rows = m // world if op == "gemm_reducescatter" or (op == "gemm_allreduce" and ring == "1") else m
            want = min(requested, max(rows, 1))
            assert int(proposed) == want, f"rank {res.rank}: {op} m={m} requested {requested}: proposed {proposed}"
            assert int(agreed) == want, f"rank {res.rank}: {op} m={m} requested {requested}: agreed {agreed}"
            if want > 1:
                seen[op] = seen.get(op, 0) + 1
    assert set(seen) == {"allgather_gemm", "gemm_allreduce", "gemm_reducescatter"}, seen


_TRACE = re.compile(r"\[mk (allgather_gemm|gemm_allreduce|gemm_reducescatter) rank (\d+) call (\d+)\] m=(\d+) "
                    r"k(?:_r)?=(\d+) n=(\d+) (\w+) chunks=(\d+)")
_HALF_PRODUCTS = re.compile(r"\[mk (allgather_gemm|gemm_allreduce|gemm_reducescatter) rank (\d+) call (\d+)\] m=.* "
                            r"half_products=(\d)")
_IN_PLACE = re.compile(r"\[mk (allgather_gemm|gemm_allreduce|gemm_reducescatter) rank (\d+) call (\d+)\] in place: "
                       r"(\d+) rows per chunk")


def expect_in_place(op: str, world: int, slot_bytes: int, m: int, kmax: int, nmax: int, dtype: str,
                    chunks: int, half_products: bool) -> int:
    """Rows per chunk the in-place shm path should use for a call (0: not in place), as
    csrc/kernels/gemm_collectives.cc decides: a row must fit in a slot, and the GEMMs it splits the product into
    must pay for themselves ((G - 1) (k n + H) <= 2 x the elements of staging copy saved, H = _C.HALF_GEMM_CALL
    (2^19, the fixed cost of a GEMM oneDNN makes in a half type) when every rank makes them so, else 0) unless
    chunks were asked for. k and n are the
    largest any rank passed. gemm_allreduce and gemm_reducescatter stage fp32 terms, or half-type products as
    made when every rank makes them so; an fp32 row must fit either way."""
    term = 2 if half_products and dtype != "Float" else 4
    if op == "allgather_gemm":
        rows, row, pieces, gemms, saved = m, kmax * (4 if dtype == "Float" else 2), 1, world, world * m * kmax
    elif op == "gemm_allreduce":
        rows, row, pieces, gemms, saved = m if nmax > 0 else 0, term * nmax, 1, 1, m * nmax
    else:
        rows, row, pieces, gemms, saved = m // world if nmax > 0 else 0, term * nmax, world, world, m * nmax
    if rows == 0 or row == 0:
        return 0
    if op != "allgather_gemm" and slot_bytes < 4 * nmax * pieces:
        return 0
    per = min(slot_bytes // (row * pieces), -(-rows // chunks))
    if per == 0:
        return 0
    if chunks > 1:
        return per
    if op == "gemm_reducescatter" and per == rows:
        gemms = 1   # a chunk of every row of every block is the whole product: one GEMM into the slot
    g = -(-rows // per) * gemms
    call_cost = _C.HALF_GEMM_CALL if half_products else 0
    return per if (g - 1) * (kmax * nmax + call_cost) <= 2 * saved else 0


def in_place_calls(stderrs: list[str], world: int, slot_bytes: int) -> tuple[int, int]:
    """Check every traced GEMM op call of every rank on one host against expect_in_place. Returns (calls in
    place, calls with rows that fit a slot but did not go in place because splitting would not pay, or rows
    wider than a slot), counted on rank 0."""
    calls: dict[tuple[str, str], list[tuple]] = {}
    placed: dict[tuple[str, str, str], int] = {}
    half: dict[tuple[str, str], list[str]] = {}
    for stderr in stderrs:
        for op, _rank, call, h in _HALF_PRODUCTS.findall(stderr):
            half.setdefault((op, call), []).append(h)
        for op, rank, call, m, k, n, dtype, chunks in _TRACE.findall(stderr):
            calls.setdefault((op, call), []).append((rank, int(m), int(k), int(n), dtype, int(chunks)))
        for op, rank, call, rows in _IN_PLACE.findall(stderr):
            placed[(op, rank, call)] = int(rows)
    seen = [0, 0]
    for (op, call), per_rank in calls.items():
        assert len(per_rank) == world, (op, call, per_rank)
        kmax, nmax = max(x[2] for x in per_rank), max(x[3] for x in per_rank)
        _, m, _, _, dtype, chunks = per_rank[0]
        want = expect_in_place(op, world, slot_bytes, m, kmax, nmax, dtype, chunks,
                               min(half.get((op, call), ["0"])) == "1")
        for rank, *_ in per_rank:
            got = placed.get((op, rank, call), 0)
            assert got == want, f"{op} call {call} rank {rank} m={m} k<={kmax} n<={nmax} {dtype} chunks={chunks}: " \
                                f"in place with {got} rows per chunk, expected {want} ({slot_bytes}-byte slots)"
        if m > 0 and nmax > 0 and kmax > 0:
            seen[0 if want else 1] += 1
    return seen[0], seen[1]


SHM = [(w, t) for w, t in MK_WORLDS if w > 1 and t == "shm"]


@pytest.mark.parametrize("world,transport", SHM, ids=[f"{w}ranks-{t}" for w, t in SHM])
def test_in_place_on_one_host(world: int, transport: str) -> None:
    """On one host the GEMM op calls whose rows fit in a staging slot (1 MiB) run their collective in place,
    unless splitting the product into per-chunk GEMMs costs more than the staging copy it saves."""
    results = _worlds.results(world, transport, args_for(world, transport))
    placed, _ = in_place_calls([r.stderr for r in results], world, 1 << 20)
    assert placed > 50, placed


_small_slots = WorldCache("gemm_suite.py", timeout=300,
                          env={"SUPERKERNEL_OPS_TRACE": "1", "SUPERKERNEL_SHM_CHUNK": "4096"})


@pytest.mark.parametrize("family", OPS)
def test_small_staging_slots(family: str) -> None:
    """4 KiB staging slots: the in-place path runs many chunks per call (a slot holds a few rows) and wraps
    the slot ring; rows wider than a slot (gemm_reducescatter n=1024), and splits that do not pay, use the
    collectives. Every result still matches the float64 reference."""
    results = _small_slots.results(2, "shm", ["--large"])
    problems = failures_of([r.report() for r in results], family)
    assert not problems, "\n".join(problems[:20])
    placed, other = in_place_calls([r.stderr for r in results], 2, 4096)
    assert placed > 50 and other > 0, (placed, other)
    for res in results:
        assert re.search(r"\] in place: 1 rows per chunk", res.stderr), "no call ran one row per chunk"


GLOO = [(w, t) for w, t in WORLDS if t == "gloo"]


@pytest.mark.parametrize("world,transport", GLOO, ids=[f"{w}ranks-{t}" for w, t in GLOO])
def test_gloo_learns_one_host(world: int, transport: str) -> None:
    """On Gloo the pipeline cannot see where the ranks are; the host identities in the first agreement tell
    it that every rank is on this host, and from then on an automatic chunk count is 1 (as on mk's shm)."""
    for res in _worlds.results(world, transport, args_for(world, transport)):
        autos = re.findall(r"\[mk (?:allgather_gemm|gemm_allreduce|gemm_reducescatter) rank \d+ call (\d+)\] .* "
                           r"chunks=(\d+) \(proposed (\d+), automatic\)", res.stderr)
        later = [(call, proposed) for call, _, proposed in autos if int(call) > 0]
        assert later, f"rank {res.rank}: no automatic call after the first"
        bad = [(call, p) for call, p in later if p != "1"]
        assert not bad, f"rank {res.rank}: automatic proposals above 1 after the first call (call, proposal): {bad[:5]}"


def test_gloo_script_exits_cleanly_after_fused_ops() -> None:
    """A script that ends right after fused ops on Gloo exits with 0 (no std::terminate in Gloo's worker
    thread at interpreter shutdown); five runs, since the failure depended on timing."""
    from tests.transport.world import run_world

    for attempt in range(5):
        results = run_world(2, str(HERE / "gloo_exit.py"), [], timeout=120)
        for res in results:
            assert res.returncode == 0 and "terminate called" not in res.stderr, (
                f"run {attempt}, rank {res.rank}: exit {res.returncode}\n{res.stderr[-2000:]}")
        reps = [res.report() for res in results]
        # gemm_allreduce and allgather_gemm results are the same on both ranks
        for i in range(0, len(reps[0]["sums"]), 3):
            assert reps[0]["sums"][i] == pytest.approx(reps[1]["sums"][i], rel=1e-5)
            assert reps[0]["sums"][i + 2] == pytest.approx(reps[1]["sums"][i + 2], rel=1e-5)
