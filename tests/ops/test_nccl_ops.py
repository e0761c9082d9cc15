"""The fused ops on CUDA tensors over NCCL (2 ranks, one GPU each) against the float64 CPU reference:
allgather_gemm / gemm_allreduce / gemm_reducescatter (the backend's async collectives), moe_dispatch_gemm +
moe_combine (alltoall_base with uneven splits) and ring_attention (each ring step one coalesced send/recv
group). Skipped unless the host has at least 2 CUDA devices and torch was built with NCCL."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.ops.ops_world import HERE, failures_of
from tests.transport.world import run_world


def _unavailable() -> str:
    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False)"
    if torch.cuda.device_count() < 2:
        return f"needs 2 CUDA devices, found {torch.cuda.device_count()}"
    if not dist.is_nccl_available():
        return "torch was built without NCCL"
    return ""


_reports: list[dict] = []


def _world() -> list[dict]:
    if not _reports:
        results = run_world(2, str(HERE / "nccl_suite.py"), [], timeout=300, env={})
        _reports.extend(r.report() for r in results)
    return _reports


@pytest.mark.skipif(bool(_unavailable()), reason=_unavailable() or "available")
@pytest.mark.parametrize("family", ["gemm", "moe", "attention"])
def test_nccl_matches_float64_reference(family: str) -> None:
    problems = failures_of(_world(), family)
    assert not problems, "\n".join(problems[:20])
