"""Runs inside namespace host a (see test_remote_pool.py): starts a SuperKernel whose pool spans two hosts,
runs cells once host b has joined, prints one ``REPORT {json}`` line, then SIGKILLs the kernel so the test
can check that the ranks on the other host notice and exit.

    python remote_pool_client.py JOIN_FILE BIND_ADDRESS RDZV_PORT
"""
from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from superkernel import install  # noqa: E402
from tests.kernel.conftest import KernelSession  # noqa: E402


def main() -> None:
    join_file, bind, port = sys.argv[1], sys.argv[2], sys.argv[3]
    prefix = tempfile.mkdtemp(prefix="sk-remote-")
    launcher = f"--nnodes=2 --rdzv-backend=c10d --rdzv-endpoint={bind}:{port} --rdzv-id=sk-remote-test"
    install.install("torch", "sk-remote", 2, prefix=prefix, launcher_args=launcher, bind=bind)
    os.environ["JUPYTER_PATH"] = os.path.join(prefix, "share", "jupyter")
    k = KernelSession("sk-remote", env={"SUPERKERNEL_JOIN_FILE": join_file, "SUPERKERNEL_INTERRUPT_GRACE": "2"})
    report: dict[str, object] = {}
    first = k.run("import socket\nprint(socket.gethostname(), world_size)", timeout=240)
    report["first"] = {"status": first.status, "stdout": first.stream(), "stderr": first.stream("stderr")}
    r = k.run("t = torch.ones(3) * (rank + 1)\ndist.all_reduce(t)\nprint(t.tolist())")
    report["allreduce"] = {"status": r.status, "stdout": r.stream()}
    r = k.run("%info")
    report["info"] = {"status": r.status, "stdout": r.stream()}
    mid = k.execute("import time\ntime.sleep(100)")
    threading.Timer(1.0, lambda: k.km.interrupt_kernel()).start()
    r = k.collect(mid, timeout=30)
    report["interrupt"] = {"status": r.status, "enames": sorted({e["ename"] for e in r.errors}),
                           "seconds": r.elapsed}
    r = k.run("print(rank)")
    report["after_interrupt"] = {"status": r.status, "stdout": r.stream()}
    report["kernel_pid"] = k.pid
    sys.stdout.write("REPORT " + json.dumps(report) + "\n")
    sys.stdout.flush()
    k.kc.stop_channels()
    os.kill(k.pid, signal.SIGKILL)  # the kernel vanishes: every rank, on both hosts, must exit by itself


if __name__ == "__main__":
    main()
