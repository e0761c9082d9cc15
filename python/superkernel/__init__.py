"""superkernel: a Jupyter kernel for torchrun/mpirun rank pools, and the ``mk`` torch.distributed backend.

``import superkernel`` loads the C++ extension and registers the ``mk`` backend with
``torch.distributed`` (``init_process_group("mk")`` or ``"cpu:mk,cuda:nccl"``).

The notebook front end (``superkernel.kernel``) must start without torch: its kernelspec sets
``SUPERKERNEL_FRONTEND=1``, which skips loading torch here. Everything that needs torch imports it itself.
"""
from __future__ import annotations

import os as _os

__version__ = "0.1.0"

if _os.environ.get("SUPERKERNEL_FRONTEND") != "1":
    from superkernel.backend import register_backend as _register_backend

    _register_backend()
    import superkernel.ops as _ops  # noqa: F401  (fake kernels of torch.ops.mk.* for torch.compile)
