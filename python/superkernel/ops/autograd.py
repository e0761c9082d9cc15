"""Autograd formulas of the GEMM ops (registered with ``torch.library.register_autograd``); the MoE ops'
are in ``moe_grad``, ring attention's in ``attention_grad``.

Convention: the loss is the sum of every rank's loss, as for ``torch.distributed.nn.functional`` (the
gradient of an output that every rank holds is summed over the ranks). With it the backward of each op is
again a fused op or one collective plus local products:

* ``allgather_gemm``: c_p = G @ b_p with G = cat_r a_r. grad a_r = rows r of sum_p dc_p @ b_p^T =
  ``gemm_reducescatter(dc, b^T)``; grad b_p = G^T @ dc_p (G saved when the forward returned it, else
  gathered again, as Megatron's sequence parallelism does to save memory); with ``return_gathered`` (which
  must be the same on every rank) the gradient of ``gathered`` adds its reduce-scatter to grad a.
* ``gemm_allreduce``: c = sum_r a_r @ b_r on every rank. With ds = sum_p dc_p (one allreduce):
  grad a_r = ds @ b_r^T, grad b_r = a_r^T @ ds. (Megatron's row-parallel layer skips that allreduce: it
  counts the loss once, not once per rank, and takes dc as identical on every rank.)
* ``gemm_reducescatter``: c_p = rows p of sum_q a_q @ b_q. The gradient of every partial product is
  cat_p dc_p, so ``allgather_gemm(dc, b^T, return_gathered=True)`` gives grad a_q and the gathered dc for
  grad b_q = a_q^T @ cat_p dc_p.

The collectives of a backward depend only on the op's agreed arguments, except one: allgather_gemm gathers
its input again when b needs a gradient and the forward did not return the gathered rows. Like any
distributed autograd, this assumes every rank's inputs require gradients alike.
"""
from __future__ import annotations

from typing import Any

import torch

from superkernel import _C
from superkernel.ops.dispatch import call
from superkernel.ops.group_names import group_size

_fc = torch.ops._c10d_functional


# ------------------------------------------------- collectives of the backward formulas (also attention_grad)
# torch.distributed's functional collectives on the group registered as `name`, waited for.
def all_gather(t: torch.Tensor, name: str) -> torch.Tensor:
    return wait(start_all_gather(t, name))


def start_all_gather(t: torch.Tensor, name: str) -> torch.Tensor:
    """The gather started and left in flight (the group's backend runs it asynchronously): pass the result
    to ``wait`` before reading it."""
    return _fc.all_gather_into_tensor(t.contiguous(), group_size(name), name)


def wait(t: torch.Tensor) -> torch.Tensor:
    return _fc.wait_tensor(t)


def reduce_scatter(t: torch.Tensor, name: str) -> torch.Tensor:
    return wait(start_reduce_scatter(t, name))


def start_reduce_scatter(t: torch.Tensor, name: str) -> torch.Tensor:
    """The sum-reduce-scatter started and left in flight: pass the result to ``wait`` before reading it."""
    return _fc.reduce_scatter_tensor(t.contiguous(), "sum", group_size(name), name)


def all_reduce(t: torch.Tensor, name: str) -> torch.Tensor:
    return _fc.wait_tensor(_fc.all_reduce(t.contiguous(), "sum", name))


# ------------------------------------------------------------------------------- local products of the formulas
# Half types the ops multiply on the CPU on operands widened to fp32: those ATen multiplies with a plain loop,
# not oneDNN (fp16 on a CPU without AVX512-FP16 or AMX-FP16: a [256,256] product 10.7 ms as fp16, 0.9 ms
# widened and rounded back), and those oneDNN multiplies more slowly than fp32 here (bf16 with AVX512-BF16 but
# no AMX: 1.2-1.9x). The forward ops' own decision (native_half_gemm in csrc/kernels/pipeline.cc), asked once,
# at import, so that torch.compile traces the backward through a constant.
def _widened_on_cpu() -> frozenset[torch.dtype]:
    return frozenset(t for t in (torch.float16, torch.bfloat16) if not _C.half_gemm_native(str(t).split(".")[1]))


_WIDENED_ON_CPU = _widened_on_cpu()
_C.small_half_setting()  # (a bad SUPERKERNEL_OPS_SMALL_HALF_GEMM fails the import, on every rank)


def _small(x: torch.Tensor, y: torch.Tensor, limit: int | None) -> bool:
    """Whether [m, k] x [k, n] is a GEMM the forward ops make widened and rounded although they multiply its
    half type as it is (small_half_gemm in csrc/kernels/pipeline.h: oneDNN's fixed cost per call outweighs the
    arithmetic; `limit`: the most multiply-adds so made, None for this process's own, small_half_limit).
    Symbolic sizes (torch.compile with dynamic shapes) keep the half-type GEMM."""
    sizes = (x.shape[0], x.shape[1], y.shape[1])
    return all(type(v) is int for v in sizes) and _C.small_half_gemm(
        str(x.dtype).split(".")[1], *sizes, -1 if limit is None else limit)


def half_as_is(t: torch.Tensor) -> bool:
    """Whether ``t`` is a half type that ATen multiplies fast as it is on its CPU (the forward ops' choice,
    native_half_gemm): the backward formulas then make their products and attention kernels in it."""
    return t.device.type == "cpu" and t.dtype in (torch.float16, torch.bfloat16) and t.dtype not in _WIDENED_ON_CPU


def _widens(x: torch.Tensor, y: torch.Tensor, small_limit: int | None) -> bool:
    return x.device.type == "cpu" and x.dtype in (torch.float16, torch.bfloat16) and (
        not half_as_is(x) or _small(x, y, small_limit))


def product(x: torch.Tensor, y: torch.Tensor, small_limit: int | None = None) -> torch.Tensor:
    """x @ y (2-D) in x's dtype, in its fastest exact form: a half type ATen has no fast CPU kernel for, or a
    GEMM too small for its fast kernel's fixed cost, is multiplied in fp32 and rounded once (against float64,
    the same largest error as ATen's fp16 loop at k=256 and k=4096). `small_limit` models another process's
    small-GEMM limit (superkernel._C.small_half_limit there; the tests' models of other ranks' products)."""
    if _widens(x, y, small_limit):
        return (x.float() @ y.float()).to(x.dtype)
    return x @ y


def product_into(out: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> None:
    """``product(x, y)`` written into ``out`` (x's dtype, [x rows, y columns]; an empty inner dimension gives
    zeros)."""
    if _widens(x, y, None):
        out.copy_(x.float() @ y.float())
    elif x.shape[1] == 0:
        out.zero_()
    else:
        torch.mm(x, y, out=out)


# ------------------------------------------------------------------------------------------ allgather_gemm
def _allgather_gemm_setup(ctx: Any, inputs: tuple, output: tuple) -> None:
    a, b, name, return_gathered, chunks = inputs
    ctx.name, ctx.chunks, ctx.return_gathered = name, chunks, bool(return_gathered)
    ctx.save_for_backward(a, b, output[1] if return_gathered else None)


def _allgather_gemm_backward(ctx: Any, dc: torch.Tensor | None, dgathered: torch.Tensor | None) -> tuple:
    a, b, gathered = ctx.saved_tensors
    if dc is None:   # only `gathered` was used
        dc = a.new_zeros((group_size(ctx.name) * a.shape[0], b.shape[1]))
    dc = dc.contiguous()
    grad_a = call(torch.ops.mk.gemm_reducescatter.default, dc, b.t(), ctx.name, ctx.chunks)
    if ctx.return_gathered:  # (agreed across ranks, so every rank runs this reduce-scatter or none does)
        grad_a = grad_a + reduce_scatter(a.new_zeros(gathered.shape) if dgathered is None else dgathered, ctx.name)
    grad_b = None
    if ctx.needs_input_grad[1]:
        grad_b = product((gathered if gathered is not None else all_gather(a, ctx.name)).t(), dc)
    return (grad_a if ctx.needs_input_grad[0] else None), grad_b, None, None, None


# ------------------------------------------------------------------------------------------ gemm_allreduce
def _gemm_allreduce_setup(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    a, b, name, _chunks = inputs
    ctx.name = name
    ctx.save_for_backward(a, b)


def _gemm_allreduce_backward(ctx: Any, dc: torch.Tensor) -> tuple:
    a, b = ctx.saved_tensors
    ds = all_reduce(dc, ctx.name)
    grad_a = product(ds, b.t()) if ctx.needs_input_grad[0] else None
    grad_b = product(a.t(), ds) if ctx.needs_input_grad[1] else None
    return grad_a, grad_b, None, None


# -------------------------------------------------------------------------------------- gemm_reducescatter
def _gemm_reducescatter_setup(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    a, b, name, chunks = inputs
    ctx.name, ctx.chunks = name, chunks
    ctx.save_for_backward(a, b)


def _gemm_reducescatter_backward(ctx: Any, dc: torch.Tensor) -> tuple:
    a, b = ctx.saved_tensors
    grad_a, gathered = call(torch.ops.mk.allgather_gemm.default, dc.contiguous(), b.t(), ctx.name, True, ctx.chunks)
    grad_b = product(a.t(), gathered) if ctx.needs_input_grad[1] else None
    return (grad_a if ctx.needs_input_grad[0] else None), grad_b, None, None


torch.library.register_autograd("mk::allgather_gemm", _allgather_gemm_backward, setup_context=_allgather_gemm_setup)
torch.library.register_autograd("mk::gemm_allreduce", _gemm_allreduce_backward, setup_context=_gemm_allreduce_setup)
torch.library.register_autograd("mk::gemm_reducescatter", _gemm_reducescatter_backward,
                                setup_context=_gemm_reducescatter_setup)
