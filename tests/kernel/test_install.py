"""`superkernel install` and `python -m superkernel.install` write the kernelspecs."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from jupyter_client.kernelspec import KernelSpecManager

from superkernel import cli


def _spec(prefix: str, name: str) -> dict:
    with open(os.path.join(prefix, "share", "jupyter", "kernels", name, "kernel.json")) as f:
        return json.load(f)


def test_cli_installs_both_flavours(tmp_path, capsys):
    prefix = str(tmp_path)
    assert cli.main(["install", "--prefix", prefix]) == 0
    torch_spec, mpi_spec = _spec(prefix, "superkernel"), _spec(prefix, "superkernel-mpi")
    assert torch_spec["display_name"] == "SuperKernel (torch)"
    assert mpi_spec["display_name"] == "SuperKernel (MPI)"
    assert torch_spec["argv"][1:] == ["-m", "superkernel.kernel", "-f", "{connection_file}"]
    assert torch_spec["env"] == {"SUPERKERNEL_FRONTEND": "1", "SUPERKERNEL_FLAVOR": "torch"}
    assert mpi_spec["env"]["SUPERKERNEL_FLAVOR"] == "mpi"
    assert torch_spec["interrupt_mode"] == "message"
    specs = KernelSpecManager(kernel_dirs=[os.path.join(prefix, "share", "jupyter", "kernels")]).find_kernel_specs()
    assert {"superkernel", "superkernel-mpi"} <= set(specs)


def test_cli_name_ranks_backend(tmp_path):
    prefix = str(tmp_path)
    assert cli.main(["install", "--prefix", prefix, "--flavor", "torch", "--name", "big", "--ranks", "8",
                     "--backend", "gloo"]) == 0
    spec = _spec(prefix, "big")
    assert spec["env"]["SUPERKERNEL_RANKS"] == "8" and spec["env"]["SUPERKERNEL_BACKEND"] == "gloo"
    assert spec["display_name"] == "SuperKernel (torch), 8 ranks"
    assert cli.main(["install", "--prefix", prefix, "--name", "x"]) == 2  # --name needs one flavour


def test_python_dash_m_install(tmp_path):
    out = subprocess.run([sys.executable, "-m", "superkernel.install", "--prefix", str(tmp_path), "--flavor", "mpi"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "Installed kernelspec superkernel-mpi" in out.stdout
    assert _spec(str(tmp_path), "superkernel-mpi")["display_name"] == "SuperKernel (MPI)"


def test_kernel_process_never_imports_torch(tmp_path):
    code = ("import sys, os; os.environ['SUPERKERNEL_FRONTEND'] = '1'\n"
            "import superkernel.kernel, superkernel.pool, superkernel.merge, superkernel.protocol\n"
            "import superkernel.magics.front_side\n"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
