"""The example notebooks, executed headless by nbclient with their outputs checked, and the example runner."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import nbformat
from nbclient import NotebookClient

from conftest import labelled

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"


def execute(name: str, kernel_name: str) -> list[str]:
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    NotebookClient(nb, kernel_name=kernel_name, timeout=180, allow_errors=False).execute()
    texts = []
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        parts = []
        for out in cell.outputs:
            assert out.output_type != "error", out
            if out.output_type == "stream":
                parts.append(out.text)
            elif out.output_type == "execute_result":
                parts.append("Out: " + out.data["text/plain"] + "\n")
        texts.append("".join(parts))
    return texts


def test_examples_notebook(kernel_prefix):
    info, shell, allreduce, sharding, barrier = execute("examples.ipynb", "sk-test-2")
    rows = [line for _, line in labelled(info) if re.match(r"\s*\d+\s+\d+\s+\S+\s+\d+\s+cpu", line)]
    assert len(rows) == 2 and "world size 2 on 1 host(s)" in info
    assert labelled(shell)[0][0] == "[ranks 0,1]" and len(labelled(shell)) == 2
    assert "[ranks 0,1] all_reduce(rank + 1) = 3 (expected 3)" in allreduce
    assert "Out: [ranks 0,1] 3.0" in allreduce
    assert ("[rank 0]", "rank 0: 500 items [0 .. 499]") in labelled(sharding)
    assert ("[rank 1]", "rank 1: 500 items [500 .. 999]") in labelled(sharding)
    assert "[ranks 0,1] sum over all shards = 499500, sum of the whole dataset = 499500" in sharding
    assert "median" in barrier and re.search(r"all\s+[\d.]+\s+[\d.]+\s+[\d.]+", barrier)


def test_mpi_examples_notebook(kernel_prefix):
    info, shell, allreduce, sharding, barrier = execute("mpi_examples.ipynb", "sk-test-mpi-2")
    assert "world size 2 on 1 host(s)" in info and "MPI" in info
    assert len(labelled(shell)) == 1
    assert "[ranks 0,1] allreduce(rank + 1) = 3 (expected 3)" in allreduce
    assert "Out: [ranks 0,1] 3" in allreduce
    assert "[ranks 0,1] sum over all shards = 499500, sum of the whole dataset = 499500" in sharding
    assert "median" in barrier


def test_example_runner_prints_every_cell(tmp_path):
    env = dict(os.environ)
    env.pop("JUPYTER_PATH", None)
    out = subprocess.run([sys.executable, "-m", "superkernel.example", "--ranks", "2"], cwd=NOTEBOOKS.parent,
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("In [") == 5
    assert "all_reduce(rank + 1) = 3 (expected 3)" in out.stdout
    assert "# 5 cells in" in out.stdout and "FAILED" not in out.stdout
