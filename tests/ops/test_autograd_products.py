"""superkernel.ops.autograd.product, the local products of the GEMM ops' backward formulas: a half type that
oneDNN does not multiply on this CPU (ATen then runs a plain loop, about 10x slower), or a half-type GEMM too
small for oneDNN's fixed cost per call (superkernel._C.small_half_gemm, as the forward ops decide), is
multiplied in float32 and rounded once; every other product goes to ATen's matmul as it is."""
from __future__ import annotations

import pytest
import torch

from superkernel import _C
from superkernel.ops.autograd import product

_ONEDNN = {torch.float32: lambda: True,
           torch.bfloat16: torch.ops.mkldnn._is_mkldnn_bf16_supported,
           torch.float16: torch.ops.mkldnn._is_mkldnn_fp16_supported}


@pytest.mark.parametrize("rows,n,small", [(96, 64, True), (192, 64, False), (8, 1024, False)],
                         ids=["small", "large", "small-but-wide-b"])
@pytest.mark.parametrize("dtype", list(_ONEDNN), ids=str)
def test_product_is_atens_matmul_or_the_widened_one_as_onednn_allows(dtype: torch.dtype, rows: int, n: int,
                                                                     small: bool) -> None:
    # (the cases sit on either side of the limit: multiply-adds, then the elements of the widened y)
    assert _C.small_half_gemm(rows, 1024, n) == small
    g = torch.Generator().manual_seed(7)
    x = torch.randn(rows, 1024, generator=g).to(dtype)
    y = torch.randn(n, 1024, generator=g).to(dtype).t()   # transposed strides, as the backward passes b.t()
    got = product(x, y)
    assert got.dtype == dtype and got.shape == (rows, n)
    widened = (x.float() @ y.float()).to(dtype)
    native = x @ y
    if dtype != torch.float32:
        # the two forms round differently somewhere (else this test could not tell them apart)
        assert not torch.equal(widened, native), "the shapes do not separate the two forms; pick others"
    assert torch.equal(got, native if dtype == torch.float32 or (_ONEDNN[dtype]() and not small) else widened)
    exact = x.double() @ y.double()
    tol = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}[dtype]
    assert ((got.double() - exact).abs().max() / exact.abs().max()).item() < tol
