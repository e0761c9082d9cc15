"""Signed kernel<->worker channels: a message with a wrong HMAC is dropped and logged, and no code runs."""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import time

import zmq

from superkernel.protocol import KernelChannels, make_session, rank_identity


def test_forged_event_to_the_kernel_is_dropped_and_logged(caplog):
    ch = KernelChannels()
    try:
        ctx = zmq.Context.instance()
        push = ctx.socket(zmq.PUSH)
        push.connect(ch.info.events)
        forged = make_session("not-the-key", "rank-0")
        good = make_session(ch.key, "rank-0")
        with caplog.at_level(logging.WARNING, logger="superkernel.protocol"):
            forged.send(push, "execute_reply", {"status": "ok"})
            assert ch.recv(timeout=2.0) is None
        assert ch.dropped == 1
        assert "dropped" in caplog.text and "Signature" in caplog.text
        good.send(push, "execute_reply", {"status": "ok"})
        ev = ch.recv(timeout=2.0)
        assert ev is not None and ev.rank == 0 and ev.msg_type == "execute_reply"
        push.close(0)
    finally:
        ch.close()


def test_worker_drops_a_request_with_a_wrong_signature_and_runs_no_code(tmp_path):
    """A real worker process (plain flavour) against channels the test holds."""
    ch = KernelChannels()
    conn = tmp_path / "connection.json"
    ch.info.write(str(conn))
    assert oct(os.stat(conn).st_mode & 0o777) == "0o600"
    env = dict(os.environ, SUPERKERNEL_FRONTEND="1", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    env.pop("PYTEST_CURRENT_TEST", None)
    proc = subprocess.Popen([sys.executable, "-m", "superkernel.worker", "--connection-file", str(conn),
                             "--flavor", "plain"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    marker = tmp_path / "ran"
    try:
        deadline = time.monotonic() + 60
        hello = None
        while hello is None and time.monotonic() < deadline:
            ev = ch.recv(timeout=0.5)
            if ev is not None and ev.msg_type == "hello":
                hello = ev
        assert hello is not None, "worker did not say hello"
        code = f"open({str(marker)!r}, 'w').write('x')"
        # same socket, same routing id, wrong key: must be dropped
        ch.session = make_session("wrong-key", "kernel")
        ch.send(0, "execute_request", {"code": code, "execution_count": 1})
        time.sleep(1.0)
        assert not marker.exists()
        # the right key: runs
        ch.session = make_session(ch.key, "kernel")
        ch.send(0, "execute_request", {"code": code, "execution_count": 1})
        deadline = time.monotonic() + 10
        reply = None
        while reply is None and time.monotonic() < deadline:
            ev = ch.recv(timeout=0.5)
            if ev is not None and ev.msg_type == "execute_reply":
                reply = ev
        assert reply is not None and reply.msg["content"]["status"] == "ok"
        assert marker.exists()
        ch.send(0, "shutdown_request", {})
        out, _ = proc.communicate(timeout=10)
        assert b"Channel dropped a request on rank 0" in out and b"Invalid Signature" in out
    finally:
        if proc.poll() is None:
            proc.kill()
        ch.close()


def test_rank_identity():
    assert rank_identity(3) == b"rank-3"
