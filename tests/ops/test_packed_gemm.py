"""b packed once for a product's row chunks (kernels/packed_gemm.h): the chunks' products from the packed copy
match the float64 product at awkward shapes and strides, SUPERKERNEL_OPS_PACKED_B=0 turns it off, and every
GEMM op with every fp32 product of two or more chunks made from a packed b (SUPERKERNEL_OPS_PACKED_B=all) still
matches the float64 reference over the ring (mk over tcp) and the chunked collectives (Gloo)."""
from __future__ import annotations

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


_packed = WorldCache("gemm_suite.py", timeout=300,
                     env={**RING_ON_SMALL_SHAPES, "SUPERKERNEL_OPS_PACKED_B": "all"})


@needs_mkl
@pytest.mark.parametrize("world,transport", [(2, "tcp"), (3, "tcp"), (2, "gloo")],
                         ids=["2ranks-tcp", "3ranks-tcp", "2ranks-gloo"])
def test_ops_with_packed_b_match_float64(world: int, transport: str) -> None:
    """Every op, dtype and gradient of the suite, with b packed for every fp32 product of two or more chunks (the
    half types where they are widened to fp32); the same bytes on every rank."""
    reps = _packed.reports(world, transport, [])
    for family in ("allgather_gemm", "gemm_allreduce", "gemm_reducescatter", "empty", "grad"):
        problems = failures_of(reps, family)
        assert not problems, "\n".join(problems[:20])
    for rep in reps[1:]:
        differ = [k for k, v in reps[0]["digests"].items() if rep["digests"].get(k) != v]
        assert not differ, f"rank {rep['rank']} differs from rank 0 on {differ[:5]}"
