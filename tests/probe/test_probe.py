"""``superkernel probe`` on a local 2-rank pool, the hardware detection against a fake sysfs, and the
``%probe`` / ``%memory`` magics through a running kernel."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
OSU_ROW = re.compile(r"^(\d+)\s+([\d.]+)(?:\s+([\d.]+))?$")


def run_cli(tmp_path: Path, *args: str, env: dict[str, str] | None = None, timeout: float = 180
            ) -> subprocess.CompletedProcess[str]:
    e = dict(os.environ)
    e.pop("SUPERKERNEL_FRONTEND", None)
    e.pop("JUPYTER_PATH", None)
    for k in ("RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID"):
        e.pop(k, None)
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "superkernel", "probe", *args], cwd=tmp_path, env=e,
                          capture_output=True, text=True, timeout=timeout)


def osu_blocks(text: str) -> dict[str, list[tuple[int, float]]]:
    """'# OSU ... Test' blocks -> {title + route: [(size, value)]} (first value column)."""
    blocks: dict[str, list[tuple[int, float]]] = {}
    title = None
    for line in text.splitlines():
        if line.startswith("# OSU"):
            title = line[2:]
        elif title and line.startswith("# ") and "(rank" in line or (title and line == "# all ranks"):
            title = f"{title} | {line[2:]}"
            blocks[title] = []
        elif title in blocks and (m := OSU_ROW.match(line.strip())):
            blocks[title].append((int(m.group(1)), float(m.group(2))))
        elif not line.strip():
            title = None
    return blocks


@pytest.fixture(scope="module")
def shm_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], Path]:
    tmp = tmp_path_factory.mktemp("probe")
    return run_cli(tmp, "--ranks", "2", "--quick", "--time", "0.005", "--plot", "probe.png", "--json", "probe.json"
                   ), tmp


def test_cli_two_ranks_prints_measured_tables(shm_run) -> None:
    out, tmp = shm_run
    assert out.returncode == 0, out.stdout + out.stderr
    text = out.stdout
    blocks = osu_blocks(text)
    lat = blocks["OSU MPI Latency Test (osu_latency method) | intra-host shared memory (rank 0 <-> 1)"]
    bw = blocks["OSU MPI Bandwidth Test (osu_bw method) | intra-host shared memory (rank 0 <-> 1)"]
    sizes = [s for s, _ in lat]
    assert sizes[0] == 1 and sizes[-1] == 1 << 20 and sizes == sorted(sizes)
    assert all(v > 0 for _, v in lat + bw)
    # physics, not hard-coded numbers: a 1 MiB message moves more bytes per second than a 1-byte one, and
    # takes longer than the fastest small one (the min over several sizes: one point can catch a scheduler
    # delay on a loaded machine); latency is plausible for a host (between 0.05 us and 50 ms)
    assert bw[-1][1] > 10 * bw[0][1]
    assert lat[-1][1] > min(v for size, v in lat if size <= 1024)
    assert all(0.05 < v < 50_000 for _, v in lat)
    ar = next(v for k, v in blocks.items() if k.startswith("OSU MPI Allreduce"))
    assert ar and all(v > 0 for _, v in ar)
    # the bandwidth in MB/s matches size / (per-message time) within the same table's own numbers
    doc = json.loads((tmp / "probe.json").read_text())
    assert doc["world_size"] == 2 and list(doc["ranks_per_host"].values()) == [[0, 1]]
    for s in doc["series"]:
        for size, lat_us, mbps in zip(s["sizes"], s["latency_us"], s["bandwidth_MBps"]):
            if s["test"] != "allreduce":
                assert mbps == pytest.approx(size / lat_us, rel=1e-6)


def test_cli_verdict_and_hardware(shm_run) -> None:
    out, tmp = shm_run
    text = out.stdout
    verdict = text[text.index("# verdict"):]
    m = re.search(r"intra-host: shared memory, ([\d.]+) GB/s, ([\d.]+) µs", verdict)
    assert m and float(m.group(1)) > 0 and float(m.group(2)) > 0, verdict
    assert "inter-host: not measured (all ranks on 1 host)" in verdict
    assert "# hardware: 1 host(s), 2 rank(s), backend mk, launcher torchrun" in text
    rdma_here = os.path.isdir("/sys/class/infiniband") and os.listdir("/sys/class/infiniband")
    if rdma_here:
        assert "RDMA: present" in verdict
    else:
        assert "RDMA: not present" in verdict
        assert re.search(r"RDMA: not present \(no /sys/class/infiniband", text)
    cxl_here = os.path.isdir("/sys/bus/cxl/devices")
    assert ("CXL memory: not present" in verdict) != bool(cxl_here and os.listdir("/sys/bus/cxl/devices"))
    nodes = [d for d in os.listdir("/sys/devices/system/node") if re.fullmatch(r"node\d+", d)]
    assert f"NUMA: {len(nodes)} node(s)" in text
    assert f"{os.cpu_count()} CPUs" in text or "CPUs" in text
    png = (tmp / "probe.png").read_bytes()
    assert png.startswith(PNG_MAGIC) and len(png) > 10_000


def test_cli_reports_the_provider_actually_used(tmp_path: Path) -> None:
    """Forced TCP between two ranks of one host: the tables and the verdict name TCP, not shared memory."""
    out = run_cli(tmp_path, "--ranks", "2", "--quick", "--time", "0.005", "--max-bytes", "64K", "--no-one-sided",
                  "--plot", "", "--transport", "tcp")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "intra-host TCP (rank 0 <-> 1)" in out.stdout
    assert re.search(r"intra-host: TCP, [\d.]+ GB/s, [\d.]+ µs", out.stdout)
    assert "shared memory" not in out.stdout
    assert not (tmp_path / "superkernel-probe.png").exists()


def test_hardware_detection_on_a_fake_sysfs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from superkernel.probe import hardware
    from superkernel.probe.report import ProbeReport
    from superkernel.probe.verdict import format_hardware, verdict_line

    sysfs = tmp_path / "sys"
    port = sysfs / "class/infiniband/mlx5_0/ports/1"
    port.mkdir(parents=True)
    (port / "state").write_text("4: ACTIVE\n")
    (port / "rate").write_text("100 Gb/sec (4X EDR)\n")
    (port / "link_layer").write_text("InfiniBand\n")
    (sysfs / "bus/cxl/devices/mem0").mkdir(parents=True)
    (sysfs / "bus/cxl/devices/root0").mkdir(parents=True)
    for node, cpus, kb in ((0, "0-7", 16 << 20), (1, "", 64 << 20)):
        d = sysfs / f"devices/system/node/node{node}"
        d.mkdir(parents=True)
        (d / "cpulist").write_text(cpus + "\n")
        (d / "meminfo").write_text(f"Node {node} MemTotal:       {kb} kB\nNode {node} MemFree: 1 kB\n")
    monkeypatch.setenv("SUPERKERNEL_SYSFS", str(sysfs))
    hw = hardware.detect()
    assert [d.name for d in hw.rdma] == ["mlx5_0"]
    assert hw.rdma[0].ports[0].state == "4: ACTIVE" and hw.rdma[0].ports[0].link_layer == "InfiniBand"
    assert hw.cxl == ["mem0", "root0"] and hw.cxl_memory == ["mem0"]
    assert [(n.node, n.memory_only, n.memory_bytes) for n in hw.numa] == [(0, False, 16 << 30), (1, True, 64 << 30)]
    report = ProbeReport(2, "mk", "test", "now", [hw], {hw.host: [0, 1]})
    again = ProbeReport.from_json(json.loads(report.dumps()))
    text = format_hardware(again)
    assert "mlx5_0 port 1 4: ACTIVE 100 Gb/sec (4X EDR) InfiniBand" in text
    assert "node1 cpus - 64 GiB (memory only)" in text
    line = verdict_line(again)
    assert "RDMA: present: mlx5_0" in line and "CXL memory: present: mem0" in line


@pytest.fixture(scope="module")
def kernel(kernel_prefix: str):  # noqa: ANN201
    from tests.probe.conftest import KernelSession

    k = KernelSession("sk-test-2")
    k.ok("pass", timeout=180)
    yield k
    k.shutdown()


def test_probe_magic_in_the_kernel(kernel) -> None:
    r = kernel.ok("%probe --quick --time 0.005", timeout=180)
    text = r.stream()
    assert "# verdict" in text and "[rank 0]" in text
    m = re.search(r"intra-host: shared memory, ([\d.]+) GB/s, ([\d.]+) µs", text)
    assert m and float(m.group(1)) > 0 and float(m.group(2)) > 0, text
    assert "[rank 1]" not in text  # only rank 0 reports
    assert re.search(r"OSU MPI_Put Latency Test", text)  # one-sided measured through the Window
    images = [d for d in r.of_type("display_data") if "image/png" in d["data"]]
    assert len(images) == 1
    import base64

    assert base64.b64decode(images[0]["data"]["image/png"]).startswith(PNG_MAGIC)
    r = kernel.ok("print(type(probe_report).__name__ if rank == 0 else 'no report', "
                  "len(probe_report.series) if rank == 0 else 0)")
    assert "[rank 0] ProbeReport" in r.stream()


def test_memory_magic_in_the_kernel(kernel) -> None:
    r = kernel.ok("%memory")
    assert "no TensorStore in this pool" in r.stream()
    kernel.ok("from superkernel.memory import TensorStore\n"
              "store = TensorStore(capacity_per_rank='4MiB')\n"
              "store.put(f'r{rank}', torch.zeros(262144 if rank == 0 else 1000))\n"   # 1 MiB and 4000 B
              "store.put(f'extra{rank}', torch.zeros(3), rank=1)\n"
              "dist.barrier()")
    text = kernel.ok("%memory").stream()
    # reference: what was put, rounded up to the store's 4 KiB allocation unit: rank 0 holds r0 (1 MiB, placed
    # on the putting rank since both were empty); rank 1 holds r1 (4000 B) and extra0/extra1 (12 B each)
    used0, used1 = 1 << 20, 3 * 4096
    assert re.search(r"^\[rank 0\] TensorStore ", text, re.M), text
    assert re.search(r"^\s*0\s+\S+\s+4 MiB\s+1 MiB\s+3 MiB\s+25\.0\s+1\s+3 MiB$", text, re.M), text
    pct1 = f"{100 * used1 / (4 << 20):.1f}"
    assert re.search(rf"^\s*1\s+\S+\s+4 MiB\s+12 KiB\s+4\.0 MiB\s+{pct1}\s+3\s+4\.0 MiB$", text, re.M), text
    pct = f"{100 * (used0 + used1) / (8 << 20):.1f}"
    assert re.search(rf"^\s*all\s+8 MiB\s+1\.0 MiB\s+7\.0 MiB\s+{pct}\s+4$", text, re.M), text
    kernel.ok("store.free()")
    assert "no TensorStore in this pool" in kernel.ok("%memory").stream()


def test_probe_between_two_hosts(tmp_path: Path) -> None:
    """Two network-namespace hosts, two ranks each: the probe finds both hosts, measures shared memory
    inside a host and TCP between them, and says so in the verdict."""
    from tests.netns.hosts import TwoHosts, run_torch_job, unavailable_reason

    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(f"two namespace hosts unavailable: {reason}")
    import superkernel.probe

    entry = str(Path(superkernel.probe.__file__).parent / "__main__.py")
    report = tmp_path / "probe.json"
    with TwoHosts() as hosts:
        results = run_torch_job(hosts, entry, ["--quick", "--time", "0.005", "--plot", "", "--json", str(report)],
                                nproc_per_host=2, timeout=240, env={"SUPERKERNEL_FRONTEND": "0"})
    out = results[0].stdout
    assert all(r.returncode == 0 for r in results), "\n".join(r.stdout[-2000:] + r.stderr[-3000:] for r in results)
    assert "# hardware: 2 host(s), 4 rank(s), backend mk, launcher torchrun" in out, out
    assert re.search(r"intra-host: shared memory, [\d.]+ GB/s, [\d.]+ µs", out), out
    assert re.search(r"inter-host: TCP, [\d.]+ GB/s, [\d.]+ µs", out), out
    doc = json.loads(report.read_text())
    assert sorted(map(sorted, doc["ranks_per_host"].values())) == [[0, 1], [2, 3]]
    routes = {(s["route"]["provider"], s["route"]["b"]) for s in doc["series"] if s["route"]}
    assert routes == {("shm", 1), ("tcp", 2)}
    tests = {s["test"] for s in doc["series"] if s["route"] and s["route"]["provider"] == "tcp"}
    assert tests == {"latency", "bw", "put_latency", "get_latency", "put_bw", "get_bw"}


def test_front_end_modules_do_not_import_torch() -> None:
    code = ("import sys, superkernel.cli, superkernel.probe.command, superkernel.probe.hardware, "
            "superkernel.probe.job, superkernel.magics.memory, superkernel.magics.probe, superkernel.magics.rank_side; "
            "print(sorted(m for m in ('torch', 'numpy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "SUPERKERNEL_FRONTEND": "1"},
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "torch" not in out.stdout, out.stdout


def test_probe_inside_an_srun_step(tmp_path: Path) -> None:
    """``srun -n 2 python -m superkernel.probe`` on a private one-node Slurm cluster: the ranks find each
    other from Slurm's environment (SLURM_PROCID/SLURM_NTASKS, MASTER_ADDR = the step's first node)."""
    from tests.kernel.slurm_cluster import SlurmCluster, _which, unavailable_reason

    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(f"no Slurm here: {reason}")
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with SlurmCluster() as cluster:
        env = {k: v for k, v in os.environ.items()
               if k not in ("SUPERKERNEL_FRONTEND", "RANK", "WORLD_SIZE", "MASTER_ADDR")}
        env.update(cluster.env, MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        out = subprocess.run([_which("srun"), "--ntasks=2", "--kill-on-bad-exit=1", sys.executable, "-m",
                              "superkernel.probe", "--quick", "--time", "0.005", "--no-tables", "--plot", ""],
                             cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "# hardware: 1 host(s), 2 rank(s), backend mk, launcher srun" in out.stdout
    assert re.search(r"intra-host: shared memory, [\d.]+ GB/s, [\d.]+ µs", out.stdout), out.stdout


def test_probe_inside_an_mpirun_job(tmp_path: Path) -> None:
    """``mpirun -np 2 python -m superkernel.probe``: rank, size and the TCPStore address come from Open MPI."""
    import shutil

    mpirun = shutil.which("mpirun")
    if mpirun is None:
        pytest.skip("no mpirun (Debian: openmpi-bin)")
    env = {k: v for k, v in os.environ.items()
           if k not in ("SUPERKERNEL_FRONTEND", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMP_NUM_THREADS="1")
    out = subprocess.run([mpirun, "--oversubscribe", "--bind-to", "none", "-np", "2", sys.executable, "-m",
                          "superkernel.probe", "--quick", "--max-bytes", "4K", "--time", "0.005", "--no-one-sided",
                          "--plot", ""], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "# hardware: 1 host(s), 2 rank(s), backend mk, launcher mpirun" in out.stdout
    sizes = [s for s, _ in osu_blocks(out.stdout)[
        "OSU MPI Latency Test (osu_latency method) | intra-host shared memory (rank 0 <-> 1)"]]
    assert sizes == [1, 4, 16, 64, 256, 1024, 4096]
