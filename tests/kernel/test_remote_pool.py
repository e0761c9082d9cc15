"""A kernel whose pool spans two hosts (two network namespaces joined by a veth pair): the kernel starts
its own host's node of a torchrun job with a c10d rendezvous and writes a join file; ``superkernel join``
on the other host starts the rest. Cells run on all four ranks, collectives cross the hosts, interrupts
reach the remote ranks, and when the kernel is SIGKILLed the remote ranks notice (no pid to watch there:
the kernel's pings stop) and exit."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.netns.hosts import TwoHosts, job_env, kill_tree, unavailable_reason

REASON = unavailable_reason()
HERE = Path(__file__).resolve().parent


def _workers() -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if "superkernel.worker" in cmd and "sk-remote" not in cmd:
            out.append(p)
    return out


@pytest.mark.skipif(REASON is not None, reason=f"two namespace hosts unavailable: {REASON}")
def test_pool_across_two_hosts(tmp_path: Path) -> None:
    join_file = tmp_path / "join.json"
    before = {p.pid for p in _workers()}
    with TwoHosts() as hosts:
        a, b = hosts.a, hosts.b
        out_a, out_b = open(tmp_path / "a.out", "w+"), open(tmp_path / "b.out", "w+")
        client = hosts.spawn(a, [sys.executable, str(HERE / "remote_pool_client.py"), str(join_file), a.address,
                                 "29431"], job_env(a), out_a, subprocess.STDOUT)
        deadline = time.monotonic() + 90
        while not join_file.exists():
            assert client.poll() is None, f"client exited early:\n{Path(out_a.name).read_text()[-4000:]}"
            assert time.monotonic() < deadline, "the kernel wrote no join file"
            time.sleep(0.1)
        assert join_file.stat().st_mode & 0o077 == 0, "the join file holds the pool's key: it must be 0600"
        joiner = hosts.spawn(b, [sys.executable, "-m", "superkernel", "join", str(join_file)],
                             job_env(b, {"SUPERKERNEL_KERNEL_SILENCE": "4"}), out_b, subprocess.STDOUT)
        try:
            client.wait(timeout=300)
        except subprocess.TimeoutExpired:
            kill_tree(client)
        text_a = Path(out_a.name).read_text()
        reports = [json.loads(line[7:]) for line in text_a.splitlines() if line.startswith("REPORT ")]
        assert reports, f"client:\n{text_a[-6000:]}\n--- joiner:\n{Path(out_b.name).read_text()[-4000:]}"
        rep = reports[0]
        t0 = time.monotonic()
        try:
            code = joiner.wait(timeout=40)
        except subprocess.TimeoutExpired:
            kill_tree(joiner)
            code = None
        gone_after = time.monotonic() - t0
        text_b = Path(out_b.name).read_text()

    first = rep["first"]
    assert first["status"] == "ok", first
    assert "superkernel join" in first["stderr"]  # the kernel told the user how to bring the other hosts in
    hosts_seen = {}
    for line in first["stdout"].splitlines():
        m = re.match(r"\[ranks ([\d,\-]+)\] (\S+) 4$", line)
        assert m, f"unexpected line {line!r} in {first['stdout']!r}"
        hosts_seen[m.group(2)] = m.group(1)
    # torchrun's c10d rendezvous numbers the nodes in order of arrival: two ranks per host either way
    assert set(hosts_seen) == {a.hostname, b.hostname} and set(hosts_seen.values()) == {"0,1", "2,3"}, hosts_seen
    assert rep["allreduce"]["status"] == "ok" and "[ranks 0-3] [10.0, 10.0, 10.0]" in rep["allreduce"]["stdout"]
    info = rep["info"]["stdout"]
    assert info.count("tcp") >= 2 and "shm" in info, info
    assert rep["interrupt"]["enames"] == ["KeyboardInterrupt"] and rep["interrupt"]["seconds"] < 5, rep["interrupt"]
    assert rep["after_interrupt"]["status"] == "ok", rep["after_interrupt"]
    # SIGKILLed kernel: the joined host's ranks stop hearing its pings and exit; so does `superkernel join`
    assert code is not None, f"superkernel join still running 40 s after the kernel died:\n{text_b[-4000:]}"
    assert gone_after < 30, gone_after
    leftover = [p for p in _workers() if p.pid not in before]
    for p in leftover:
        p.kill()
    assert not leftover, [" ".join(p.cmdline()) for p in leftover]
