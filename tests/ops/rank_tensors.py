"""Inputs, checks and path-rule changes shared by the fused-op rank scripts (tests/ops/*_suite.py).

Every rank regenerates every other rank's inputs from a seed derived from (case key, rank, shape, dtype), so
each rank computes the unfused reference in float64 from the whole world's inputs without communicating.
"""
from __future__ import annotations

import os
import sys
import zlib
from collections.abc import Iterator
from contextlib import contextmanager

import torch

# Relative tolerance of the max-norm error against the max-norm of the float64 reference.
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Printed on stderr around calls made while a rank script changed the path rules (tests/ops/ops_world.py's
# without_rule_changes drops them before the tests read which path each call took).
RULES_CHANGED = "[rank suite] path rules changed"
RULES_RESTORED = "[rank suite] path rules restored"


@contextmanager
def path_rules_changed(*names: str) -> Iterator[None]:
    """The body may set or unset the environment variables ``names`` (on some ranks only): they are restored
    after it, and its calls are marked on stderr as made under changed rules."""
    saved = {name: os.environ.get(name) for name in names}
    print(RULES_CHANGED, file=sys.stderr, flush=True)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        print(RULES_RESTORED, file=sys.stderr, flush=True)


def rank_tensor(key: str, rank: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Rank ``rank``'s input ``key``: uniform in [-1, 1), rounded to ``dtype``; the same on every rank that asks."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{key}/{rank}/{tuple(shape)}/{dtype}".encode()))
    return (torch.rand(shape, generator=g, dtype=torch.float64) * 2 - 1).to(dtype)


def mismatch(actual: torch.Tensor, reference: torch.Tensor, dtype: torch.dtype) -> str:
    """'' when ``actual`` matches the float64 ``reference`` within dtype's tolerance, else what is wrong."""
    if actual.dtype != dtype:
        return f"dtype {actual.dtype}, expected {dtype}"
    if tuple(actual.shape) != tuple(reference.shape):
        return f"shape {tuple(actual.shape)}, expected {tuple(reference.shape)}"
    if reference.numel() == 0:
        return ""
    err = (actual.double() - reference).abs().max().item()
    scale = max(reference.abs().max().item(), 1e-30)
    if not err <= TOL[dtype] * scale:  # also catches NaN
        return f"max error {err:.3g} > {TOL[dtype]:.0e} x max |ref| {scale:.3g}"
    return ""


def digest(t: torch.Tensor) -> int:
    """A checksum of the exact bytes (ranks compare them to prove results are identical everywhere)."""
    return zlib.crc32(t.contiguous().view(torch.uint8).numpy().tobytes()) if t.numel() else 0
