"""What a large carried call costs the small calls after it on Gloo (not a test).

Until 2026-11-26 the fused ops agreed on their arguments on other backends with one alltoall of equal slots;
a small payload rode in a "room" after each descriptor, sized alike on every rank from the group's last 8
agreements, so a call that carried a large payload (up to kCarryMaxOther to one peer) widened the room and
the small calls after it sent slots that large. Since then the agreement there is one send/recv to and from
each peer (csrc/kernels/group.h, Carried), each message only as long as its data; this script shows what
is left of the cost. torchrun script; three variants, timed in one run in alternating blocks:

* ``small alone``: only the small call (default rules);
* ``large alone``: only the large call (default rules);
* ``pair``: the large call, then the small one (default rules: the large payload rides in the agreement);
* ``pair, 64 KiB rule``: the same with SUPERKERNEL_OPS_CARRY_BYTES=65536 on every rank, the rule before
  kCarryMaxOther: the large call runs the agreement, then the backend's collective.

A barrier (after --settle-ms idle) precedes every call; a call's time is the maximum over ranks; the table gives medians. Writes JSON
to bench/results/.

    python bench/netns.py --rates 1gbit --script carry_room.py -- [--op gemm_allreduce] [--big 128x256x256]
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")  # (before torch: one thread per rank, as fused_ops.py and torchrun)
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import superkernel  # noqa: E402, F401  (registers the fused ops)
import superkernel.ops as mk  # noqa: E402

HERE = Path(__file__).resolve().parent
OPS: dict[str, Callable[..., object]] = {"allgather_gemm": mk.allgather_gemm, "gemm_allreduce": mk.gemm_allreduce,
                                         "gemm_reducescatter": mk.gemm_reducescatter}
WARMUP = 12  # pairs before a block is timed (more than the 8 agreements the old room remembered)


def timed(fn: Callable[[], object], settle_s: float) -> float:
    if settle_s:
        time.sleep(settle_s)
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="gloo")
    ap.add_argument("--op", default="gemm_allreduce", choices=sorted(OPS))
    ap.add_argument("--big", default="128x256x256", help="m x k x n of the large call")
    ap.add_argument("--small", default="8x8x8", help="m x k x n of the small call")
    ap.add_argument("--rounds", type=int, default=100, help="timed calls per variant and block")
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--settle-ms", type=float, default=0.0,
                    help="idle time before every call (bench/netns.py's fused_ops runs use 10: the link's tbf bucket "
                         "refills)")
    ap.add_argument("--out-dir", default=str(HERE / "results"))
    ap.add_argument("--tag", default="", help="file name tag (bench/netns.py passes one)")
    ap.add_argument("--hosts-desc", default="", help="where the ranks run, for the header (bench/netns.py)")
    args = ap.parse_args()
    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    op = OPS[args.op]

    def operands(shape: str) -> tuple[torch.Tensor, torch.Tensor]:
        m, k, n = (int(v) for v in shape.split("x"))
        if args.op == "gemm_reducescatter":
            m = max(world, m - m % world)
        g = torch.Generator().manual_seed(rank)
        return torch.randn(m, k, generator=g), torch.randn(k, n, generator=g)

    big, small = operands(args.big), operands(args.small)
    settle = args.settle_ms / 1e3
    variants = ["small alone", "large alone", "pair", "pair, 64 KiB rule"]
    times: dict[str, dict[str, list[float]]] = {v: {"small": [], "big": []} for v in variants}
    for _ in range(args.blocks):
        for v in variants:
            if v == "pair, 64 KiB rule":
                os.environ["SUPERKERNEL_OPS_CARRY_BYTES"] = "65536"
            else:
                os.environ.pop("SUPERKERNEL_OPS_CARRY_BYTES", None)
            for i in range(WARMUP + args.rounds):
                t_big = timed(lambda: op(*big), settle) if v != "small alone" else 0.0
                t_small = timed(lambda: op(*small), settle) if v != "large alone" else 0.0
                if i >= WARMUP:
                    times[v]["big"].append(t_big)
                    times[v]["small"].append(t_small)
    os.environ.pop("SUPERKERNEL_OPS_CARRY_BYTES", None)
    every: list[dict[str, dict[str, list[float]]]] = [{} for _ in range(world)]
    dist.all_gather_object(every, times)
    if rank == 0:
        # a call's time is the slowest rank's
        worst = {v: {c: [max(r[v][c][i] for r in every) for i in range(len(times[v][c]))] for c in ("small", "big")}
                 for v in variants}
        when = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        print(f"# carry room: {world} ranks, {args.backend}, {args.op}, large {args.big}, small {args.small} "
              f"(float32); {args.hosts_desc or 'local'}; {when}; median ms of the max over ranks, "
              f"{args.blocks} blocks x {args.rounds} calls, {args.settle_ms:g} ms idle before each")
        print(f"{'variant':>18} | {'small ms':>8} | {'large ms':>8} | {'pair ms':>8}")
        rows = []
        for v in variants:
            s, b = worst[v]["small"], worst[v]["big"]
            pair = statistics.median(x + y for x, y in zip(s, b))
            row = {"variant": v, "small_ms": statistics.median(s) if any(s) else None,
                   "big_ms": statistics.median(b) if any(b) else None, "pair_ms": pair}
            rows.append(row)
            cells = [f"{row[c]:8.3f}" if row[c] is not None else f"{'-':>8}" for c in ("small_ms", "big_ms")]
            print(f"{v:>18} | {cells[0]} | {cells[1]} | {pair:8.3f}")
        out = Path(args.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        name = f"carry-room-{args.tag or _dt.datetime.now().strftime('%Y%m%d-%H%M%S')}.json"
        (out / name).write_text(json.dumps({"meta": vars(args) | {"world": world, "when": when}, "rows": rows},
                                           indent=1), encoding="utf-8")
        print(f"wrote {out / name}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
