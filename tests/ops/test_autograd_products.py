"""superkernel.ops.autograd.product, the local products of the GEMM ops' backward formulas: a half type that
oneDNN does not multiply on this CPU (ATen then runs a plain loop, about 10x slower), or a half-type GEMM too
small for oneDNN's fixed cost per call (superkernel._C.small_half_gemm, as the forward ops decide), is
multiplied in float32 and rounded once; every other product goes to ATen's matmul as it is. Also the limit
that decides "too small": SUPERKERNEL_OPS_SMALL_HALF_GEMM, or measured on this CPU (_C.small_half_limit)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from superkernel import _C
from superkernel.ops.autograd import product, product_into

_ONEDNN = {torch.float32: lambda: True,
           torch.bfloat16: torch.ops.mkldnn._is_mkldnn_bf16_supported,
           torch.float16: torch.ops.mkldnn._is_mkldnn_fp16_supported}
_K = 1024


def _name(dtype: torch.dtype) -> str:
    return str(dtype).split(".")[1]


def _rows_and_n(dtype: torch.dtype, case: str) -> tuple[int, int]:
    """A [rows, 1024] x [1024, n] product on the side of this process's small-GEMM limit that `case` names:
    the most rows within it, more rows than that (at least 96), or a b too wide to widen (2^20 elements) at one
    row. (float32 has no limit: 96 and 192 rows.)"""
    if case == "small-but-wide-b":
        return 1, _K
    if dtype == torch.float32:
        return (96 if case == "small" else 192), 64
    limit = _C.small_half_limit(_name(dtype))
    within = limit // (_K * 64)
    if case == "small":
        if within < 1:
            pytest.skip(f"this process's small-GEMM limit for {dtype} ({limit} multiply-adds) holds no "
                        f"[1, {_K}] x [{_K}, 64] product")
        return within, 64
    return max(within + 1, 96), 64


@pytest.mark.parametrize("case", ["small", "large", "small-but-wide-b"])
@pytest.mark.parametrize("dtype", list(_ONEDNN), ids=str)
def test_product_is_atens_matmul_or_the_widened_one_as_onednn_allows(dtype: torch.dtype, case: str) -> None:
    rows, n = _rows_and_n(dtype, case)
    small = case == "small"
    if dtype != torch.float32:
        assert _C.small_half_gemm(_name(dtype), rows, _K, n) == small
    # Inputs on which the two forms round differently somewhere, else this test could not tell them apart. How
    # often they do depends on the processor: with AVX512-BF16 alone a 96x1024x64 bf16 product differed in some
    # elements for any seed; with AMX (fp32 accumulation in tiles, as MKL's fp32 GEMM accumulates) in none for
    # seed 7 and in 1-2 of its 6144 for others. So draw until they differ. (A small product under a measured
    # limit may have too few elements for that: test_limit_is_measured_or_set sees the form at 96 rows.)
    separate = dtype != torch.float32 and rows * n >= 96 * 64
    for seed in range(7, 7 + (32 if separate else 1)):
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(rows, _K, generator=g).to(dtype)
        y = torch.randn(n, _K, generator=g).to(dtype).t()   # transposed strides, as the backward passes b.t()
        widened = (x.float() @ y.float()).to(dtype)
        native = x @ y
        if not torch.equal(widened, native):
            break
    else:
        assert not separate, f"no seed separates the two forms of a {rows}x{_K}x{n} {dtype} product; pick others"
    got = product(x, y)
    assert got.dtype == dtype and got.shape == (rows, n)
    assert torch.equal(got, native if dtype == torch.float32 or (_ONEDNN[dtype]() and not small) else widened)
    exact = x.double() @ y.double()
    tol = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}[dtype]
    assert ((got.double() - exact).abs().max() / exact.abs().max()).item() < tol


@pytest.mark.parametrize("case", ["small", "large", "small-but-wide-b"])
@pytest.mark.parametrize("dtype", list(_ONEDNN), ids=str)
def test_product_into_writes_the_same_product(dtype: torch.dtype, case: str) -> None:
    """product_into (the MoE backward's products, each expert's into its rows of one buffer) writes exactly
    what product returns, into a view of a larger buffer, and touches nothing else of it."""
    rows, n = _rows_and_n(dtype, case)
    g = torch.Generator().manual_seed(11)
    x = torch.randn(rows, _K, generator=g).to(dtype)
    y = torch.randn(n, _K, generator=g).to(dtype).t()
    buf = torch.full((rows + 2, n), float("nan"), dtype=dtype)
    product_into(buf[1:rows + 1], x, y)
    assert torch.equal(buf[1:rows + 1], product(x, y))
    assert buf[0].isnan().all() and buf[rows + 1].isnan().all()


@pytest.mark.parametrize("dtype", list(_ONEDNN), ids=str)
def test_product_into_an_empty_inner_dimension_gives_zeros(dtype: torch.dtype) -> None:
    """An expert that received no rows: its weight gradient X_e^T @ dy_e over zero rows is zeros."""
    out = torch.full((3, 5), float("nan"), dtype=dtype)
    product_into(out, torch.empty((3, 0), dtype=dtype), torch.empty((0, 5), dtype=dtype))
    assert torch.equal(out, torch.zeros((3, 5), dtype=dtype))


def _limits(env: dict[str, str]) -> subprocess.CompletedProcess:
    # each type's limit, then the form the 96x1024x64 product took: W widened and rounded, N as it is
    script = ("import torch\n"
              "from superkernel import _C\n"
              "from superkernel.ops.autograd import product\n"
              "print(_C.small_half_limit('bfloat16'), _C.small_half_limit('float16'))\n"
              "g = torch.Generator().manual_seed(7)\n"
              "for t in (torch.bfloat16, torch.float16):\n"
              "    for _ in range(32):  # inputs on which the two forms differ (rarely on AMX: see above)\n"
              "        x, y = torch.randn(96, 1024, generator=g).to(t), torch.randn(1024, 64, generator=g).to(t)\n"
              "        w, n = (x.float() @ y.float()).to(t), x @ y\n"
              "        if not torch.equal(w, n):\n"
              "            break\n"
              "    assert not torch.equal(w, n)\n"
              "    print('W' if torch.equal(product(x, y), w) else 'N' if torch.equal(product(x, y), n) else '?')\n")
    return subprocess.run([sys.executable, "-c", script], env={**os.environ, **env}, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_limit_is_measured_or_set(dtype: torch.dtype) -> None:
    """Unset, the limit is measured on this CPU (a power of two in [2^17, 2^23], or 0 where widening never
    paid); SUPERKERNEL_OPS_SMALL_HALF_GEMM sets it for both types; a type the ops widen anyway has 0. The
    products follow the limit: with 2^23 a 96x1024x64 product is made widened, with 0 as it is."""
    if not _ONEDNN[dtype]():
        pytest.skip(f"oneDNN does not multiply {dtype} on this processor: the ops widen it anyway")
    col = 0 if dtype == torch.bfloat16 else 1
    measured = _limits({"SUPERKERNEL_OPS_SMALL_HALF_GEMM": "", "SUPERKERNEL_OPS_WIDEN_HALF": "0"})
    assert measured.returncode == 0, measured.stderr
    value = int(measured.stdout.split()[col])
    assert value == 0 or (1 << 17 <= value <= 1 << 23 and value & (value - 1) == 0), value
    for setting, form in (("0", "N"), ("8388608", "W"), ("12345", "N")):
        out = _limits({"SUPERKERNEL_OPS_SMALL_HALF_GEMM": setting, "SUPERKERNEL_OPS_WIDEN_HALF": "0"})
        assert out.returncode == 0, out.stderr
        words = out.stdout.split()
        assert int(words[col]) == int(setting) and words[2 + col] == form, out.stdout
    widened = _limits({"SUPERKERNEL_OPS_SMALL_HALF_GEMM": "0", "SUPERKERNEL_OPS_WIDEN_HALF": "1"})
    assert widened.returncode == 0, widened.stderr
    assert widened.stdout.split() == ["0", "0", "W", "W"], widened.stdout


@pytest.mark.parametrize("value", ["lots", "-1", "2^20"])
def test_a_bad_limit_fails_the_import(value: str) -> None:
    """A value that is no non-negative integer fails `import superkernel` with the variable named, before any
    op runs (a rank that found it alone, inside an op, would leave the others waiting in an agreement)."""
    out = subprocess.run([sys.executable, "-c", "import superkernel"],
                         env={**os.environ, "SUPERKERNEL_OPS_SMALL_HALF_GEMM": value}, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode != 0
    assert f"SUPERKERNEL_OPS_SMALL_HALF_GEMM must be a non-negative integer, got '{value}'" in out.stderr, \
        out.stderr[-2000:]
