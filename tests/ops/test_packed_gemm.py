"""b packed once for a product's row chunks (kernels/packed_gemm.h): the chunks' products from the packed copy
match the float64 product at awkward shapes and strides, SUPERKERNEL_OPS_PACKED_B=0 turns it off, and every
GEMM op with every fp32 product of two or more chunks made from a packed b (SUPERKERNEL_OPS_PACKED_B=all) still
matches the float64 reference over the ring (mk over tcp) and the chunked collectives (Gloo). The probe that
decides whether packing pays on this processor, and the agreement that keeps every rank from packing where one
rank does not offer to."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from superkernel import _C
from tests.ops.ops_world import RING_ON_SMALL_SHAPES, WorldCache, failures_of

# (missing library, not a disabled feature: SUPERKERNEL_OPS_PACKED_B is cleared for each test below)
needs_mkl = pytest.mark.skipif(not _C.packed_gemm_present(),
                               reason="MKL's packed sgemm is not in this process's libtorch (nothing is packed)")


@pytest.fixture(autouse=True)
def _default_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SUPERKERNEL_OPS_PACKED_B", raising=False)


@needs_mkl
@pytest.mark.parametrize("m,k,n", [(1, 300, 1), (7, 5, 3), (100, 1, 50), (513, 257, 129), (64, 512, 600)])
@pytest.mark.parametrize("chunks", [1, 2, 3, 8])
def test_packed_chunks_match_float64(m: int, k: int, n: int, chunks: int) -> None:
    g = torch.Generator().manual_seed(m * 1000 + k + n)
    a, b = torch.randn(m, k, generator=g), torch.randn(k, n, generator=g)
    want = a.double() @ b.double()
    got = _C.chunked_mm(a, b, chunks, True)
    tol = 1e-5 * (1 + want.abs().max().item()) * max(1, k) ** 0.5
    assert (got.double() - want).abs().max().item() <= tol


@needs_mkl
def test_transposed_operands() -> None:
    """b and the rows may be transposed views (unit stride along the other dimension)."""
    g = torch.Generator().manual_seed(3)
    b = torch.randn(200, 300, generator=g).t()   # [300, 200], stride (1, 300)
    a = torch.randn(300, 64, generator=g).t()    # [64, 300], stride (1, 64)
    want = a.double() @ b.double()
    for got in (_C.chunked_mm(a, b, 4, True), _C.chunked_mm(a.contiguous(), b, 3, True)):
        assert (got.double() - want).abs().max().item() <= 1e-3


@needs_mkl
def test_variable_turns_it_off(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _C.packed_gemm_available()
    monkeypatch.setenv("SUPERKERNEL_OPS_PACKED_B", "0")
    assert not _C.packed_gemm_available() and _C.packed_gemm_present()
    with pytest.raises(RuntimeError, match="could not be packed"):
        _C.chunked_mm(torch.randn(8, 8), torch.randn(8, 8), 2, True)
    monkeypatch.setenv("SUPERKERNEL_OPS_PACKED_B", "all")
    assert _C.packed_gemm_available()


@needs_mkl
def test_probe_times_both_forms_and_its_verdict_is_the_offer(monkeypatch: pytest.MonkeyPatch) -> None:
    """The probe timed both forms; unset, the variable leaves the offer to its verdict; 0, 1 and all decide it."""
    probe = _C.packed_gemm_probe()
    assert probe["plain_ms"] > 0 and probe["packed_ms"] > 0, probe
    assert probe["pays"] == (probe["packed_ms"] <= probe["ratio"] * probe["plain_ms"]), probe
    assert _C.packed_gemm_probe() == probe  # (timed once per process)
    assert _C.packed_gemm_offer() == probe["pays"]
    for value, offer in (("0", False), ("1", True), ("all", True)):
        monkeypatch.setenv("SUPERKERNEL_OPS_PACKED_B", value)
        assert _C.packed_gemm_offer() == offer, value


_PROBE_IN_A_NEW_PROCESS = """
import os
import torch
from superkernel import _C
os.environ["SUPERKERNEL_OPS_PACKED_B"] = "0"
assert _C.packed_gemm_probe()["plain_ms"] == 0  # (nothing timed while packing is off, and nothing kept)
del os.environ["SUPERKERNEL_OPS_PACKED_B"]
torch.manual_seed(5)
want = torch.rand(3)
torch.manual_seed(5)
probe = _C.packed_gemm_probe()
assert probe["plain_ms"] > 0 and probe["packed_ms"] > 0, probe  # (it ran here, in this process)
assert torch.equal(torch.rand(3), want), "the probe moved the default generator"
assert _C.packed_products() == 0, _C.packed_products()
"""


@needs_mkl
def test_probe_leaves_the_random_state_and_the_count_alone() -> None:
    """In a process of its own (this one's probe may have run already): with SUPERKERNEL_OPS_PACKED_B=0 it times
    nothing and keeps nothing, so it times once packing is allowed; it draws nothing from torch's default
    generator, and its products are not counted as the ops'."""
    env = {k: v for k, v in os.environ.items() if k != "SUPERKERNEL_OPS_PACKED_B"}
    proc = subprocess.run([sys.executable, "-c", _PROBE_IN_A_NEW_PROCESS], env=env, capture_output=True,
                          text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]


@needs_mkl
def test_bench_prints_the_table_and_the_probes_verdict() -> None:
    """bench/packed_gemm.py: one row per shape with a cell per chunk count, then the probe's timings and what the
    ops do with its verdict (a process of its own: its probe, not this one's)."""
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "SUPERKERNEL_OPS_PACKED_B"}
    proc = subprocess.run([sys.executable, "bench/packed_gemm.py", "--shapes", "96x64x80,33x17x5", "--chunks",
                           "2,3", "--reps", "1"], cwd=root, env=env, capture_output=True, text=True, timeout=120,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = re.findall(r"^ *(\d+x\d+x\d+) \|.*\(([\d.]+)x\) \|.*\(([\d.]+)x\)$", proc.stdout, re.MULTILINE)
    assert [r[0] for r in rows] == ["96x64x80", "33x17x5"], proc.stdout
    verdict = re.search(r"plain ([\d.]+) ms, packed ([\d.]+) ms: packing (pays|does not pay) here \(packed <= "
                        r"([\d.]+) x plain\), so the ops (pack|do not pack) b", proc.stdout)
    assert verdict, proc.stdout
    plain, packed, pays, ratio, ops = verdict.groups()
    assert (pays == "pays") == (ops == "pack"), verdict.group(0)
    if abs(float(packed) - float(ratio) * float(plain)) > 0.01:  # (printed to 0.01 ms)
        assert (pays == "pays") == (float(packed) <= float(ratio) * float(plain)), verdict.group(0)


def assert_float64_and_alike(reps: list[dict]) -> None:
    """Every family of the suite matched its float64 reference, and every rank returned the same bytes."""
    for family in ("allgather_gemm", "gemm_allreduce", "gemm_reducescatter", "empty", "grad"):
        problems = failures_of(reps, family)
        assert not problems, "\n".join(problems[:20])
    for rep in reps[1:]:
        differ = [k for k, v in reps[0]["digests"].items() if rep["digests"].get(k) != v]
        assert not differ, f"rank {rep['rank']} differs from rank 0 on {differ[:5]}"


_packed = WorldCache("gemm_suite.py", timeout=300,
                     env={**RING_ON_SMALL_SHAPES, "SUPERKERNEL_OPS_PACKED_B": "all"})


@needs_mkl
@pytest.mark.parametrize("world,transport", [(2, "tcp"), (3, "tcp"), (2, "gloo")],
                         ids=["2ranks-tcp", "3ranks-tcp", "2ranks-gloo"])
def test_ops_with_packed_b_match_float64(world: int, transport: str) -> None:
    """Every op, dtype and gradient of the suite, with b packed for every fp32 product of two or more chunks (the
    half types where they are widened to fp32); the same bytes on every rank."""
    reps = _packed.reports(world, transport, [])
    assert_float64_and_alike(reps)
    assert all(rep["packed_products"] > 0 for rep in reps), [rep["packed_products"] for rep in reps]


_one_refuses = WorldCache("gemm_suite.py", timeout=300, env=RING_ON_SMALL_SHAPES)


@needs_mkl
@pytest.mark.parametrize("world,transport", [(2, "tcp"), (3, "gloo")], ids=["2ranks-tcp", "3ranks-gloo"])
def test_one_rank_that_does_not_pack_keeps_every_rank_from_packing(world: int, transport: str) -> None:
    """Rank 0 with SUPERKERNEL_OPS_PACKED_B=0, the others with all (as a rank whose probe found packing slower
    beside ranks whose probe found it faster): the agreement takes the smallest offer, so no rank packs, and
    the results are those of the float64 reference and the same bytes on every rank."""
    others = ",".join(f"{q}:all" for q in range(1, world))
    reps = _one_refuses.reports(world, transport, ["--packed-b-on", f"0:0,{others}"])
    assert_float64_and_alike(reps)
    assert [rep["packed_products"] for rep in reps] == [0] * world
