"""Kernel latency benchmark (not a test): SuperKernel against ipyparallel's %px, same number of ranks/engines.

For each size in --ranks (default 1 2 4):

* start-up: from starting the kernel (SuperKernel) / the cluster (ipyparallel) to the first cell done;
* empty cell: median and p90 round trip of ``pass`` (execute_request -> reply and idle), --repeat times;
* 10k lines: every rank prints 10,000 distinct lines (``r<rank> <i>``); time until the cell is idle,
  and a check that every line arrived, in order within its rank.

Prints a table and writes JSON to bench/results/kernel_latency.json.

    python bench/kernel_latency.py [--ranks 1 2 4] [--repeat 50] [--skip-ipyparallel]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import queue
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("SUPERKERNEL_FRONTEND", "1")

from jupyter_client.manager import KernelManager  # noqa: E402

LINES = 10_000


class Client:
    def __init__(self, km: KernelManager) -> None:
        self.km = km
        self.kc = km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=120)

    def run(self, code: str, timeout: float = 600) -> tuple[float, str, str]:
        """(seconds until idle, reply status, stdout plus the final text of every display).

        ipyparallel's %px shows engine output as displays updated in place, so those count as delivered text.
        """
        t0 = time.perf_counter()
        msg_id = self.kc.execute(code)
        out: list[str] = []
        displays: dict[str, str] = {}
        deadline = time.monotonic() + timeout
        while True:
            try:
                m = self.kc.get_iopub_msg(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(code)
            if m["parent_header"].get("msg_id") != msg_id:
                continue
            if m["msg_type"] == "stream" and m["content"]["name"] == "stdout":
                out.append(m["content"]["text"])
            elif m["msg_type"] in ("display_data", "update_display_data"):
                key = m["content"].get("transient", {}).get("display_id") or m["header"]["msg_id"]
                displays[key] = m["content"]["data"].get("text/plain", "")
            if m["msg_type"] == "status" and m["content"]["execution_state"] == "idle":
                break
        while True:
            reply = self.kc.get_shell_msg(timeout=30)
            if reply["parent_header"].get("msg_id") == msg_id:
                break
        return time.perf_counter() - t0, reply["content"]["status"], "".join(out) + "".join(displays.values())

    def close(self) -> None:
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=False)


def empty_cells(c: Client, code: str, repeat: int) -> list[float]:
    for _ in range(3):
        c.run(code)  # warm up
    times = []
    for _ in range(repeat):
        dt, status, _ = c.run(code)
        assert status == "ok", status
        times.append(dt * 1e3)
    return times


def check_lines(text: str, n: int, ranks: int, pattern: str) -> bool:
    """Every rank's lines r<k> 0..LINES-1 present and in order."""
    seen: dict[int, list[int]] = {r: [] for r in range(ranks)}
    for m in re.finditer(pattern, text):
        seen[int(m.group(1))].append(int(m.group(2)))
    return all(v == list(range(n)) for v in seen.values())


def bench_superkernel(ranks: int, repeat: int) -> dict[str, Any]:
    from superkernel import install

    prefix = tempfile.mkdtemp(prefix="superkernel-bench-")
    try:
        install.install("torch", "superkernel-bench", ranks, prefix=prefix)
        os.environ["JUPYTER_PATH"] = os.path.join(prefix, "share", "jupyter")
        t0 = time.perf_counter()
        km = KernelManager(kernel_name="superkernel-bench")
        km.start_kernel()
        c = Client(km)
        c.run("pass")
        startup = time.perf_counter() - t0
        backend = c.run("%%rank 0\nprint(dist.get_backend())")[2].split()[-1]
        times = empty_cells(c, "pass", repeat)
        c.run("%output raw --max-lines 0")
        dt, status, text = c.run(f"for i in range({LINES}): print(f'r{{rank}} {{i}}')")
        ok = status == "ok" and check_lines(text, LINES, ranks, r"r(\d+) (\d+)")
        c.close()
        return {"startup_s": startup, "empty_ms": times, "lines_s": dt, "lines_ok": ok, "backend": backend}
    finally:
        shutil.rmtree(prefix, ignore_errors=True)
        os.environ.pop("JUPYTER_PATH", None)


def bench_ipyparallel(ranks: int, repeat: int) -> dict[str, Any]:
    km = KernelManager(kernel_name="python3")
    km.start_kernel()
    c = Client(km)
    try:
        c.run("import ipyparallel as ipp")
        dt, status, text = c.run(f"cluster = ipp.Cluster(n={ranks}, log_level=40)\n"
                                 "rc = cluster.start_and_connect_sync(activate=True)\nrc.wait_for_engines("
                                 f"{ranks}, timeout=120)\nrc[:].execute('pass', block=True)\nNone")
        assert status == "ok", text
        startup = dt
        c.run("rc[:].scatter('rank', list(range(len(rc))), flatten=True, block=True)")
        times = empty_cells(c, "%px pass", repeat)
        dt, status, text = c.run(f"%px for i in range({LINES}): print(f'r{{rank}} {{i}}')")
        ok = status == "ok" and check_lines(text, LINES, ranks, r"r(\d+) (\d+)")
        c.run("cluster.stop_cluster_sync()")
        return {"startup_s": startup, "empty_ms": times, "lines_s": dt, "lines_ok": ok}
    finally:
        c.close()


def summary(r: dict[str, Any]) -> dict[str, Any]:
    t = sorted(r["empty_ms"])
    return {**{k: v for k, v in r.items() if k != "empty_ms"}, "empty_median_ms": statistics.median(t),
            "empty_p90_ms": t[int(0.9 * (len(t) - 1))], "empty_min_ms": t[0]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--repeat", type=int, default=50)
    p.add_argument("--skip-ipyparallel", action="store_true")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "kernel_latency.json"))
    args = p.parse_args()
    rows = []
    for n in args.ranks:
        sk = summary(bench_superkernel(n, args.repeat))
        rows.append({"system": f"superkernel ({sk.pop('backend')})", "ranks": n, **sk})
        print(f"superkernel {n} ranks: {sk}", file=sys.stderr, flush=True)
        if not args.skip_ipyparallel:
            ip = summary(bench_ipyparallel(n, args.repeat))
            rows.append({"system": "ipyparallel %px", "ranks": n, **ip})
            print(f"ipyparallel {n} engines: {ip}", file=sys.stderr, flush=True)
    head = f"{'system':<24}{'ranks':>6}{'start-up s':>12}{'empty p50 ms':>14}{'empty p90 ms':>14}" \
           f"{'10k lines/rank s':>18}{'lines ok':>10}"
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['system']:<24}{r['ranks']:>6}{r['startup_s']:>12.2f}{r['empty_median_ms']:>14.2f}"
              f"{r['empty_p90_ms']:>14.2f}{r['lines_s']:>18.2f}{str(r['lines_ok']):>10}")
    meta = {"host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
            "repeat": args.repeat, "lines_per_rank": LINES, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    try:
        meta["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                        cwd=Path(__file__).resolve().parent).stdout.strip()
    except OSError:
        pass
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
