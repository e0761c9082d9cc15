"""What a small exchange before gemm_allreduce's unfused composition costs, by the channel it takes (not a test).

torchrun script, meant for two namespace hosts (`python bench/netns.py --rates 10gbit --script
exchange_channel.py -- [options]`). A fused op's argument agreement is one small exchange before the op's own
collectives; on Gloo between the namespace hosts the op with one chunk (that exchange, the product, Gloo's
allreduce) was slower than the unfused product and allreduce by more than the exchange takes alone. This
measures whether the cost is the exchange as such or the exchange going through Gloo: every round runs each
variant once, in an order shuffled per round (the same on every rank), each call after fused_ops.py's
settled_start; a call's time is the slowest rank's. Variants (`e` = 384 bytes to and from every peer, the
size of an agreement descriptor):

* ``unfused``: ``a @ b`` then ``all_reduce`` (the baseline);
* ``gloo-allreduce+unfused``: an 8-element ``all_reduce`` first;
* ``gloo-sendrecv+unfused``: ``e`` through the backend's ``isend``/``irecv`` first (as the agreement sends it);
* ``socket+unfused``: ``e`` through TCP connections of this script's own first (not the backend's; the
  connections are made once, each presenting a random token published through the job's store);
* ``socket-overlap``: ``e`` sent, the product, ``e`` received on the calling thread (it waited in the socket
  meanwhile), the allreduce;
* ``thread+unfused``: the same through a second set of such connections, received by a helper thread (as
  mk's progress thread receives the side channel's messages); the caller waits for the helper's word;
* ``thread-overlap``: ``e`` sent, the product, the helper's word, the allreduce: the fused op's order with one
  chunk, its agreement received off the calling thread, with nothing of the op's own code;
* ``fused-1``: ``gemm_allreduce`` with one chunk (its agreement, the product, the backend's allreduce; once
  the group has armed the folded agreement, csrc/kernels/pipeline.h, no agreement: measure with
  ``SUPERKERNEL_OPS_FOLD=0`` for the agreement's cost);
* ``fused-auto``: ``gemm_allreduce`` with the tuner's chunk count (tuned during the warm-up);
* ``product``, ``allreduce``: the parts alone.

Prints each variant's median and p75 and the median's ratio to unfused; writes JSON to --out-dir.
"""
from __future__ import annotations

import argparse
import hmac
import json
import os
import queue
import secrets
import socket
import statistics
import sys
import threading
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

import superkernel  # noqa: F401  (registers the mk backend and torch.ops.mk.*)
import superkernel.ops as mk

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from fused_ops import interleaved_rounds, settled_start  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
EXCHANGE_BYTES = 384
TOKEN_BYTES = 32
SOCKET_TIMEOUT_S = 60.0  # the longest any wait on the script's own connections takes (a peer gone quiet)


def recv_exact(sock: socket.socket, n: int) -> bytes:
    """n bytes from sock; ConnectionError when the peer closes first, TimeoutError when it stays quiet."""
    buf = bytearray()
    while len(buf) < n:
        try:
            part = sock.recv(n - len(buf))
        except TimeoutError as e:
            raise TimeoutError(f"peer {sock.getpeername()} sent {len(buf)} of {n} bytes "
                               f"in {sock.gettimeout()} s") from e
        if not part:
            raise ConnectionError(f"peer {sock.getpeername()} closed after {len(buf)} of {n} bytes")
        buf += part
    return bytes(buf)


def accept_peer(listener: socket.socket, token: bytes, peers: set[int]) -> tuple[int, socket.socket]:
    """Accept one connection that presents ``token`` and a rank in ``peers``; connections that do not are
    closed and the wait goes on (until the listener's timeout: socket.timeout)."""
    while True:
        conn, addr = listener.accept()
        try:
            conn.settimeout(SOCKET_TIMEOUT_S)
            hello = recv_exact(conn, TOKEN_BYTES + 4)
            rank = int.from_bytes(hello[TOKEN_BYTES:], "little")
            if hmac.compare_digest(hello[:TOKEN_BYTES], token) and rank in peers:
                return rank, conn
            print(f"exchange_channel: refused a connection from {addr} (wrong token or rank {rank})",
                  file=sys.stderr)
        except (OSError, ConnectionError) as e:
            print(f"exchange_channel: dropped a connection from {addr}: {e}", file=sys.stderr)
        conn.close()


def source_address(towards: str) -> str:
    """This host's address on the route to ``towards`` (a UDP socket's connect sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((towards, 9))
        return s.getsockname()[0]


def socket_mesh(store: dist.Store, rank: int, size: int, master_addr: str, name: str = "exchange_channel"
                ) -> dict[int, socket.socket]:
    """One TCP connection to every other rank, outside the backend: each rank listens on its address towards
    the master, lower ranks accept, higher ranks connect and present the job's token (set by rank 0 in the
    store) and their rank. ``name`` keeps the store keys of several meshes apart."""
    if rank == 0:
        store.set(f"{name}/token", secrets.token_bytes(TOKEN_BYTES).hex())
    token = bytes.fromhex(store.get(f"{name}/token").decode())
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind((source_address(master_addr), 0))
    listener.listen(size)
    listener.settimeout(SOCKET_TIMEOUT_S)
    host, port = listener.getsockname()
    store.set(f"{name}/addr/{rank}", f"{host}:{port}")
    conns: dict[int, socket.socket] = {}
    try:
        for q in range(rank):
            qhost, qport = store.get(f"{name}/addr/{q}").decode().rsplit(":", 1)
            c = socket.create_connection((qhost, int(qport)), timeout=SOCKET_TIMEOUT_S)
            c.sendall(token + rank.to_bytes(4, "little"))
            conns[q] = c
        expected = set(range(rank + 1, size))
        while expected:
            q, c = accept_peer(listener, token, expected)
            expected.discard(q)
            conns[q] = c
    finally:
        listener.close()
    for c in conns.values():
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return conns


class Receiver:
    """A helper thread that receives one ``EXCHANGE_BYTES`` message from every peer of ``conns`` per exchange
    and then says so; ``wait()`` takes that word (none within ``SOCKET_TIMEOUT_S``: TimeoutError naming the
    ranks; a connection that ended: ConnectionError naming its rank). The thread ends with a connection."""

    def __init__(self, conns: dict[int, socket.socket]) -> None:
        self._conns = conns
        self._words: queue.Queue[BaseException | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="exchange_channel-receiver", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            for q, c in self._conns.items():
                got = 0
                while got < EXCHANGE_BYTES:
                    try:
                        part = c.recv(EXCHANGE_BYTES - got)
                    except TimeoutError:
                        if got == 0:
                            continue  # idle between exchanges (the caller's wait has its own timeout)
                        part, err = b"", f"quiet for {c.gettimeout()} s after {got} of {EXCHANGE_BYTES} bytes"
                    except OSError as e:
                        part, err = b"", str(e)
                    else:
                        err = f"closed after {got} of {EXCHANGE_BYTES} bytes"
                    if not part:
                        self._words.put(ConnectionError(f"rank {q}'s connection ended: {err}"))
                        return
                    got += len(part)
            self._words.put(None)

    def wait(self) -> None:
        try:
            word = self._words.get(timeout=SOCKET_TIMEOUT_S)
        except queue.Empty:
            raise TimeoutError(f"no exchange from ranks {sorted(self._conns)} within {SOCKET_TIMEOUT_S} s") from None
        if word is not None:
            raise word


def variants(m: int, k: int, n: int, dtype: torch.dtype, conns: dict[int, socket.socket],
             thread_conns: dict[int, socket.socket]) -> dict[str, Callable[[], Any]]:
    R, r = dist.get_world_size(), dist.get_rank()
    a = torch.randn(m, k, generator=torch.Generator().manual_seed(r)).to(dtype)
    b = torch.randn(k, n, generator=torch.Generator().manual_seed(100 + r)).to(dtype)
    out = torch.empty(m, n, dtype=dtype)
    tiny = torch.zeros(8)
    msg = torch.ones(EXCHANGE_BYTES // 4, dtype=torch.int32)
    boxes = {q: torch.empty_like(msg) for q in range(R) if q != r}
    payload = bytes(EXCHANGE_BYTES)

    def unfused() -> torch.Tensor:
        torch.mm(a, b, out=out)
        dist.all_reduce(out)
        return out

    def gloo_allreduce() -> torch.Tensor:
        dist.all_reduce(tiny)
        return unfused()

    def gloo_sendrecv() -> torch.Tensor:
        works = [dist.irecv(box, q) for q, box in boxes.items()] + [dist.isend(msg, q) for q in boxes]
        for w in works:
            w.wait()
        return unfused()

    def socket_exchange() -> torch.Tensor:
        for c in conns.values():
            c.sendall(payload)
        for c in conns.values():
            recv_exact(c, EXCHANGE_BYTES)
        return unfused()

    def socket_overlap() -> torch.Tensor:
        for c in conns.values():
            c.sendall(payload)
        torch.mm(a, b, out=out)
        for c in conns.values():
            recv_exact(c, EXCHANGE_BYTES)
        dist.all_reduce(out)
        return out

    receiver = Receiver(thread_conns)

    def thread_exchange() -> torch.Tensor:
        for c in thread_conns.values():
            c.sendall(payload)
        receiver.wait()
        return unfused()

    def thread_overlap() -> torch.Tensor:
        for c in thread_conns.values():
            c.sendall(payload)
        torch.mm(a, b, out=out)
        receiver.wait()
        dist.all_reduce(out)
        return out

    return {"unfused": unfused, "gloo-allreduce+unfused": gloo_allreduce, "gloo-sendrecv+unfused": gloo_sendrecv,
            "socket+unfused": socket_exchange, "socket-overlap": socket_overlap, "thread+unfused": thread_exchange,
            "thread-overlap": thread_overlap,
            "fused-1": lambda: mk.gemm_allreduce(a, b, chunks=1),
            "fused-auto": lambda: mk.gemm_allreduce(a, b), "product": lambda: torch.mm(a, b, out=out),
            "allreduce": lambda: dist.all_reduce(out)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="gloo")
    ap.add_argument("--shape", default="1024x768x1024", help="m x k x n per rank (a: [m, k], b: [k, n])")
    ap.add_argument("--dtype", default="bfloat16", choices=list(DTYPES))
    ap.add_argument("--rounds", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=40, help="calls of each variant first (the tuner decides then)")
    ap.add_argument("--settle-ms", type=float, default=10.0, help="busy settle before each call (settled_start)")
    ap.add_argument("--pin", action="store_true", help="pin each rank to one CPU, as fused_ops.py --pin")
    ap.add_argument("--out-dir", default=str(HERE / "results"))
    ap.add_argument("--tag", default="")
    ap.add_argument("--hosts-desc", default="")
    args = ap.parse_args()
    if args.rounds < 2:
        ap.error(f"--rounds must be at least 2 (a median and a p75), got {args.rounds}")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    if args.pin:
        cpus = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpus[int(os.environ["RANK"]) % len(cpus)]})
    dist.init_process_group(args.backend)
    R, r = dist.get_world_size(), dist.get_rank()
    store = dist.distributed_c10d._get_default_store()
    conns = socket_mesh(store, r, R, os.environ["MASTER_ADDR"])
    thread_conns = socket_mesh(store, r, R, os.environ["MASTER_ADDR"], name="exchange_channel/thread")
    m, k, n = (int(x) for x in args.shape.split("x"))
    fns = variants(m, k, n, DTYPES[args.dtype], conns, thread_conns)
    for fn in fns.values():
        for _ in range(args.warmup):
            settled_start(dist, 0.0)
            fn()
    times = interleaved_rounds(dist, list(fns.values()), args.rounds, args.settle_ms / 1e3)
    stats = {name: {"median_ms": statistics.median(times[j].tolist()) * 1e3,
                    "p75_ms": statistics.quantiles(times[j].tolist(), n=4)[2] * 1e3} for j, name in enumerate(fns)}
    if r == 0:
        base = stats["unfused"]["median_ms"]
        print(f"# exchange before gemm_allreduce's composition, {args.shape} {args.dtype}, {R} ranks of "
              f"{args.backend}{', ' + args.hosts_desc if args.hosts_desc else ''}; {args.rounds} rounds, settle "
              f"{args.settle_ms:g} ms; the slowest rank's times")
        print(f"{'variant':>24} | {'median ms':>9} | {'p75 ms':>8} | {'÷ unfused':>9}")
        for name, s in stats.items():
            print(f"{name:>24} | {s['median_ms']:>9.3f} | {s['p75_ms']:>8.3f} | {s['median_ms'] / base:>9.3f}")
        out = Path(args.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"exchange-channel-{args.tag or 'local'}.json").write_text(json.dumps(
            {"backend": args.backend, "shape": args.shape, "dtype": args.dtype, "rounds": args.rounds,
             "settle_ms": args.settle_ms, "pin": args.pin, "hosts": args.hosts_desc, "stats": stats}, indent=1),
            encoding="utf-8")
    for c in [*conns.values(), *thread_conns.values()]:
        c.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
