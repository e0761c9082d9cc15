"""Runs as a rank of tests/transport/test_world.py: prints what a rank's script sees of its start (argv, the
variables it was given, its threads, session, sys.path, a random draw) as a REPORT line, then exits as its
first argument says: "ok", "code N", "raise" (an uncaught exception) or "hang" (until killed)."""
from __future__ import annotations

import json
import os
import random
import sys
import time

import torch

print("REPORT " + json.dumps({
    "argv": sys.argv, "name": __name__, "rank": os.environ.get("RANK"), "probe": os.environ.get("PROBE_VALUE"),
    "threads": torch.get_num_threads(), "sid_is_pid": os.getsid(0) == os.getpid(), "path0": sys.path[0],
    "draw": random.random(), "cwd": os.getcwd(), "stdin": sys.stdin.read(), "superkernel_loaded":
    any(m.startswith("superkernel") for m in sys.modules)}), flush=True)
print(f"stderr of rank {os.environ.get('RANK')}", file=sys.stderr)
what = sys.argv[1]
if what == "code":
    sys.exit(int(sys.argv[2]))
if what == "raise":
    raise ValueError("raised by world_probe")
if what == "hang":
    time.sleep(600)
