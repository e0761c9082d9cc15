"""The registry of bench/fused_ops.py: case factories by family, and the types they use.

A family module ``bench/fused_cases_<family>.py`` does::

    from fused_registry import Case, Context, register

    @register("moe")
    def moe_cases(ctx: Context) -> list[Case]:
        return [Case(op="moe_dispatch_gemm", shape="t=4096 h=1024 ...", fused=..., unfused=..., compute=...,
                     comm=...)]

fused_ops.py imports every such module (so it needs no edit) and times the four callables of each case.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Context:
    """What a case factory needs: the group the ops run on, the dtype and the shapes asked for."""

    rank: int
    world_size: int
    group: Any  # torch.distributed.ProcessGroup of the measured backend
    backend: str
    dtype: Any  # torch.dtype
    shapes: list[tuple[int, ...]] | None  # --shapes (None: each family's defaults)
    chunks: int  # --chunks, passed to the fused ops (0 = automatic)


@dataclass
class Case:
    """One op at one shape. Each callable does one complete call (results are not checked here: tests/ops do)."""

    op: str
    shape: str
    fused: Callable[[], Any]
    unfused: Callable[[], Any]
    compute: Callable[[], Any]  # the computation of the op alone
    comm: Callable[[], Any]  # the communication of the op alone (same backend, same bytes)
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


def seeded(shape: tuple[int, ...], dtype: Any, seed: int, scale: float = 1.0) -> Any:
    """A deterministic standard-normal tensor (drawn in fp32, then cast), times ``scale``: the inputs of
    every case, the same on every run."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g, dtype=torch.float32) * scale).to(dtype)


def dtype_name(dtype: Any) -> str:
    """``torch.float32`` -> ``float32`` (for the shape column)."""
    return str(dtype).replace("torch.", "")


Factory = Callable[[Context], list[Case]]
REGISTRY: dict[str, Factory] = {}


def register(family: str) -> Callable[[Factory], Factory]:
    """Decorator: ``@register("gemm")`` adds a case factory under a family name (``--families`` selects)."""

    def add(fn: Factory) -> Factory:
        REGISTRY[family] = fn
        return fn

    return add
