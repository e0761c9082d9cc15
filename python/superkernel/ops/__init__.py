"""``superkernel.ops`` (``mk`` in every rank's namespace): Python face of the fused ``torch.ops.mk.*``
operators, which overlap a matrix product or attention with the collective it feeds.

The C++ ops are registered when ``superkernel._C`` loads; importing this package also registers their fake
kernels (for ``torch.compile``). Each wrapper takes a ``torch.distributed`` ProcessGroup (None = the default
group) and passes its ``group_name`` to the op.

Modules: ``gemm`` (allgather_gemm, gemm_allreduce, gemm_reducescatter), ``moe`` (moe_dispatch_gemm,
moe_combine), ``attention`` (ring_attention); their backward formulas in ``autograd`` (the GEMM ops),
``moe_grad`` and ``attention_grad``; ``group_names`` (group <-> name).
"""
from __future__ import annotations

from superkernel import _C as _C  # noqa: F401  (loading the extension registers torch.ops.mk.*)
from superkernel.ops.gemm import allgather_gemm, gemm_allreduce, gemm_reducescatter
from superkernel.ops.group_names import group_name
from superkernel.ops import autograd as _autograd  # noqa: F401  (registers the ops' autograd formulas)

__all__ = ["allgather_gemm", "gemm_allreduce", "gemm_reducescatter", "group_name"]
from superkernel.ops.moe import moe_combine, moe_dispatch_gemm  # noqa: E402
from superkernel.ops.attention import ring_attention  # noqa: E402
from superkernel.ops import attention_grad as _attention_grad, moe_grad as _moe_grad  # noqa: E402,F401

__all__ += ["moe_dispatch_gemm", "moe_combine", "ring_attention"]
