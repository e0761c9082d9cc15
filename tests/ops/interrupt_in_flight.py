"""Runs inside both ranks of a 2-rank job between two namespace hosts whose link is slow (tc tbf): every fused
op, each on a group of its own, is called with operands whose data take seconds to cross the link, and both
ranks are interrupted (superkernel.backend.cancel_waits from another thread, as the notebook worker does on
every rank) while those data are in flight: after the argument agreement, which is a few hundred bytes, and
long before the transfer could end. Each call must raise at once, naming its op, instead of finishing the
transfer or waiting out the group timeout; once the link is quiet, the same group's next call must give what
it gave before the interrupt, or fail saying why. Prints one REPORT line per rank: per op, the error text
(None when the call returned), the seconds the call took, the seconds from the interrupt to its end, and
whether the next call's result was the same (next_same) or its error (next_error).

Arguments: --backend mk|gloo, --mib (what a rank sends in the interrupted call, about), --after (seconds
from the call's start to the interrupt), --ops (a comma-separated subset).
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

import superkernel.ops as mk
from superkernel.backend import cancel_waits

OPS = ("allgather_gemm", "gemm_allreduce", "gemm_reducescatter", "moe_dispatch_gemm", "moe_combine",
       "ring_attention")


class Case(NamedTuple):
    small: Callable[[], Any]  # a small call: opens the group's connections; made again after the interrupt
    big: Callable[[], Any]  # the call to interrupt
    prepare: Callable[[], None] = lambda: None  # made uninterrupted before `big`


def cases(rank: int, world: int, mib: float, group: dist.ProcessGroup) -> dict[str, Case]:
    """Per op, its Case. Each interrupted call sends about ``mib`` MiB of float32 to the peer and computes
    little."""
    elems = int(mib * (1 << 20) / 4)
    g = torch.Generator().manual_seed(rank)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g)

    k_ag = 1024  # allgather_gemm: each rank's rows of a travel, [elems / k, k]
    a_ag, b_ag = rand(max(1, elems // k_ag), k_ag), rand(k_ag, 8)
    n_ar = 1024  # gemm_allreduce: the [m, n] product is reduced (a ring sends about m n elements)
    a_ar, b_ar = rand(max(1, elems // n_ar), 8), rand(8, n_ar)
    n_rs = 1024  # gemm_reducescatter: each peer's block [m / R, n] of the product travels
    m_rs = max(world, elems * world // ((world - 1) * n_rs) // world * world)
    a_rs, b_rs = rand(m_rs, 8), rand(8, n_rs)
    h, experts = 1024, 2 * world  # moe: every token chooses one expert of the peer's
    tokens = max(1, elems // h)
    x = rand(tokens, h)
    ids = torch.full((tokens, 1), ((rank + 1) % world) * 2, dtype=torch.long)
    w = rand(experts // world, h, 8)
    topw = torch.ones(tokens, 1)
    d, s = 64, 256  # ring_attention: this rank's k and v blocks travel, [1, heads, s, d] each
    heads = max(1, elems // (2 * s * d))
    q = rand(1, heads, s, d)
    small = rand(4, 8)
    q_small = small.view(1, 1, 4, 8)
    state: dict[str, torch.Tensor] = {}

    def combine_small() -> torch.Tensor:
        ys, _, hs = mk.moe_dispatch_gemm(x[:2], ids[:2], w, group)
        return mk.moe_combine(ys, hs, topw[:2], group)

    def combine_prepare() -> None:  # the interrupted combine's routing, dispatched uninterrupted
        yy, _, state["handle"] = mk.moe_dispatch_gemm(x, ids, w, group)
        state["y"] = rand(yy.shape[0], h)  # each row [h] goes home to the peer

    return {
        "allgather_gemm": Case(lambda: mk.allgather_gemm(small, small.T, group),
                               lambda: mk.allgather_gemm(a_ag, b_ag, group)),
        "gemm_allreduce": Case(lambda: mk.gemm_allreduce(small, small.T, group),
                               lambda: mk.gemm_allreduce(a_ar, b_ar, group)),
        "gemm_reducescatter": Case(lambda: mk.gemm_reducescatter(small, small.T, group),
                                   lambda: mk.gemm_reducescatter(a_rs, b_rs, group)),
        "moe_dispatch_gemm": Case(lambda: mk.moe_dispatch_gemm(x[:2], ids[:2], w, group),
                                  lambda: mk.moe_dispatch_gemm(x, ids, w, group)),
        "moe_combine": Case(combine_small, lambda: mk.moe_combine(state["y"], state["handle"], topw, group),
                            combine_prepare),
        "ring_attention": Case(lambda: mk.ring_attention(q_small, q_small, q_small, group),
                               lambda: mk.ring_attention(q, q, q, group)),
    }


def digest(result: Any) -> str:
    """The bytes of every tensor of an op's result."""
    h = hashlib.sha256()
    for t in result if isinstance(result, tuple) else (result,):
        h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def settle(ifname: str, quiet: float = 0.15, most: float = 10.0) -> None:
    """Until this host's link carried nothing for ``quiet`` seconds (at most ``most``): Gloo's interrupted
    collectives carry on in its own threads until their data crossed, and the next op's transfer must not
    queue behind them."""
    stats = f"/sys/class/net/{ifname}/statistics/"

    def count() -> int:
        with open(stats + "rx_bytes") as rx, open(stats + "tx_bytes") as tx:
            return int(rx.read()) + int(tx.read())

    end, last, since = time.monotonic() + most, count(), time.monotonic()
    while time.monotonic() < end:
        time.sleep(0.03)
        now = count()
        if now - last > 4096:  # (more than the odd keep-alive)
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet:
            return


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", choices=["mk", "gloo"], required=True)
    ap.add_argument("--mib", type=float, default=8.0)
    ap.add_argument("--after", type=float, default=0.4)
    ap.add_argument("--ops", default=",".join(OPS))
    args = ap.parse_args()
    timeout = datetime.timedelta(seconds=60)
    dist.init_process_group("gloo", timeout=timeout)  # the job's own group: keeps the ranks in step
    rank, world = dist.get_rank(), dist.get_world_size()
    report: dict = {"rank": rank, "ops": {}}
    for op in args.ops.split(","):
        group = dist.new_group(backend=args.backend, timeout=timeout)
        case = cases(rank, world, args.mib, group)[op]
        before = digest(case.small())
        case.prepare()
        dist.barrier()
        interrupted: list[float] = []

        def interrupt() -> None:
            interrupted.append(time.monotonic())
            cancel_waits()

        timer = threading.Timer(args.after, interrupt)
        t0 = time.monotonic()
        timer.start()
        try:
            case.big()
            error = None
        except RuntimeError as e:
            error = str(e)
        end = time.monotonic()
        timer.cancel()
        timer.join()
        got: dict = {"error": error, "seconds": end - t0,
                     "after_interrupt": end - interrupted[0] if interrupted else None}
        settle(os.environ["GLOO_SOCKET_IFNAME"])
        dist.barrier()
        try:  # the same group's next call: its result as before the interrupt, or an error that says why not
            got["next_same"] = digest(case.small()) == before
        except RuntimeError as e:
            got["next_error"] = str(e)
        dist.barrier()
        report["ops"][op] = got
    sys.stdout.write("REPORT " + json.dumps(report) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
