"""`import superkernel` registers "mk" so torch.distributed can use it alone or beside NCCL."""
from __future__ import annotations

import subprocess
import sys

import pytest

from tests.transport.world import run_world


def test_import_registers_backend() -> None:
    code = ("import torch.distributed as dist, superkernel; "
            "assert 'mk' in dist.Backend.backend_list, dist.Backend.backend_list; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={"PATH": "/usr/bin:/bin"})
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_frontend_import_does_not_load_torch() -> None:
    code = "import sys, superkernel; assert 'torch' not in sys.modules, 'torch was imported'; print('ok')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={"PATH": "/usr/bin:/bin", "SUPERKERNEL_FRONTEND": "1"})
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def cuda_devices() -> int:
    out = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.device_count())"],
                         capture_output=True, text=True, timeout=120)
    return int(out.stdout.strip() or 0)


def mixed(backend: str) -> None:
    res = run_world(2, "failure_suite.py", ["mixed"], timeout=120, env={"SUITE_BACKEND": backend})
    for r in res:
        ev = {e["op"]: e for e in r.report()["events"]}
        assert ev["cpu_allreduce"]["ok"], ev["cpu_allreduce"]
        assert ev["backend"]["name"] == backend, ev["backend"]


def test_cpu_mk_in_a_device_map() -> None:
    # the device-map mechanism with mk on CPU; the CUDA half cannot be NCCL without a GPU
    mixed("cpu:mk,cuda:gloo")


@pytest.mark.skipif(cuda_devices() == 0, reason="no CUDA device on this machine: NCCL refuses to start")
def test_cpu_mk_beside_cuda_nccl() -> None:
    mixed("cpu:mk,cuda:nccl")
