"""Autograd formulas of ``mk::moe_dispatch_gemm`` and ``mk::moe_combine`` (registered with
``torch.library.register_autograd``), and the routing they move gradients by.

The routing handle the dispatch returned says where every (token, choice) row went, so each backward is
the forward's exchange run the other way, plus local products (fp32 accumulation, results in the inputs'
dtypes):

* ``moe_dispatch_gemm``: y rows (expert e, from token t's choice j) = x_t @ w_e.

  - grad x_t = sum_j dy_(t,j) @ w_e^T: the rows dy_e @ w_e^T go home and are summed over the choices, which
    is ``moe_combine`` with all weights 1 (the fused op: on mk, point-to-point straight from the rows);
  - grad w_e = X_e^T @ dy_e, where X_e are the token rows that reached expert e. They are routed to the
    experts again (one all-to-all with the dispatch's counts) instead of being kept from the forward: one
    more exchange in backward for n_recv x h less memory between forward and backward. That all-to-all is
    started first and runs while grad x is computed and sent home.

* ``moe_combine``: out_t = sum_j g_(t,j) * y_(t,j) with g = topk_weights. Both gradients are formed where
  y is: dout_t travels to the expert of each of its k rows (one all-to-all of [t*k, f] rows), the weights
  g_(t,j) go along in a scalar all-to-all, and there

  - grad y_(t,j) = g_(t,j) * dout_t;
  - grad g_(t,j) = dout_t . y_(t,j), one scalar per row, comes home in a third, scalar, all-to-all.

  (Sending the weighted rows out and y's rows home would move two [t*k, f] row sets instead of one.)

The handle and the counts are integer outputs without gradients. The exchanges are
``torch.distributed``'s ``all_to_all_single`` on the op's group, so they run on every backend. Every rank
must run the backward (an all-to-all is collective), and inputs must require gradients alike on every rank,
as in any distributed autograd.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from superkernel.ops.autograd import half_as_is, product_into
from superkernel.ops.dispatch import call
from superkernel.ops.group_names import group_rank, group_size
from superkernel.ops.moe import HANDLE_HEADER, HANDLE_MAGIC

_fc = torch.ops._c10d_functional


class Routing:
    """Where the rows of one dispatch went, read from its handle (layout in ``csrc/kernels/moe.cc``).

    Rows travel source-major in the exchange: a source sends its rows in its sending order (sorted by
    global expert), and a destination receives them by source, then local expert; y is ordered by local
    expert, then source. ``to_experts`` and ``to_home`` move [rows, f] tensors along the dispatch's routes
    and back.
    """

    def __init__(self, handle: torch.Tensor, group_name: str) -> None:
        hd = handle.detach().cpu()
        world, me = group_size(group_name), group_rank(group_name)
        if (hd.dim() != 1 or hd.dtype != torch.int64 or hd.numel() < HANDLE_HEADER or int(hd[0]) != HANDLE_MAGIC
                or int(hd[1]) != world or int(hd[2]) != me):
            raise ValueError(f"mk moe backward: rank {me}: not a routing handle of moe_dispatch_gemm on this rank "
                             f"of group {group_name!r} (size {world})")
        R, er, t, k, n_recv = (int(v) for v in hd[[1, 3, 4, 5, 6]])
        if hd.numel() != HANDLE_HEADER + 2 * R * er + t * k:
            raise ValueError(f"mk moe backward: rank {me}: the routing handle has the wrong length")
        self.group_name, self.t, self.k, self.n_recv = group_name, t, k, n_recv
        recv = hd[HANDLE_HEADER:HANDLE_HEADER + R * er].view(R, er)          # from source s for local expert e
        sent = hd[HANDLE_HEADER + R * er:HANDLE_HEADER + 2 * R * er].view(R, er)  # to rank d's expert e
        self.back = recv.sum(1).tolist()   # rows exchanged with each source
        self.home = sent.sum(1).tolist()   # rows exchanged with each destination
        # Sending order: row i of the outbox is (token, choice) perm[i] = token*k + choice.
        perm = hd[HANDLE_HEADER + 2 * R * er:]
        # Where the row received at position i (source-major, expert-minor) sits in y (expert-major).
        lengths = recv.reshape(-1)
        start_in_y = (recv.t().reshape(-1).cumsum(0) - recv.t().reshape(-1)).view(er, R).t().reshape(-1)
        start_in_rx = lengths.cumsum(0) - lengths
        seg = torch.repeat_interleave(torch.arange(R * er), lengths)
        y_of_rx = start_in_y[seg] + torch.arange(n_recv) - start_in_rx[seg]
        # Rows are only ever gathered (index_select into a new tensor), never scattered (index_copy_ into
        # an empty one, 20% slower for 4096 x 1024 fp32 rows on one core: 3.1 against 2.5 ms). So each
        # permutation is kept with its inverse.
        self.perm, self.slot_of_pair = perm.to(handle.device), _inverse(perm).to(handle.device)
        self.y_of_rx, self.rx_of_y = y_of_rx.to(handle.device), _inverse(y_of_rx).to(handle.device)

    def _exchange(self, rows: torch.Tensor, out_splits: list[int], in_splits: list[int]) -> torch.Tensor:
        return _fc.wait_tensor(_fc.all_to_all_single(rows.contiguous(), out_splits, in_splits, self.group_name))

    def to_experts(self, rows: torch.Tensor, per_token: bool = False) -> torch.Tensor:
        """[t*k, f] rows in (token, choice) order on the token's rank -> [n_recv, f] in y's order.
        ``per_token``: ``rows`` is [t, f], one row for all k choices of a token (x itself)."""
        return self.start_to_experts(rows, per_token)()

    def start_to_experts(self, rows: torch.Tensor, per_token: bool = False) -> Callable[[], torch.Tensor]:
        """``to_experts`` with the exchange started now (an asynchronous all-to-all, issued in the same order
        on every rank as any collective): calling the result waits for it and returns the rows."""
        outbox = rows.index_select(0, self.perm // self.k if per_token else self.perm).contiguous()
        arriving = _fc.all_to_all_single(outbox, self.back, self.home, self.group_name)

        def arrived(outbox: torch.Tensor = outbox) -> torch.Tensor:   # (outbox lives until the exchange is done)
            return _fc.wait_tensor(arriving).index_select(0, self.rx_of_y)
        return arrived

    def to_home(self, y: torch.Tensor) -> torch.Tensor:
        """[n_recv, f] rows in y's order -> [t*k, f] in (token, choice) order on the token's rank."""
        back = self._exchange(y.index_select(0, self.y_of_rx), self.home, self.back)
        return back.index_select(0, self.slot_of_pair)


def _inverse(perm: torch.Tensor) -> torch.Tensor:
    """inv with inv[perm[i]] = i (perm a permutation of range(len))."""
    return torch.empty_like(perm).scatter_(0, perm, torch.arange(perm.numel(), dtype=perm.dtype))


# The backward formulas read the routing (split sizes) from the handle's contents, which torch.compile
# cannot trace; each is therefore an op of its own (mk::moe_dispatch_gemm_backward, mk::moe_combine_backward)
# whose fake kernel gives the gradients' shapes, so a compiled training step traces through it. A gradient
# that is not needed comes back as an empty tensor (an op returns tensors, not None).
_NOTHING = (0,)


@torch.library.custom_op("mk::moe_dispatch_gemm_backward", mutates_args=())
def dispatch_gemm_backward(dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor,
                           handle: torch.Tensor, group_name: str, need_x: bool,
                           need_w: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad x, grad w) of moe_dispatch_gemm for the gradient dy of its output y."""
    rt = Routing(handle, group_name)
    per_expert = counts.tolist()
    blocks = dy.to(x.dtype).split(per_expert)
    grad_x, grad_w = x.new_empty(_NOTHING), w.new_empty(_NOTHING)
    # x's rows travel to the experts again for grad w while grad x is computed and sent home
    arrived = rt.start_to_experts(x, per_token=True) if need_w else None
    # Each product in the inputs' dtype as the forward makes it (autograd.product: a half type multiplied as
    # it is where ATen's GEMM is fast on it, accumulating in fp32 inside and rounding once, else widened and
    # rounded once), each expert's block straight into its rows of one buffer (no per-block products to
    # concatenate: large temporaries are fresh pages, see bench/README.md's malloc item). Made in fp32 every
    # time, the bf16 MoE layer's training step took 2.2-2.5x the unfused one's on a processor with AVX512-BF16.
    if need_x:
        rows = torch.empty((dy.shape[0], w.shape[1]), dtype=x.dtype, device=dy.device)
        lo = 0
        for e, blk in enumerate(blocks):
            product_into(rows[lo:lo + blk.shape[0]], blk, w[e].t())
            lo += blk.shape[0]
        ones = torch.ones((rt.t, rt.k), dtype=x.dtype, device=x.device)
        grad_x = call(torch.ops.mk.moe_combine.default, rows, handle, ones, group_name)
    if arrived is not None:
        rows_in = arrived().split(per_expert)
        grad_w = torch.empty_like(w)
        for e, (xe, blk) in enumerate(zip(rows_in, blocks)):
            product_into(grad_w[e], xe.t(), blk)
    return grad_x, grad_w


@dispatch_gemm_backward.register_fake
def _(dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor, handle: torch.Tensor,
      group_name: str, need_x: bool, need_w: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.empty_like(x) if need_x else x.new_empty(_NOTHING),
            torch.empty_like(w) if need_w else w.new_empty(_NOTHING))


@torch.library.custom_op("mk::moe_combine_backward", mutates_args=())
def combine_backward(dout: torch.Tensor, y: torch.Tensor, handle: torch.Tensor, topk_weights: torch.Tensor,
                     group_name: str, need_y: bool, need_weights: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad y, grad topk_weights) of moe_combine for the gradient dout of its output."""
    rt = Routing(handle, group_name)
    grad_y, grad_weights = y.new_empty(_NOTHING), topk_weights.new_empty(_NOTHING)
    if not (need_y or need_weights):
        return grad_y, grad_weights
    # [n_recv, f]: dout of each row's token, a fresh tensor (to_experts gathers into a new one), in its dtype
    # (y's: the output's gradient): converted to fp32 as a whole, it and y were 11 ms of copies per bf16 step
    dout_at = rt.to_experts(dout, per_token=True)
    if need_weights:
        dots = _row_dots(y, dout_at, topk_weights.dtype)   # [n_recv, 1]
        grad_weights = rt.to_home(dots).view(rt.t, rt.k).to(topk_weights.dtype)
    if need_y:  # (after the dots, which read dout_at: grad y is formed in its place, one buffer fewer)
        # g * dout made in fp32 (ATen computes half types in float) and rounded once into dout_at's dtype
        weight_at = rt.to_experts(topk_weights.reshape(rt.t * rt.k, 1))
        grad_y = dout_at.mul_(weight_at).to(y.dtype)
    return grad_y, grad_weights


_DOT_TILE = 256   # rows of y and dout widened at a time (2 x 1 MiB at f = 1024): they stay in cache


def _row_dots(y: torch.Tensor, d: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[n, 1]: each row's y . d, accumulated in fp32, in ``dtype`` (the router weights') or fp32. A half type
    ATen's GEMM is fast on, with weights of that type: one batched product in it (fp32 inside, rounded once;
    0.6 ms for 4096 x 1024 bf16 rows here, against 1.6 ms widened in tiles and 2.6 ms widened whole). Otherwise
    widened tile by tile, so no [n, f] fp32 temporary is made."""
    if y.dtype == dtype and half_as_is(y):
        return torch.bmm(y.unsqueeze(1), d.unsqueeze(2)).view(-1, 1)
    out = torch.empty((y.shape[0], 1), dtype=torch.float32, device=y.device)
    for lo in range(0, y.shape[0], _DOT_TILE):
        hi = min(y.shape[0], lo + _DOT_TILE)
        torch.linalg.vecdot(y[lo:hi].float(), d[lo:hi].float(), out=out[lo:hi, 0])
    return out


@combine_backward.register_fake
def _(dout: torch.Tensor, y: torch.Tensor, handle: torch.Tensor, topk_weights: torch.Tensor, group_name: str,
      need_y: bool, need_weights: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.empty_like(y) if need_y else y.new_empty(_NOTHING),
            torch.empty_like(topk_weights) if need_weights else topk_weights.new_empty(_NOTHING))


# --------------------------------------------------------------------------------------- moe_dispatch_gemm
def _dispatch_setup(ctx: Any, inputs: tuple, output: tuple) -> None:
    x, _ids, w, name = inputs
    y, counts, handle = output
    ctx.name, ctx.n_recv = name, y.shape[0]
    ctx.save_for_backward(x, w, counts, handle)


def _dispatch_backward(ctx: Any, dy: torch.Tensor | None, _dcounts: Any, _dhandle: Any) -> tuple:
    x, w, counts, handle = ctx.saved_tensors
    need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[2]
    if dy is None:
        dy = x.new_zeros((ctx.n_recv, w.shape[2]))
    grad_x, grad_w = dispatch_gemm_backward(dy, x, w, counts, handle, ctx.name, need_x, need_w)
    return (grad_x if need_x else None), None, (grad_w if need_w else None), None


# ---------------------------------------------------------------------------------------------- moe_combine
def _combine_setup(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    y, handle, topk_weights, name = inputs
    ctx.name = name
    ctx.save_for_backward(y, handle, topk_weights)


def _combine_backward(ctx: Any, dout: torch.Tensor) -> tuple:
    y, handle, topk_weights = ctx.saved_tensors
    need_y, need_weights = ctx.needs_input_grad[0], ctx.needs_input_grad[2]
    grad_y, grad_weights = combine_backward(dout, y, handle, topk_weights, ctx.name, need_y, need_weights)
    return (grad_y if need_y else None), None, (grad_weights if need_weights else None), None


torch.library.register_autograd("mk::moe_dispatch_gemm", _dispatch_backward, setup_context=_dispatch_setup)
torch.library.register_autograd("mk::moe_combine", _combine_backward, setup_context=_combine_setup)
