"""Shared fixtures for the kernel tests: kernelspecs installed into a temporary prefix, and a small client
that runs a cell and collects what the kernel published for it.

The kernelspec sets SUPERKERNEL_FRONTEND=1 for the kernel process; this module must not set it in
os.environ (every other test's subprocesses would then skip registering the mk backend)."""
from __future__ import annotations

import dataclasses
import os
import queue
import time
from collections.abc import Collection, Iterable, Iterator
from typing import Any

import psutil
import pytest
from jupyter_client.manager import KernelManager

from superkernel import install

SPECS = {
    # name: (flavor, ranks)
    "sk-test-1": ("torch", 1),
    "sk-test-2": ("torch", 2),
    "sk-test-4": ("torch", 4),
    "sk-test-mpi-2": ("mpi", 2),
}


@pytest.fixture(scope="session")
def kernel_prefix(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    prefix = str(tmp_path_factory.mktemp("jupyter-prefix"))
    for name, (flavor, ranks) in SPECS.items():
        install.install(flavor, name, ranks, prefix=prefix)
    old = os.environ.get("JUPYTER_PATH")
    os.environ["JUPYTER_PATH"] = os.path.join(prefix, "share", "jupyter") + (os.pathsep + old if old else "")
    yield prefix
    if old is None:
        os.environ.pop("JUPYTER_PATH", None)
    else:
        os.environ["JUPYTER_PATH"] = old


@dataclasses.dataclass
class CellResult:
    status: str
    reply: dict[str, Any]
    msgs: list[dict[str, Any]]
    elapsed: float

    def stream(self, name: str = "stdout") -> str:
        return "".join(m["content"]["text"] for m in self.msgs
                       if m["msg_type"] == "stream" and m["content"]["name"] == name)

    def of_type(self, msg_type: str) -> list[dict[str, Any]]:
        return [m["content"] for m in self.msgs if m["msg_type"] == msg_type]

    @property
    def result(self) -> str | None:
        res = self.of_type("execute_result")
        assert len(res) <= 1, "more than one execute_result"
        return res[0]["data"]["text/plain"] if res else None

    @property
    def errors(self) -> list[dict[str, Any]]:
        return self.of_type("error")


def labelled(text: str) -> list[tuple[str, str]]:
    """Merged output -> (label, line) pairs; indented continuation lines get the label of their run."""
    out: list[tuple[str, str]] = []
    label = ""
    for raw in text.splitlines():
        if raw.startswith("["):
            label, _, line = raw.partition("] ")
            label += "]"
        else:
            line = raw[len(label) + 1:] if label else raw
        out.append((label, line))
    return out


class KernelSession:
    def __init__(self, kernel_name: str, env: dict[str, str] | None = None) -> None:
        self.km = KernelManager(kernel_name=kernel_name)
        kw: dict[str, Any] = {}
        if env:
            kw["env"] = {**os.environ, **env}
        self.km.start_kernel(**kw)
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=60)

    @property
    def pid(self) -> int:
        return self.km.provisioner.process.pid  # type: ignore[union-attr]

    def execute(self, code: str) -> str:
        return self.kc.execute(code)

    def collect(self, msg_id: str, timeout: float = 120, t0: float | None = None) -> CellResult:
        t0 = t0 or time.monotonic()
        msgs = []
        deadline = time.monotonic() + timeout
        while True:
            try:
                m = self.kc.get_iopub_msg(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"no idle status for {msg_id} within {timeout} s; got {msgs}")
            if m["parent_header"].get("msg_id") != msg_id:
                continue
            if m["msg_type"] == "status":
                if m["content"]["execution_state"] == "idle":
                    break
                continue
            m["arrived"] = time.monotonic() - t0  # seconds after the request was sent
            msgs.append(m)
        while True:
            reply = self.kc.get_shell_msg(timeout=max(1.0, deadline - time.monotonic()))
            if reply["parent_header"].get("msg_id") == msg_id:
                break
        return CellResult(reply["content"]["status"], reply["content"], msgs, time.monotonic() - t0)

    def run(self, code: str, timeout: float = 120) -> CellResult:
        t0 = time.monotonic()
        return self.collect(self.execute(code), timeout, t0)

    def ok(self, code: str, timeout: float = 120) -> CellResult:
        r = self.run(code, timeout)
        assert r.status == "ok", (code, r.errors, r.msgs)
        return r

    def process_tree(self) -> list[psutil.Process]:
        try:
            root = psutil.Process(self.pid)
            return [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def shutdown(self) -> None:
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=False)


def pool_processes(connection_files: Collection[str] | None = None) -> list[psutil.Process]:
    """Every superkernel worker / launcher process on the machine, or only those of the pools whose connection
    files are given (another kernel's pool, another test session's among them, is then left out)."""
    out = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if "superkernel.worker" in cmd or ("torch.distributed.run" in cmd and "superkernel" in cmd):
            if connection_files is None or any(f in cmd for f in connection_files):
                out.append(p)
    return out


def connection_files(procs: Iterable[psutil.Process]) -> set[str]:
    """The pool connection files named (`--connection-file PATH`) on these processes' command lines."""
    out = set()
    for p in procs:
        try:
            argv = p.cmdline()
        except psutil.Error:
            continue
        out |= {argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--connection-file"}
    return out


@pytest.fixture(scope="module")
def kernel2(kernel_prefix: str) -> Iterator[KernelSession]:
    """One 2-rank torch kernel shared by a test module (interrupt grace shortened for the tests)."""
    k = KernelSession("sk-test-2", env={"SUPERKERNEL_INTERRUPT_GRACE": "1.5"})
    k.ok("pass", timeout=180)  # wait for the pool
    yield k
    k.shutdown()
