"""RAM as a service: one-sided windows into other ranks' memory (``Window``) and, built on them, a tensor
store pooled across the memory of all ranks (``TensorStore``, in ``tensor_store.py``).

    from superkernel.memory import Window
"""
from __future__ import annotations

from superkernel.memory.window import CancelledError, PeerError, Window, WindowFuture

__all__ = ["CancelledError", "PeerError", "Window", "WindowFuture"]

# TensorStore (superkernel/memory/tensor_store.py) is re-exported here by its own module's author:
#   from superkernel.memory.tensor_store import TensorStore
#   __all__.append("TensorStore")
