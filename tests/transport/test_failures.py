"""Bad input and broken peers give clear errors on every rank, within the timeout, never a hang; nothing
is left behind after kill -9 (no /dev/shm segment, no listening socket of mk)."""
from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest

from tests.transport.world import collect, run_world, start_world

TRANSPORTS = ["shm", "tcp"]


def events(results) -> list[dict[str, dict]]:
    return [{e["op"]: e for e in r.report()["events"]} for r in results]


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_mismatched_calls_fail_on_every_rank(transport: str) -> None:
    res = run_world(2, "failure_suite.py", ["mismatch"], timeout=120, env={"SUPERKERNEL_TRANSPORT": transport})
    ev = events(res)
    for r, e in enumerate(ev):
        assert not e["size"]["ok"], f"rank {r}: mismatched sizes did not raise"
        assert "rank" in e["size"]["error"] and e["size"]["secs"] < 10, e["size"]
        assert re.search(r"disagree|called|expected", e["size"]["error"]), e["size"]["error"]
    if transport == "shm":
        # every rank saw the mismatch at the same step: the group stays usable
        for r, e in enumerate(ev):
            assert not e["dtype"]["ok"] and "int32" in e["dtype"]["error"] and "float32" in e["dtype"]["error"]
            assert not e["split"]["ok"] and "split sizes" in e["split"]["error"], e["split"]
            assert e["after"]["ok"], f"rank {r}: group unusable after a detected mismatch: {e['after']}"
    else:
        # across hosts the communicator is aborted, and says so
        for r, e in enumerate(ev):
            assert not e["after"]["ok"] and "abort" in e["after"]["error"], e["after"]


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_bad_arguments_raise_locally_and_leave_group_usable(transport: str) -> None:
    res = run_world(3, "failure_suite.py", ["bad_args"], timeout=120, env={"SUPERKERNEL_TRANSPORT": transport})
    for r, e in enumerate(events(res)):
        for op, needle in [("root", "invalid root"), ("allgather_outputs", "output tensors"),
                           ("allgather_shape", "elements"), ("send_rank", "invalid peer rank"), ("tag", "tag"),
                           ("split", "split sizes"), ("bitwise_float", "BAND")]:
            assert not e[op]["ok"], f"rank {r}: {op} did not raise"
            assert needle in e[op]["error"] and f"rank {r}" in e[op]["error"], (op, e[op]["error"])
        assert e["after"]["ok"], e["after"]


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_peer_exit_is_reported_quickly(transport: str) -> None:
    res = run_world(3, "failure_suite.py", ["peer_exit"], timeout=120,
                    env={"SUPERKERNEL_TRANSPORT": transport, "SUITE_TIMEOUT": "60"})
    assert res[2].returncode == 3
    for r in (0, 1):
        e = events(res[:2])[r]
        assert not e["allreduce"]["ok"], f"rank {r} did not notice that rank 2 exited"
        # found by watching the peer, not by running into the 60 s timeout
        assert e["allreduce"]["secs"] < 15, e["allreduce"]
        assert not e["again"]["ok"] and e["again"]["secs"] < 5, e["again"]
    msgs = " | ".join(events(res[:2])[r]["allreduce"]["error"] for r in (0, 1))
    assert "peer 2" in msgs or "aborted" in msgs, msgs


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_messages_sent_before_a_peer_exits_are_delivered(transport: str) -> None:
    """A sender that leaves right after its sends complete (they complete when the transport has the data,
    not when the receiver has it): what it sent still arrives whole, then a receive from it fails promptly.
    Over tcp, 4 sockets per peer: the last message, striped over them, was lost on 8 of 8 runs when the first
    socket's end of file failed the peer while the others still carried data."""
    res = run_world(2, "failure_suite.py", ["send_then_exit"], timeout=120,
                    env={"SUPERKERNEL_TRANSPORT": transport, "SUITE_TIMEOUT": "30", "SUPERKERNEL_TCP_SOCKETS": "4"})
    assert res[1].returncode == 0, res[1].stderr[-2000:]
    e = events(res[:1])[0]
    for n in (4, 300_000, 1_100_000, 4_500_001):
        assert e[f"recv{n}"]["ok"], e[f"recv{n}"]
    assert not e["after"]["ok"] and "peer 1" in e["after"]["error"] and e["after"]["secs"] < 5, e["after"]


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_peer_that_aborted_is_reported_to_a_rank_that_did_not(transport: str) -> None:
    """A rank that aborted its communicator (an interrupt, a timeout) while its peer waits for it: the
    peer's receive fails within a progress check, as does every later use, and says the peer aborted. On
    one host the waiting receive hung until the group timeout (shm told only ranks inside a collective)."""
    res = run_world(2, "failure_suite.py", ["peer_abort"], timeout=120,
                    env={"SUPERKERNEL_TRANSPORT": transport, "SUITE_TIMEOUT": "60"})
    e0, e1 = events(res)
    assert e0["abort"]["ok"], e0
    # rank 1 waited about 1 s for rank 0, which then aborted: it is told within a check, not at the timeout
    assert not e1["recv_waiting"]["ok"] and e1["recv_waiting"]["secs"] < 5, e1["recv_waiting"]
    for op in ("recv_waiting", "recv_after", "send_after", "allreduce_after", "get_after"):
        assert not e1[op]["ok"], (op, e1[op])
        assert "rank 1" in e1[op]["error"] and e1[op]["secs"] < 5, (op, e1[op])
        assert re.search(r"abort|peer 0|rank 0", e1[op]["error"]), (op, e1[op])
    # the peer's abort (its shm flag, or an ABORT frame over tcp) says that it aborted, and why
    for op in ("recv_waiting", "recv_after", "send_after", "allreduce_after", "get_after"):
        assert re.search(r"peer 0 (\(\S+\) )?aborted its communicator \(rank 0 aborted the process group\)",
                         e1[op]["error"]), (op, e1[op])


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_rank_that_timed_out_tells_its_peers_why(transport: str) -> None:
    """Rank 0's all_reduce times out waiting for rank 1, which sits in a receive from rank 0 (a program whose
    ranks disagree): rank 1's receive fails at once with rank 0's own error, which names the rank it waited
    for and the op, where it said only that rank 0 closed its connections or aborted."""
    res = run_world(2, "failure_suite.py", ["timeout_reason"], timeout=120,
                    env={"SUPERKERNEL_TRANSPORT": transport, "SUITE_TIMEOUT": "60"},
                    per_rank_env={0: {"SUITE_TIMEOUT": "2"}})
    e0, e1 = events(res)
    assert not e0["allreduce"]["ok"] and "timed out" in e0["allreduce"]["error"], e0
    # rank 0's reason: its error's text from the op's name on (the exception type and "rank 0: " aside)
    reason = re.search(r"mk allreduce.*", e0["allreduce"]["error"])
    assert reason and "rank 0" in reason.group(0) and "peer 1" in reason.group(0), e0
    for op in ("recv", "recv_after"):
        err = e1[op]["error"]
        assert not e1[op]["ok"] and e1[op]["secs"] < 5, (op, e1[op])
        assert "peer 0" in err and "aborted its communicator" in err and reason.group(0) in err, (op, err, reason.group(0))


def test_the_abort_reason_is_found_behind_a_connection_cut_mid_frame() -> None:
    """Over tcp the ABORT frame goes only on a socket between frames: a rank that aborts in the middle of a
    large put leaves that socket to end mid-frame, and its peer may read that end before the ABORT frame on
    the other socket (the sockets' events come in no fixed order; a stopped rank, resumed, meets them
    together). It is then told why all the same, not that the connection closed in the middle of a frame."""
    res = run_world(2, "failure_suite.py", ["abort_mid_frame"], timeout=120,
                    env={"SUPERKERNEL_TRANSPORT": "tcp", "SUITE_TIMEOUT": "60"})
    e0, e1 = events(res)
    assert e0["abort"]["ok"] and not e0["put"]["ok"] and "abort" in e0["put"]["error"], e0
    err = e1["recv"]["error"]
    assert not e1["recv"]["ok"] and e1["recv"]["secs"] < 10, e1
    assert re.search(r"peer 0 \(\S+\) aborted its communicator \(rank 0 aborted the process group\)", err), err


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_group_timeout_is_honoured(transport: str) -> None:
    res = run_world(2, "failure_suite.py", ["timeout"], timeout=120,
                    env={"SUPERKERNEL_TRANSPORT": transport, "SUITE_TIMEOUT": "3"})
    e0 = events(res)[0]["allreduce"]
    assert not e0["ok"] and "rank 0 timed out waiting for peer 1" in e0["error"], e0
    assert 2.5 < e0["secs"] < 10, e0
    # Rank 1 arrives late: it may still finish the allreduce rank 0 contributed to (with the right sum), but
    # the group is aborted from then on and both ranks are told so promptly.
    e1 = events(res)[1]["allreduce"]
    assert not e1["ok"] or e1["value"] == 2.0, e1
    for r in (0, 1):
        nxt = events(res)[r]["next"]
        assert not nxt["ok"] and "abort" in nxt["error"] and nxt["secs"] < 5, (r, nxt)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_recv_without_sender_times_out(transport: str) -> None:
    res = run_world(2, "failure_suite.py", ["recv_timeout"], timeout=60,
                    env={"SUPERKERNEL_TRANSPORT": transport, "SUITE_TIMEOUT": "3"})
    e = events(res)[0]["recv"]
    assert not e["ok"] and "timed out" in e["error"] and 2.5 < e["secs"] < 10, e


def listening_inodes() -> set[str]:
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except FileNotFoundError:
            continue
        for line in lines:
            f = line.split()
            if f[3] == "0A":
                inodes.add(f[9])
    return inodes


def socket_inodes(pid: int) -> set[str]:
    out = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            out.add(target[8:-1])
    return out


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_kill9_leaves_nothing_behind(transport: str) -> None:
    shm_before = set(os.listdir("/dev/shm"))
    procs = start_world(2, "failure_suite.py", ["kill9"], env={"SUPERKERNEL_TRANSPORT": transport})
    # wait for both ranks to be connected
    ready = 0
    deadline = time.monotonic() + 60
    lines: list[str] = []
    while ready < 2 and time.monotonic() < deadline:
        for p in procs:
            line = p.stdout.readline()
            lines.append(line)
            ready += line.startswith("READY")
    assert ready == 2, lines
    # mk's own listener is closed once connected: rank 1 (not hosting torch's TCPStore) listens on nothing
    assert not (socket_inodes(procs[1].pid) & listening_inodes()), "rank 1 still has a listening socket"
    os.kill(procs[1].pid, signal.SIGKILL)
    killed_at = time.time()
    res = collect(procs, timeout=60)
    ev = res[0].report()["events"]
    assert ev and not ev[0]["ok"], "rank 0 never noticed rank 1's death"
    assert ev[0]["at"] - killed_at < 5, f"noticed after {ev[0]['at'] - killed_at:.1f}s"
    assert "peer 1" in ev[0]["error"] or "rank 1" in ev[0]["error"], ev[0]["error"]
    assert set(os.listdir("/dev/shm")) - shm_before == set(), "shared memory left in /dev/shm"


def test_tcp_connection_without_the_job_secret_is_rejected_and_logged() -> None:
    import socket
    import struct

    procs = start_world(2, "failure_suite.py", ["handshake"],
                        env={"SUPERKERNEL_TRANSPORT": "tcp", "SUITE_TIMEOUT": "60"},
                        per_rank_env={1: {"SUPERKERNEL_TEST_CONNECT_DELAY_MS": "6000"}})
    # rank 0 reaches the bootstrap first and listens for rank 1: find that listener (not torch's store)
    ports: set[int] = set()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not ports:
        inodes = socket_inodes(procs[0].pid)
        for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
            f = line.split()
            port = int(f[1].split(":")[1], 16)
            if f[3] == "0A" and f[9] in inodes and port != procs[0].master_port:
                ports.add(port)
        if not ports:
            time.sleep(0.2)
    assert len(ports) == 1, f"rank 0 listens on {ports} besides torch's store"
    for port in ports:
        # a stranger with the right protocol magic and version (3: the ABORT frame) but the wrong secret, and garbage
        for payload in (struct.pack("<IHHii32s", 0x4D4B5431, 3, 0, 1, 2, b"x" * 32), b"GET / HTTP/1.0\r\n\r\n" * 4):
            with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
                s.sendall(payload)
                s.settimeout(5)
                try:
                    data = s.recv(64)
                except (TimeoutError, ConnectionResetError):
                    data = b""
                assert data == b"", f"port {port} answered a stranger: {data!r}"
    res = collect(procs, timeout=120)
    for r in res:
        ev = {e["op"]: e for e in r.report()["events"]}
        assert ev["allreduce"]["ok"], ev["allreduce"]
    assert "rejected a connection" in res[0].stderr and "wrong job secret" in res[0].stderr, res[0].stderr[-2000:]
