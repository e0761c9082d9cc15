"""Kernel <-> worker messages: pyzmq sockets carrying ``jupyter_client.Session`` (HMAC-signed) messages.

Topology (one pool):

* kernel binds a ROUTER (``requests``): every worker connects two DEALERs, ``rank-<r>`` (read by its main
  thread: execute, complete, inspect, push, pull) and ``rank-<r>-control`` (read by its control thread:
  interrupt and shutdown, which must arrive while a cell runs).
* kernel binds a PULL (``events``): every worker connects a PUSH and sends *everything* it has to say
  (hello, heartbeats, streams, display data, results, replies) through ipykernel's IOPubThread, so one
  rank's output always arrives before that rank's reply.

Both directions are signed with the pool's key through ``Session``; a message whose signature does not
verify is dropped and logged (``Channel dropped ...``), never acted on. For a local pool both sockets are
bound to 127.0.0.1 only. The key and addresses reach the workers in a 0600 connection file.
"""
from __future__ import annotations

import json
import logging
import os
import secrets
import socket
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from typing import Any

import zmq
from jupyter_client.session import Session

__all__ = ["ConnectionInfo", "make_session", "rank_identity", "KernelChannels", "WorkerChannels", "Event"]

log = logging.getLogger("superkernel.protocol")

SIGNATURE_SCHEME = "hmac-sha256"

# written into a rank's stdout/stderr fd to find out when the fd watcher has forwarded everything before it
SYNC = "\x00superkernel-sync\x00"


@dataclass
class ConnectionInfo:
    """What a worker needs to reach its kernel. Written to a 0600 JSON file handed to the launcher."""

    requests: str
    events: str
    key: str
    pool_id: str
    kernel_pid: int
    kernel_host: str
    signature_scheme: str = SIGNATURE_SCHEME

    def write(self, path: str) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(asdict(self), f)

    @classmethod
    def read(cls, path: str) -> "ConnectionInfo":
        with open(path) as f:
            return cls(**json.load(f))


def make_session(key: str, username: str) -> Session:
    """A signing Session; ``username`` names the sender (``kernel`` or ``rank-<r>``)."""
    return Session(key=key.encode(), signature_scheme=SIGNATURE_SCHEME, username=username)


CONTROL_TYPES = frozenset({"interrupt_request", "shutdown_request", "ping"})


def rank_identity(rank: int, control: bool = False) -> bytes:
    return f"rank-{rank}-control".encode() if control else f"rank-{rank}".encode()


def sender_rank(msg: dict[str, Any]) -> int | None:
    """The rank named in a verified message's header (``username`` ``rank-<r>``)."""
    user = msg.get("header", {}).get("username", "")
    if user.startswith("rank-"):
        try:
            return int(user[5:])
        except ValueError:
            return None
    return None


@dataclass
class Event:
    """A verified message from a worker."""

    rank: int
    msg: dict[str, Any]

    @property
    def msg_type(self) -> str:
        return self.msg["header"]["msg_type"]

    @property
    def parent_id(self) -> str | None:
        return self.msg.get("parent_header", {}).get("msg_id")


class KernelChannels:
    """The kernel's end: bind ROUTER + PULL, send signed requests, receive verified events."""

    def __init__(self, bind_ip: str = "127.0.0.1", key: str | None = None) -> None:
        self.key = key or secrets.token_hex(32)
        self.pool_id = uuid.uuid4().hex[:12]
        self.session = make_session(self.key, "kernel")
        self.context = zmq.Context()
        self._router = self.context.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._router.linger = 0
        self._router.sndtimeo = 1000
        port = self._router.bind_to_random_port(f"tcp://{bind_ip}")
        self._pull = self.context.socket(zmq.PULL)
        self._pull.linger = 0
        pull_port = self._pull.bind_to_random_port(f"tcp://{bind_ip}")
        connect_ip = bind_ip if bind_ip not in ("0.0.0.0", "*") else socket.gethostbyname(socket.gethostname())
        self.info = ConnectionInfo(
            requests=f"tcp://{connect_ip}:{port}",
            events=f"tcp://{connect_ip}:{pull_port}",
            key=self.key,
            pool_id=self.pool_id,
            kernel_pid=os.getpid(),
            kernel_host=socket.gethostname(),
        )
        self._send_lock = threading.Lock()
        self.dropped = 0

    def send(
        self,
        rank: int,
        msg_type: str,
        content: dict[str, Any],
        *,
        buffers: list[bytes] | None = None,
        msg_id: str | None = None,
        timeout: float = 2.0,
    ) -> dict[str, Any]:
        """Send a signed request to one rank; retries while the rank's DEALER is still connecting."""
        msg = self.session.msg(msg_type, content)
        if msg_id:
            msg["header"]["msg_id"] = msg_id
            msg["msg_id"] = msg_id
        deadline = _now() + timeout
        while True:
            try:
                with self._send_lock:
                    self.session.send(self._router, msg, ident=rank_identity(rank, msg_type in CONTROL_TYPES),
                                      buffers=buffers)
                return msg
            except zmq.ZMQError as e:
                if e.errno != zmq.EHOSTUNREACH or _now() > deadline:
                    raise ConnectionError(f"cannot reach rank {rank} for {msg_type}: {e}") from e
                threading.Event().wait(0.005)

    def recv(self, timeout: float) -> Event | None:
        """Next verified event, or None after ``timeout`` seconds. Bad signatures are dropped and logged."""
        if not self._pull.poll(int(timeout * 1000)):
            return None
        frames = self._pull.recv_multipart(copy=False)
        return self._verify(frames)

    def recv_nowait(self) -> Event | None:
        try:
            frames = self._pull.recv_multipart(flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return None
        return self._verify(frames)

    def _verify(self, frames: list[Any]) -> Event | None:
        try:
            _idents, rest = self.session.feed_identities(frames, copy=False)
            msg = self.session.deserialize(rest, content=True, copy=False)
        except Exception as e:  # invalid signature, replayed signature, garbage
            self.dropped += 1
            log.warning("Channel dropped a message on the events socket: %s", e)
            return None
        rank = sender_rank(msg)
        if rank is None:
            self.dropped += 1
            log.warning("Channel dropped a message with no rank in its header")
            return None
        msg["buffers"] = [bytes(b) for b in msg.get("buffers", [])]
        return Event(rank, msg)

    def close(self) -> None:
        self._router.close(0)
        self._pull.close(0)
        self.context.term()


class WorkerChannels:
    """A worker's end: two DEALERs for requests (main thread / control thread) and a PUSH for what it says."""

    def __init__(self, info: ConnectionInfo, rank: int) -> None:
        self.info = info
        self.rank = rank
        self.session = make_session(info.key, f"rank-{rank}")
        self.context = zmq.Context()
        self.shell = self._dealer(rank_identity(rank))
        self.control = self._dealer(rank_identity(rank, control=True))
        self.push = self.context.socket(zmq.PUSH)
        self.push.linger = 2000
        self.push.connect(info.events)
        self.dropped = 0

    def _dealer(self, identity: bytes) -> zmq.Socket:
        sock = self.context.socket(zmq.DEALER)
        sock.setsockopt(zmq.ROUTING_ID, identity)
        sock.linger = 0
        sock.connect(self.info.requests)
        return sock

    def recv_request(self, timeout: float, control: bool = False) -> dict[str, Any] | None:
        """Next verified request, or None. Each socket is read by one thread only."""
        sock = self.control if control else self.shell
        if not sock.poll(int(timeout * 1000)):
            return None
        frames = sock.recv_multipart(copy=False)
        try:
            _idents, rest = self.session.feed_identities(frames, copy=False)
            msg = self.session.deserialize(rest, content=True, copy=False)
        except Exception as e:
            self.dropped += 1
            log.warning("Channel dropped a request on rank %d: %s", self.rank, e)
            return None
        msg["buffers"] = [bytes(b) for b in msg.get("buffers", [])]
        return msg


def _now() -> float:
    return time.monotonic()
