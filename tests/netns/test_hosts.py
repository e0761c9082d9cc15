"""Tests of the two-host harness (tests/netns/hosts.py): real namespaces, a real 2×2 Gloo job across them."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .hosts import (
    NETNS_ETC,
    NetnsError,
    TwoHosts,
    cleanup_stale,
    parse_rate,
    run_torch_job,
    unavailable_reason,
)

HERE = Path(__file__).resolve().parent
_REASON = unavailable_reason()
needs_netns = pytest.mark.skipif(_REASON is not None, reason=f"two-host tests skipped: {_REASON}")


def _netns_names() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def test_parse_rate() -> None:
    assert parse_rate("1gbit") == 10**9
    assert parse_rate("10Gbit") == 10**10
    assert parse_rate("100mbit") == 10**8
    assert parse_rate("2.5gbit") == 25 * 10**8
    with pytest.raises(ValueError, match="expected a number"):
        parse_rate("fast")


def test_private_subnet_and_valid_rate_required() -> None:
    with pytest.raises(ValueError, match="private /24"):
        TwoHosts(subnet="8.8.8")
    with pytest.raises(ValueError, match="rate"):
        TwoHosts(rate="1 gigabit")


@needs_netns
@pytest.mark.netns
def test_hosts_exist_resolve_each_other_and_vanish() -> None:
    with TwoHosts() as hosts:
        a, b = hosts.hosts
        assert {a.netns, b.netns} <= _netns_names()
        r = a.run(["sh", "-c", f"hostname; getent hosts {b.hostname}; cat /sys/class/net/eth0/operstate"],
                  timeout=30, check=True)
        name, resolved, state = r.stdout.splitlines()
        assert name == a.hostname != b.hostname
        assert resolved.split()[0] == b.address
        assert state == "up"
        # Only loopback and the veth exist in a host: no route to anything else.
        links = a.run(["ip", "-o", "link", "show"], timeout=30, check=True).stdout
        assert [line.split(":")[1].strip().split("@")[0] for line in links.splitlines()] == ["lo", "eth0"]
    names = _netns_names()
    assert a.netns not in names and b.netns not in names
    assert not (NETNS_ETC / a.netns).exists() and not (NETNS_ETC / b.netns).exists()


@needs_netns
@pytest.mark.netns
def test_each_host_has_its_own_dev_shm() -> None:
    with TwoHosts() as hosts:
        a, b = hosts.hosts
        segment = f"sk-test-{os.getpid()}"
        a.run(["sh", "-c", f"echo data > /dev/shm/{segment}"], timeout=30, check=True)
        # Seen by a later command on host a, not by host b, not in the machine's /dev/shm itself.
        assert a.run(["cat", f"/dev/shm/{segment}"], timeout=30, check=True).stdout == "data\n"
        assert b.run(["test", "-e", f"/dev/shm/{segment}"], timeout=30).returncode != 0
        assert not Path("/dev/shm", segment).exists()
        assert a.shm_dir is not None and (a.shm_dir / segment).exists()
    assert not a.shm_dir.exists() and b.shm_dir is not None and not b.shm_dir.exists()


@needs_netns
@pytest.mark.netns
def test_cleanup_after_failure_inside_the_block() -> None:
    with pytest.raises(RuntimeError, match="boom"):
        with TwoHosts() as hosts:
            a, b = hosts.hosts
            raise RuntimeError("boom")
    assert not ({a.netns, b.netns} & _netns_names())


@needs_netns
@pytest.mark.netns
def test_stale_namespaces_of_dead_processes_are_removed() -> None:
    dead = subprocess.Popen(["true"])
    dead.wait(timeout=30)
    name = f"sk-{dead.pid}-0-a"
    subprocess.run(["ip", "netns", "add", name], check=True, timeout=30)
    try:
        assert name in cleanup_stale()
        assert name not in _netns_names()
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)


@needs_netns
@pytest.mark.netns
@pytest.mark.slow
@pytest.mark.parametrize("rdzv", ["static", "c10d"])
def test_gloo_allreduce_2x2_across_hosts(rdzv: str) -> None:
    with TwoHosts() as hosts:
        before = hosts.a.link_bytes()
        results = run_torch_job(hosts, str(HERE / "allreduce_job.py"), ["--backend", "gloo", "--mib", "4"],
                                nproc_per_host=2, timeout=180, rdzv=rdzv)
        after = hosts.a.link_bytes()
    for r in results:
        assert not r.timed_out and r.returncode == 0, r.describe()
    lines = [json.loads(line) for r in results for line in r.stdout.splitlines() if line.startswith("{")]
    by_rank = {d["rank"]: d for d in lines}
    assert sorted(by_rank) == [0, 1, 2, 3], "\n".join(r.describe() for r in results)
    # static: host a is node 0; c10d: either host may be node 0, but each node holds two consecutive ranks.
    first, second = ((hosts.a.hostname, hosts.b.hostname) if rdzv == "static" or by_rank[0]["hostname"] ==
                     hosts.a.hostname else (hosts.b.hostname, hosts.a.hostname))
    for rank, d in by_rank.items():
        assert d["world_size"] == 4
        assert d["ok"], d
        assert d["small"] == [10.0, 10.0]
        assert d["large_min"] == d["large_max"] == 10.0
        assert d["hostname"] == (first if rank < 2 else second)
        assert d["hosts"] == [first] * 2 + [second] * 2
    # The 4 MiB allreduce between the hosts went through the veth pair, both ways.
    rx, tx = after[0] - before[0], after[1] - before[1]
    assert rx > 2 << 20 and tx > 2 << 20, (rx, tx)


@needs_netns
@pytest.mark.netns
def test_timeout_kills_the_whole_tree() -> None:
    # The child starts a grandchild in a session of its own (as torchrun does with its workers).
    code = ("import subprocess, sys, time; "
            "p = subprocess.Popen(['sleep', '1000'], start_new_session=True); "
            "print(p.pid, flush=True); time.sleep(1000)")
    with TwoHosts() as hosts:
        t0 = time.monotonic()
        results = hosts.run_parallel([(h, [sys.executable, "-c", code], None) for h in hosts.hosts], timeout=3)
        elapsed = time.monotonic() - t0
    assert elapsed < 20
    for r in results:
        assert r.timed_out and r.returncode is None
        grandchild = int(r.stdout.split()[0])
        assert not _alive(grandchild), f"grandchild {grandchild} survived the timeout"


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def _rate_through(rate: str, nbytes: int, idle: float) -> float:
    """Bits per second of `nbytes` sent from host a to host b over a link shaped to `rate`: the receiver waits
    `idle` seconds after the connection is up, then asks for the bytes and times them from its request."""
    receiver = ("import socket, time; s = socket.create_server(('0.0.0.0', 5201)); print('ready', flush=True); "
                f"c, _ = s.accept(); time.sleep({idle}); t0 = time.monotonic(); c.sendall(b'g'); n = 0\n"
                "while True:\n    d = c.recv(1 << 20)\n    if not d: break\n    n += len(d)\n"
                "print(n, time.monotonic() - t0, flush=True)")
    with TwoHosts(rate=rate) as hosts:
        a, b = hosts.hosts
        sink = hosts.spawn(b, [sys.executable, "-c", receiver], None, subprocess.PIPE, subprocess.PIPE)
        assert sink.stdout is not None
        assert sink.stdout.readline().decode().strip() == "ready"
        sender = (f"import socket; c = socket.create_connection(('{b.address}', 5201), timeout=30); "
                  f"assert c.recv(1) == b'g'; c.sendall(b'x' * {nbytes}); c.close()")
        a.run([sys.executable, "-c", sender], timeout=60, check=True)
        out, err = sink.communicate(timeout=60)
    got, seconds = out.decode().split()
    assert int(got) == nbytes, err
    return nbytes * 8 / float(seconds)


@needs_netns
@pytest.mark.netns
def test_tbf_limits_the_link_rate() -> None:
    rate_bps = _rate_through("100mbit", 6 << 20, idle=0.0)
    # Unshaped, a veth moves several Gbit/s; shaped to 100 Mbit/s it must stay near that (burst allowance).
    assert rate_bps < 1.5e8, f"{rate_bps / 1e6:.0f} Mbit/s through a 100 Mbit/s tbf"


@needs_netns
@pytest.mark.netns
def test_idle_link_does_not_burst_beyond_its_rate() -> None:
    """After an idle spell tbf's main bucket is full (4 ms of traffic, 500 KB at 1 Gbit/s); the peak rate keeps
    that from crossing at memory speed. 768 KiB asked for after 50 ms of idle link take about 6 ms at
    1 Gbit/s, where the full bucket alone would let them arrive in ~2.3 ms."""
    rate_bps = _rate_through("1gbit", 768 << 10, idle=0.05)
    assert rate_bps < 1.5e9, f"{rate_bps / 1e9:.2f} Gbit/s through a 1 Gbit/s tbf after an idle spell"


def test_not_root_reason_is_clear(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    reason = unavailable_reason()
    assert reason is not None and "root" in reason
    with pytest.raises(NetnsError, match="root"):
        with TwoHosts():
            pass

