"""Failure scenarios, one per launch (see test_failures.py). Each rank prints a REPORT line with what it
observed: which operations raised, with what message, and how long it took."""
from __future__ import annotations

import datetime
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import superkernel  # noqa: F401

scenario = sys.argv[1]
timeout_s = float(os.environ.get("SUITE_TIMEOUT", "60"))
backend = os.environ.get("SUITE_BACKEND", "cpu:mk,cuda:nccl") if scenario == "mixed" else "mk"
dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
rank, world = dist.get_rank(), dist.get_world_size()
events: list[dict] = []


def attempt(name: str, fn) -> None:
    t0 = time.monotonic()
    try:
        fn()
        events.append({"op": name, "ok": True, "secs": time.monotonic() - t0})
    except Exception as e:  # noqa: BLE001
        events.append({"op": name, "ok": False, "error": f"{type(e).__name__}: {e}", "secs": time.monotonic() - t0})


def report() -> None:
    sys.stdout.write("REPORT " + json.dumps({"rank": rank, "events": events, "pid": os.getpid()}) + "\n")
    sys.stdout.flush()


if scenario == "mismatch":
    attempt("size", lambda: dist.all_reduce(torch.ones(10 if rank == 0 else 20)))
    attempt("dtype", lambda: dist.all_reduce(torch.ones(10, dtype=torch.float32 if rank == 0 else torch.int32)))
    if os.environ.get("SUPERKERNEL_TRANSPORT") == "shm":
        # rank 1 sends 2 rows to rank 0, which expects 1
        send = [1, 1] if rank == 0 else [2, 1]
        attempt("split", lambda: dist.all_to_all_single(torch.empty(2, 3), torch.ones(sum(send), 3), [1, 1], send))
    attempt("after", lambda: dist.all_reduce(torch.ones(4)))
    report()
elif scenario == "bad_args":
    attempt("root", lambda: dist.broadcast(torch.ones(3), src=world + 3))
    attempt("allgather_outputs", lambda: dist.all_gather([torch.empty(3)] * (world + 1), torch.ones(3)))
    attempt("allgather_shape", lambda: dist.all_gather_into_tensor(torch.empty(world * 3 + 1), torch.ones(3)))
    attempt("send_rank", lambda: dist.send(torch.ones(1), dst=world + 1))
    attempt("tag", lambda: dist.send(torch.ones(1), dst=(rank + 1) % world, tag=-4))
    attempt("split", lambda: dist.all_to_all_single(torch.empty(world), torch.ones(world), [1] * world, [2] * world))
    attempt("bitwise_float", lambda: dist.all_reduce(torch.ones(3), op=dist.ReduceOp.BAND))
    def good():
        t = torch.ones(4)
        dist.all_reduce(t)
        assert t[0].item() == world, t
    attempt("after", good)
    report()
elif scenario == "peer_exit":
    dist.barrier()
    if rank == world - 1:
        os._exit(3)
    time.sleep(0.5)
    attempt("allreduce", lambda: dist.all_reduce(torch.ones(1000)))
    attempt("again", lambda: dist.all_reduce(torch.ones(10)))
    report()
    os._exit(0)  # skip destroy: the group is broken
elif scenario == "send_then_exit":
    # rank 1 sends and leaves at once (its sends complete when the data is handed to the transport); rank 0
    # looks only after it has gone: what was sent must still arrive whole, then the peer is reported gone
    sizes = [4, 300_000, 1_100_000, 4_500_001]   # one frame, ..., beyond the shm ring and striped over tcp
    if rank == 1:
        for i, n in enumerate(sizes):
            dist.send(torch.arange(n, dtype=torch.float32) + i, 0, tag=i)
        dist.destroy_process_group()
        os._exit(0)
    time.sleep(1.0)
    for i, n in enumerate(sizes):
        def recv(i=i, n=n):
            y = torch.empty(n)
            dist.recv(y, 1, tag=i)
            if not torch.equal(y, torch.arange(n, dtype=torch.float32) + i):
                raise AssertionError(f"n={n}: wrong data")
        attempt(f"recv{n}", recv)
    attempt("after", lambda: dist.recv(torch.empty(3), 1, tag=9))
    report()
    os._exit(0)
elif scenario == "timeout":
    dist.barrier()
    if rank == 1:
        time.sleep(timeout_s + 3)
    t = torch.ones(100)
    attempt("allreduce", lambda: dist.all_reduce(t))
    events[-1]["value"] = t[0].item()
    attempt("next", lambda: dist.all_reduce(torch.ones(100)))
    report()
    os._exit(0)
elif scenario == "recv_timeout":
    if rank == 0:
        attempt("recv", lambda: dist.recv(torch.empty(3), src=1, tag=9))
    else:
        time.sleep(timeout_s + 3)  # stay connected (and silent) until rank 0 has given up
    report()
    os._exit(0)
elif scenario == "peer_abort":
    # rank 0 aborts a group of its own while rank 1 waits in a receive from it, then rank 1 uses it again;
    # rank 1 never aborted anything (an interrupt on rank 0 only does this to the default group)
    from superkernel.memory import Window
    g = dist.new_group(backend="mk")
    win = Window(torch.arange(8, dtype=torch.float32) + rank, g)
    dist.all_reduce(torch.ones(4), group=g)  # (connections made)
    dist.barrier()
    if rank == 0:
        time.sleep(1.0)
        attempt("abort", g.abort)
    else:
        attempt("recv_waiting", lambda: dist.recv(torch.empty(3), src=0, tag=5, group=g))
        attempt("recv_after", lambda: dist.recv(torch.empty(3), src=0, tag=6, group=g))
        attempt("send_after", lambda: dist.send(torch.ones(3), dst=0, tag=7, group=g))
        attempt("allreduce_after", lambda: dist.all_reduce(torch.ones(4), group=g))
        attempt("get_after", lambda: win.get(0, 0, torch.empty(8)))
    dist.barrier()  # (the default group is untouched)
    report()
    os._exit(0)  # skip destroy: g is broken
elif scenario == "timeout_reason":
    # rank 0 alone has a short timeout: its all_reduce times out waiting for rank 1, which waits in a receive
    # from rank 0 instead (a mismatched program); rank 1 must hear why rank 0 left, not only that it did
    dist.barrier()
    if rank == 0:
        attempt("allreduce", lambda: dist.all_reduce(torch.ones(100)))
        time.sleep(2.0)  # (stay: the reason must come from rank 0's abort, not from its exit)
    else:
        attempt("recv", lambda: dist.recv(torch.empty(3), src=0, tag=4))
        attempt("recv_after", lambda: dist.recv(torch.empty(3), src=0, tag=5))
    report()
    os._exit(0)
elif scenario == "abort_mid_frame":
    # rank 0 stops rank 1 (SIGSTOP), puts 16 MiB into its window, and aborts while the put's frame is half
    # sent; 0.3 s later it resumes rank 1, which waits in a receive from rank 0. The put's socket then ends in
    # the middle of a frame, and rank 1 meets that first: the ABORT frame waits on the other socket.
    import signal
    import threading
    from superkernel.memory import Window
    g = dist.new_group(backend="mk")
    win = Window(torch.zeros(4 << 20), g)
    dist.all_reduce(torch.ones(4), group=g)  # (connections made)
    pids: list[int | None] = [None] * world
    dist.all_gather_object(pids, os.getpid())
    if rank == 0:
        time.sleep(0.5)  # (rank 1 is in its receive)
        os.kill(pids[1], signal.SIGSTOP)
        stopped_by = time.monotonic() + 10
        while Path(f"/proc/{pids[1]}/stat").read_text().rsplit(")", 1)[1].split()[0] != "T":
            if time.monotonic() > stopped_by:
                os.kill(pids[1], signal.SIGCONT)
                raise SystemExit(f"rank 0: rank 1 (pid {pids[1]}) did not stop within 10 s of SIGSTOP")
            time.sleep(0.01)
        put = threading.Thread(target=attempt, args=("put", lambda: win.put(1, 0, torch.ones(4 << 20))))
        put.start()
        time.sleep(0.5)
        attempt("abort", g.abort)
        put.join()
        time.sleep(0.3)
        os.kill(pids[1], signal.SIGCONT)
    else:
        attempt("recv", lambda: dist.recv(torch.empty(3), src=0, tag=5, group=g))
    dist.barrier()  # (the default group is untouched)
    report()
    os._exit(0)  # skip destroy: g is broken
elif scenario == "kill9":
    dist.barrier()
    print(f"READY {os.getpid()}", flush=True)
    t0 = time.monotonic()
    n = 0
    while time.monotonic() - t0 < 60:
        try:
            dist.all_reduce(torch.ones(1 << 16))
            n += 1
        except Exception as e:  # noqa: BLE001
            events.append({"op": "loop", "ok": False, "error": f"{type(e).__name__}: {e}", "iterations": n,
                           "at": time.time()})
            break
    report()
    os._exit(0)
elif scenario == "handshake":
    def ok():
        t = torch.ones(5)
        dist.all_reduce(t)
        assert t[0].item() == world
    attempt("allreduce", ok)
    report()
elif scenario == "mixed":
    from superkernel import backend as mkb
    def cpu_allreduce():
        t = torch.ones(3) * (rank + 1)
        dist.all_reduce(t)
        assert t[0].item() == sum(range(1, world + 1)), t
        assert mkb.transports()[rank] == "self"
    attempt("cpu_allreduce", cpu_allreduce)
    events.append({"op": "backend", "ok": True, "name": str(dist.get_backend())})
    report()
else:
    raise SystemExit(f"unknown scenario {scenario}")
dist.destroy_process_group()
