"""What one host offers: CPUs and NUMA nodes, GPUs and their peer links, RDMA devices, CXL memory devices.

Torch-free and side-effect-free: it only reads ``/sys`` and ``/proc``, asks ``nvidia-smi`` when it exists
and asks libibverbs (loaded with ctypes when present) which devices it sees. Every probe records *how* it
found its answer (``source``), so "not present" always says what was looked at.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import shutil
import socket
import subprocess
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any



def sysfs() -> Path:
    """Where /sys is (SUPERKERNEL_SYSFS points the detection at another tree, e.g. a test's fake one)."""
    return Path(os.environ.get("SUPERKERNEL_SYSFS", "/sys"))

NVIDIA_SMI_TIMEOUT = 10.0


@dataclass
class NumaNode:
    node: int
    cpus: str            # kernel cpulist syntax, e.g. "0-15,32-47"; "" for a memory-only node
    memory_bytes: int

    @property
    def memory_only(self) -> bool:
        """A NUMA node with memory but no CPUs: how CXL.mem expanders (and HBM/PMEM) usually appear."""
        return not self.cpus and self.memory_bytes > 0


@dataclass
class Gpu:
    index: int
    name: str
    memory_bytes: int
    bus_id: str


@dataclass
class RdmaPort:
    port: int
    state: str           # e.g. "4: ACTIVE"
    rate: str            # e.g. "100 Gb/sec (4X EDR)"
    link_layer: str      # InfiniBand | Ethernet (RoCE)


@dataclass
class RdmaDevice:
    name: str
    ports: list[RdmaPort] = field(default_factory=list)


@dataclass
class HostHardware:
    host: str
    cpus: int
    memory_bytes: int
    numa: list[NumaNode]
    gpus: list[Gpu]
    gpu_topology: str            # `nvidia-smi topo -m` verbatim, "" when unavailable
    gpu_source: str              # how GPUs were looked for
    rdma: list[RdmaDevice]
    rdma_source: str
    ibverbs_devices: list[str] | None  # what libibverbs lists; None when the library is not installed
    cxl: list[str]               # /sys/bus/cxl/devices entries (mem*, root*, port*, decoder*...)
    cxl_source: str

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_json(d: dict[str, Any]) -> "HostHardware":
        d = dict(d)
        d["numa"] = [NumaNode(**n) for n in d["numa"]]
        d["gpus"] = [Gpu(**g) for g in d["gpus"]]
        d["rdma"] = [RdmaDevice(r["name"], [RdmaPort(**p) for p in r["ports"]]) for r in d["rdma"]]
        return HostHardware(**d)

    @property
    def cxl_memory(self) -> list[str]:
        """CXL memory devices (``memN``), or memory-only NUMA nodes when the CXL bus is not exposed."""
        return [c for c in self.cxl if c.startswith("mem")]


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def _meminfo_total(text: str) -> int:
    for line in text.splitlines():
        parts = line.split()
        if "MemTotal:" in parts:
            i = parts.index("MemTotal:")
            return int(parts[i + 1]) * 1024
    return 0


def numa_nodes() -> list[NumaNode]:
    base = sysfs() / "devices/system/node"
    nodes = []
    for d in sorted(base.glob("node[0-9]*"), key=lambda p: int(p.name[4:])):
        nodes.append(NumaNode(int(d.name[4:]), _read(d / "cpulist"), _meminfo_total(_read(d / "meminfo"))))
    return nodes


def gpus() -> tuple[list[Gpu], str, str]:
    """(GPUs, `nvidia-smi topo -m` output, source description)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return [], "", "nvidia-smi not found"
    try:
        q = subprocess.run([smi, "--query-gpu=index,name,memory.total,pci.bus_id", "--format=csv,noheader,nounits"],
                           capture_output=True, text=True, timeout=NVIDIA_SMI_TIMEOUT)
    except (OSError, subprocess.TimeoutExpired) as e:
        return [], "", f"nvidia-smi failed: {e}"
    if q.returncode != 0:
        return [], "", f"nvidia-smi exited {q.returncode}: {(q.stderr or q.stdout).strip()[:200]}"
    found = []
    for line in q.stdout.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) >= 4 and parts[0].isdigit():
            mem = int(float(parts[2]) * 2**20) if parts[2].replace(".", "").isdigit() else 0
            found.append(Gpu(int(parts[0]), parts[1], mem, parts[3]))
    topo = ""
    if len(found) > 1:
        try:
            t = subprocess.run([smi, "topo", "-m"], capture_output=True, text=True, timeout=NVIDIA_SMI_TIMEOUT)
            topo = t.stdout.rstrip() if t.returncode == 0 else ""
        except (OSError, subprocess.TimeoutExpired):
            pass
    return found, topo, "nvidia-smi"


def rdma_devices() -> tuple[list[RdmaDevice], str]:
    base = sysfs() / "class/infiniband"
    if not base.is_dir():
        return [], f"no {base}"
    devices = []
    for d in sorted(base.iterdir()):
        ports = []
        for p in sorted((d / "ports").glob("*"), key=lambda x: int(x.name) if x.name.isdigit() else 0):
            ports.append(RdmaPort(int(p.name) if p.name.isdigit() else 0, _read(p / "state"), _read(p / "rate"),
                                  _read(p / "link_layer")))
        devices.append(RdmaDevice(d.name, ports))
    return devices, str(base)


def ibverbs_device_names() -> list[str] | None:
    """Device names as libibverbs lists them (``ibv_get_device_list``); None when libibverbs is absent."""
    lib_name = ctypes.util.find_library("ibverbs")
    if lib_name is None:
        return None
    try:
        lib = ctypes.CDLL(lib_name)
    except OSError:
        return None
    lib.ibv_get_device_list.restype = ctypes.POINTER(ctypes.c_void_p)
    lib.ibv_get_device_list.argtypes = [ctypes.POINTER(ctypes.c_int)]
    lib.ibv_get_device_name.restype = ctypes.c_char_p
    lib.ibv_get_device_name.argtypes = [ctypes.c_void_p]
    lib.ibv_free_device_list.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
    n = ctypes.c_int(0)
    lst = lib.ibv_get_device_list(ctypes.byref(n))
    if not lst:
        return []
    try:
        return [lib.ibv_get_device_name(lst[i]).decode() for i in range(n.value)]
    finally:
        lib.ibv_free_device_list(lst)


def cxl_devices() -> tuple[list[str], str]:
    base = sysfs() / "bus/cxl/devices"
    if not base.is_dir():
        return [], f"no {base}"
    return sorted(p.name for p in base.iterdir()), str(base)


def detect() -> HostHardware:
    """Everything this host offers, as seen from this process."""
    gpu_list, topo, gpu_source = gpus()
    rdma, rdma_source = rdma_devices()
    cxl, cxl_source = cxl_devices()
    return HostHardware(
        host=socket.gethostname(),
        cpus=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 0),
        memory_bytes=_meminfo_total(_read(Path("/proc/meminfo"))),
        numa=numa_nodes(),
        gpus=gpu_list,
        gpu_topology=topo,
        gpu_source=gpu_source,
        rdma=rdma,
        rdma_source=rdma_source,
        ibverbs_devices=ibverbs_device_names(),
        cxl=cxl,
        cxl_source=cxl_source,
    )
