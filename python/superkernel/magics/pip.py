"""``%pip`` on a rank pool: pip runs once per host (on local rank 0); the other ranks wait for it.

Several ranks running ``pip install`` into one environment at once race on the same files, which is how
notebooks lose their pool. Here the first local rank installs while holding a host-wide lock, and the others
wait (interruptibly, with a timeout) for its result, then report it.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import sys
import tempfile
import time

from IPython.core.magic import Magics, line_magic, magics_class

PIP_TIMEOUT = float(os.environ.get("SUPERKERNEL_PIP_TIMEOUT", "900"))


@magics_class
class PipMagics(Magics):
    @line_magic
    def pip(self, line: str) -> None:
        """Run pip once per host for the whole pool (same arguments as IPython's %pip)."""
        ns = self.shell.user_ns
        parent = getattr(self.shell, "parent_header", {}) or {}
        cell = parent.get("header", parent).get("msg_id", "") if isinstance(parent, dict) else ""
        key = hashlib.sha1(f"{sys.prefix}|{cell}|{line}".encode()).hexdigest()[:16]
        done = os.path.join(tempfile.gettempdir(), f"superkernel-pip-{key}.json")
        if ns.get("local_rank", ns.get("rank", 0)) == 0:
            lock = os.path.join(tempfile.gettempdir(), "superkernel-pip.lock")
            with open(lock, "w") as lf:
                fcntl.flock(lf, fcntl.LOCK_EX)
                try:
                    self.shell.system(f"{sys.executable} -m pip {line}")
                    code = self.shell.user_ns.get("_exit_code", 0)
                finally:
                    fcntl.flock(lf, fcntl.LOCK_UN)
            with open(done, "w") as f:
                json.dump({"exit_code": code}, f)
            print("Note: you may need to %restart the pool to use updated packages.")
            return
        deadline = time.monotonic() + PIP_TIMEOUT
        while not os.path.exists(done):
            if time.monotonic() > deadline:
                raise TimeoutError(f"pip on local rank 0 did not finish within {PIP_TIMEOUT:.0f} s")
            time.sleep(0.1)
        with open(done) as f:
            code = json.load(f)["exit_code"]
        print("Note: you may need to %restart the pool to use updated packages.")
        if code:
            print(f"pip failed on local rank 0 (exit code {code})")
