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
    info, shell, allreduce, sharding, barrier, tensor_parallel, attention, moe = execute("examples.ipynb", "sk-test-2")
    rows = [line for _, line in labelled(info) if re.match(r"\s*\d+\s+\d+\s+\S+\s+\d+\s+cpu", line)]
    assert len(rows) == 2 and "world size 2 on 1 host(s)" in info
    assert labelled(shell)[0][0] == "[ranks 0,1]" and len(labelled(shell)) == 2
    assert "[ranks 0,1] all_reduce(rank + 1) = 3 (expected 3)" in allreduce
    assert "Out: [ranks 0,1] 3.0" in allreduce
    assert ("[rank 0]", "rank 0: 500 items [0 .. 499]") in labelled(sharding)
    assert ("[rank 1]", "rank 1: 500 items [500 .. 999]") in labelled(sharding)
    assert "[ranks 0,1] sum over all shards = 499500, sum of the whole dataset = 499500" in sharding
    assert "median" in barrier and re.search(r"all\s+[\d.]+\s+[\d.]+\s+[\d.]+", barrier)
    # the fused ops, each checked by every rank against the computation done whole
    assert "[ranks 0,1] gemm_allreduce (64, 256): equals the unsplit block: True" in tensor_parallel
    for label, positions in (("[rank 0]", "0-127"), ("[rank 1]", "128-255")):
        line = f"ring_attention, positions {positions}: equals SDPA over the whole sequence: True"
        assert (label, line) in labelled(attention), attention
    lines = {label: line for label, line in labelled(moe)}
    assert set(lines) == {"[rank 0]", "[rank 1]"}, moe
    for label, line in lines.items():
        got = re.fullmatch(rf"moe: rank {label[-2]}'s experts got \[(\d+), (\d+)\] rows; combined output equals the "
                           r"dense reference: True", line)
        assert got, line
    # 16 tokens x top-2 on each of the 2 ranks: 64 (token, choice) rows reach the 4 experts, none dropped
    assert sum(int(n) for line in lines.values() for n in re.findall(r"\[(\d+), (\d+)\]", line)[0]) == 64, moe


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
    assert out.stdout.count("In [") == 8
    assert "all_reduce(rank + 1) = 3 (expected 3)" in out.stdout
    assert "equals the unsplit block: True" in out.stdout
    assert "# 8 cells in" in out.stdout and "FAILED" not in out.stdout


def printed_by(text: str, line: str) -> set[int]:
    """The ranks whose output contains ``line`` (collapsed "[ranks 0,1]" or separate "[rank N]" lines)."""
    ranks: set[int] = set()
    for label, got in labelled(text):
        if got == line:
            for a, b in re.findall(r"(\d+)(?:-(\d+))?", label):
                ranks.update(range(int(a), int(b or a) + 1))
    return ranks


def test_ram_as_a_service_notebook(kernel_prefix):
    nb = nbformat.read(NOTEBOOKS / "ram_as_a_service.ipynb", as_version=4)
    NotebookClient(nb, kernel_name="sk-test-2", timeout=180, allow_errors=False).execute()
    code = [c for c in nb.cells if c.cell_type == "code"]
    texts = ["".join(o.text for o in c.outputs if o.output_type == "stream") for c in code]
    probe, window, atomics, store, memory, full, compare, cleanup = texts
    assert re.search(r"intra-host: shared memory, [\d.]+ GB/s, [\d.]+ µs", probe)
    assert re.search(r"RDMA: (not present|present)", probe)
    assert any("image/png" in o.get("data", {}) for o in code[0].outputs if o.output_type == "display_data")
    assert ("[rank 0]", "rank 0 read rank 1's window: [100, 100, 100, 100]") in labelled(window)
    assert ("[rank 1]", "rank 1 read rank 0's window: [0, 0, 0, 0]") in labelled(window)
    assert "counter after 2 fetch_add: 2 (expected 2)" in atomics
    assert printed_by(atomics, "tickets: [0, 1]") == {0, 1}
    assert ("[rank 0]", "rank 0: activations/rank1 is (1024, 1024), mean 1.0, stored on rank 1 (4 MiB)") \
        in labelled(store)
    assert ("[rank 1]", "rank 1: activations/rank0 is (1024, 1024), mean 0.0, stored on rank 0 (4 MiB)") \
        in labelled(store)
    assert printed_by(store, "keys: ['activations/rank0', 'activations/rank1']") == {0, 1}
    assert re.search(r"all\s+128 MiB\s+8 MiB\s+120 MiB\s+6\.2\s+2$", memory, re.M), memory
    assert "TensorStoreFull: TensorStore full: 2 ranks × 64 MiB capacity, 60 MiB free at most on one rank, " \
           "cannot place 80 MiB" in full
    assert printed_by(full, "still stored: ['activations/rank0', 'activations/rank1']") == {0, 1}
    for r in (0, 1):
        assert re.search(rf"rank {r}: local copy [\d.]+ GB/s; TensorStore get from rank {1 - r}: [\d.]+ GB/s",
                         compare), compare
    assert "no TensorStore in this pool" in cleanup
