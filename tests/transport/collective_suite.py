"""Runs inside every rank of a world (see world.py): every collective, dtype and size the mk backend
supports, each checked against a reference computed from all ranks' inputs widened to float64/int64
(each rank regenerates every other rank's input from a shared seed). Prints one REPORT line: per check
family, the list of failures (empty when all passed)."""
from __future__ import annotations

import json
import sys
import threading
import time
import traceback
import zlib
from collections import defaultdict

import torch
import torch.distributed as dist

import superkernel  # noqa: F401  (registers "mk")

FLOATS = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
INTS = [torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64]
ALL = FLOATS + INTS + [torch.bool]
TOL = {torch.float32: (1e-5, 1e-5), torch.float64: (1e-12, 1e-12), torch.bfloat16: (1e-2, 1e-2),
       torch.float16: (2e-3, 2e-3)}
OPS = {"SUM": dist.ReduceOp.SUM, "PRODUCT": dist.ReduceOp.PRODUCT, "MIN": dist.ReduceOp.MIN,
       "MAX": dist.ReduceOp.MAX, "AVG": dist.ReduceOp.AVG, "BAND": dist.ReduceOp.BAND,
       "BOR": dist.ReduceOp.BOR, "BXOR": dist.ReduceOp.BXOR}

rank = world = 0
failures: dict[str, list[str]] = defaultdict(list)
timings: dict[str, float] = defaultdict(float)


def gen(r: int, key: str, n: int, dtype: torch.dtype, op: str = "SUM") -> torch.Tensor:
    """Rank r's input for check `key`: the same on every rank that asks."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{key}/{r}/{n}/{dtype}".encode()))
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=g).bool()
    if dtype.is_floating_point:
        lo, hi = (0.5, 1.5) if op == "PRODUCT" else (-1.0, 1.0)
        return (torch.rand(n, generator=g, dtype=torch.float64) * (hi - lo) + lo).to(dtype)
    if op == "PRODUCT":
        return torch.randint(-3, 4, (n,), generator=g).to(dtype) if dtype != torch.uint8 else torch.randint(0, 4, (n,), generator=g).to(dtype)
    if dtype == torch.uint8:
        return torch.randint(0, 60, (n,), generator=g).to(dtype)
    return torch.randint(-40, 41, (n,), generator=g).to(dtype)


def wide(t: torch.Tensor) -> torch.Tensor:
    return t.double() if t.dtype.is_floating_point else t.long()


def reference(inputs: list[torch.Tensor], op: str, dtype: torch.dtype) -> torch.Tensor:
    x = torch.stack([wide(t) for t in inputs])
    if dtype == torch.bool:
        b = torch.stack(inputs)
        fn = {"SUM": lambda: b.any(0), "MAX": lambda: b.any(0), "BOR": lambda: b.any(0),
              "PRODUCT": lambda: b.all(0), "MIN": lambda: b.all(0), "BAND": lambda: b.all(0),
              "BXOR": lambda: (b.sum(0) % 2).bool()}[op]
        return fn()
    if op in ("SUM", "AVG"):
        y = x.sum(0)
    elif op == "PRODUCT":
        y = x.prod(0)
    elif op == "MIN":
        y = x.min(0).values
    elif op == "MAX":
        y = x.max(0).values
    else:
        y = x[0].clone()
        for row in x[1:]:
            y = {"BAND": torch.bitwise_and, "BOR": torch.bitwise_or, "BXOR": torch.bitwise_xor}[op](y, row)
    if op == "AVG":
        if dtype.is_floating_point:
            return y / len(inputs)
        return torch.div(y.to(dtype).long(), len(inputs), rounding_mode="trunc").to(dtype)
    return y.to(dtype) if not dtype.is_floating_point else y


def same(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> str:
    if got.shape != want.shape:
        return f"shape {tuple(got.shape)} != {tuple(want.shape)}"
    if dtype.is_floating_point:
        rtol, atol = TOL[dtype]
        if not torch.allclose(got.double(), want.double(), rtol=rtol, atol=atol):
            d = (got.double() - want.double()).abs()
            i = int(d.argmax())
            return f"max error {float(d.max()):.3g} at {i}: got {float(got.view(-1)[i])} want {float(want.view(-1)[i])}"
        return ""
    if not torch.equal(got, want.to(got.dtype)):
        i = int((got != want.to(got.dtype)).nonzero()[0][0]) if got.numel() else 0
        return f"mismatch at {i}: got {got.view(-1)[i].item()} want {want.view(-1)[i].item()}"
    return ""


def half_bits(tag: str, r: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    """Rank r's n random fp16/bf16 bit patterns for check `tag` (infinities, NaNs and subnormals among them)."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{tag}/{r}/{n}/{dtype}".encode()))
    return torch.randint(-32768, 32768, (n,), generator=g, dtype=torch.int16).view(dtype)


def bits_differ(got: torch.Tensor, want: torch.Tensor, what: str) -> str:
    """Whether a half-type result has want's bits (NaNs compared as NaNs): "" or where the first differs."""
    nan = want.isnan()
    if not torch.equal(got.isnan(), nan):
        return f"NaN where {what} is not, or the reverse: {int((got.isnan() != nan).sum())}"
    bad = (got.view(torch.int16) != want.view(torch.int16)) & ~nan
    if bad.any():
        i = int(bad.nonzero()[0][0])
        return f"{int(bad.sum())} sums differ from {what}: at {i} got {float(got[i])}, want {float(want[i])}"
    return ""


VERBOSE = False
PER_HOST = 0  # --per-host P: the world is 2 hosts of P ranks each, in rank order (enables the layout's checks)
ONLY: set[str] = set()   # --only FAMILY[,FAMILY]: run just these families (to chase one failure)


def check(family: str, name: str, fn) -> None:
    if ONLY and family not in ONLY:
        return
    if VERBOSE:
        print(f"[rank {rank}] {family} {name}", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    try:
        msg = fn()
    except Exception as e:  # noqa: BLE001 - every failure is reported by name
        msg = f"raised {type(e).__name__}: {e}\n{traceback.format_exc(limit=3)}"
    timings[family] += time.perf_counter() - t0
    if msg:
        failures[family].append(f"{name}: {msg}")
        if VERBOSE:
            print(f"[rank {rank}] FAILED {family} {name}: {msg}", file=sys.stderr, flush=True)


def reduce_ops_for(dtype: torch.dtype) -> list[str]:
    if dtype.is_floating_point:
        return ["SUM", "PRODUCT", "MIN", "MAX", "AVG"]
    if dtype == torch.bool:
        return ["SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"]
    return ["SUM", "PRODUCT", "MIN", "MAX", "AVG", "BAND", "BOR", "BXOR"]


def run(large: bool) -> None:
    sizes = [0, 1, 7, 4099, 100_003]
    big = [4_500_001] if large else []  # 18 MB of float32: several shm chunks, striped tcp frames
    # all_reduce: every dtype, every op, in-place on a fresh tensor
    for dtype in ALL:
        for op in reduce_ops_for(dtype):
            for n in sizes + (big if (op == "SUM" and dtype in (torch.float32, torch.bfloat16, torch.float16)) else []):
                def f(dtype=dtype, op=op, n=n):
                    key = f"ar{op}"
                    t = gen(rank, key, n, dtype, op)
                    dist.all_reduce(t, op=OPS[op])
                    return same(t, reference([gen(r, key, n, dtype, op) for r in range(world)], op, dtype), dtype)
                check("all_reduce", f"{dtype}/{op}/{n}", f)
    # half-type sums round once, to nearest even, as torch rounds the fp32 sum: every fp16/bf16 bit pattern
    # (infinities, NaNs, subnormals, sums that overflow), over lengths that leave vector tails (2 ranks: the
    # fp32 sum of two half values is exact, so the result is one rounding of it, whatever the order)
    if world == 2:
        for dtype in (torch.float16, torch.bfloat16):
            for n in (65_536 + 13, 1_000_003):
                def f(dtype=dtype, n=n):
                    t = half_bits("exact", rank, n, dtype).clone()
                    dist.all_reduce(t)
                    a, b = half_bits("exact", 0, n, dtype), half_bits("exact", 1, n, dtype)
                    return bits_differ(t, (a.float() + b.float()).to(dtype), "the fp32 sum rounded as torch rounds it")
                check("all_reduce", f"{dtype}/SUM/{n}/every bit pattern", f)
    # several ranks per host across hosts (ranks 0..P-1 on the first host, the next P on the second, ...): the
    # host's terms summed in fp32 in rank order, the hosts' fp32 partial sums then summed (at 2 hosts the two
    # leaders add the same two values) and rounded once. Both leader algorithms: recursive doubling (a small
    # buffer) and the ring.
    if PER_HOST > 1 and world == 2 * PER_HOST:
        for dtype in (torch.float16, torch.bfloat16):
            for n in (4_099, 1_000_003):
                def f(dtype=dtype, n=n):
                    t = half_bits("hosts", rank, n, dtype).clone()
                    dist.all_reduce(t)
                    part = []
                    for h in range(2):
                        acc = half_bits("hosts", h * PER_HOST, n, dtype).float()
                        for r in range(h * PER_HOST + 1, (h + 1) * PER_HOST):
                            acc = acc + half_bits("hosts", r, n, dtype).float()
                        part.append(acc)
                    return bits_differ(t, (part[0] + part[1]).to(dtype),
                                       "the hosts' fp32 partial sums added and rounded once")
                check("all_reduce", f"{dtype}/SUM/{n}/{PER_HOST} ranks per host, bits", f)
    # reduce: result at each root, other ranks untouched
    for dtype in [torch.float32, torch.bfloat16, torch.int32, torch.uint8]:
        for root in range(world):
            for n in [0, 5, 70_001]:
                def f(dtype=dtype, root=root, n=n):
                    t = gen(rank, "red", n, dtype)
                    before = t.clone()
                    dist.reduce(t, dst=root, op=dist.ReduceOp.MAX if dtype == torch.uint8 else dist.ReduceOp.SUM)
                    if rank != root:
                        return "" if torch.equal(t, before) else "non-root buffer changed"
                    op = "MAX" if dtype == torch.uint8 else "SUM"
                    return same(t, reference([gen(r, "red", n, dtype) for r in range(world)], op, dtype), dtype)
                check("reduce", f"{dtype}/root{root}/{n}", f)
    for dtype in ALL:
        for root in range(world):
            for n in [0, 3, 70_001] + (big if dtype == torch.float32 and root == world - 1 else []):
                def f(dtype=dtype, root=root, n=n):
                    t = gen(rank, "bc", n, dtype) if rank == root else torch.zeros(n, dtype=dtype)
                    dist.broadcast(t, src=root)
                    return same(t, gen(root, "bc", n, dtype), dtype)
                check("broadcast", f"{dtype}/root{root}/{n}", f)
    for dtype in ALL:
        for n in [0, 3, 70_001] + (big if dtype == torch.float32 else []):
            def f(dtype=dtype, n=n):
                outs = [torch.empty(n, dtype=dtype) for _ in range(world)]
                dist.all_gather(outs, gen(rank, "ag", n, dtype))
                for r in range(world):
                    if m := same(outs[r], gen(r, "ag", n, dtype), dtype):
                        return f"part {r}: {m}"
                out = torch.empty(world * n, dtype=dtype)
                dist.all_gather_into_tensor(out, gen(rank, "ag", n, dtype))
                return same(out, torch.cat([gen(r, "ag", n, dtype) for r in range(world)]), dtype)
            check("all_gather", f"{dtype}/{n}", f)
    for dtype in [torch.float32, torch.int64, torch.bool]:
        for root in range(world):
            for n in [0, 3, 70_001]:
                def f(dtype=dtype, root=root, n=n):
                    outs = [torch.empty(n, dtype=dtype) for _ in range(world)] if rank == root else None
                    dist.gather(gen(rank, "ga", n, dtype), outs, dst=root)
                    if rank == root:
                        for r in range(world):
                            if m := same(outs[r], gen(r, "ga", n, dtype), dtype):
                                return f"part {r}: {m}"
                    out = torch.empty(n, dtype=dtype)
                    ins = [gen(r, "sc", n, dtype) for r in range(world)] if rank == root else None
                    dist.scatter(out, ins, src=root)
                    return same(out, gen(rank, "sc", n, dtype), dtype)
                check("gather_scatter", f"{dtype}/root{root}/{n}", f)
    for dtype in [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int32, torch.int8]:
        for op in ["SUM", "MAX", "AVG"] if dtype.is_floating_point else ["SUM", "MIN", "BXOR"]:
            for n in [0, 1, 4099] + (big[:1] if dtype == torch.float32 and op == "SUM" else []):
                def f(dtype=dtype, op=op, n=n):
                    full = [gen(r, f"rs{op}", world * n, dtype) for r in range(world)]
                    want = reference(full, op, dtype)[rank * n:(rank + 1) * n]
                    out = torch.empty(n, dtype=dtype)
                    dist.reduce_scatter_tensor(out, full[rank], op=OPS[op])
                    if m := same(out, want, dtype):
                        return f"tensor form: {m}"
                    out2 = torch.empty(n, dtype=dtype)
                    dist.reduce_scatter(out2, list(full[rank].chunk(world)) if n else [torch.empty(0, dtype=dtype)] * world, op=OPS[op])
                    return same(out2, want, dtype)
                check("reduce_scatter", f"{dtype}/{op}/{n}", f)
    # (large: n rows of 3 floats per peer, so a peer's block is the 18 MB of `big`, as in the other families; the
    # send buffer holds world such blocks and every rank regenerates every rank's buffer for its reference)
    for dtype in [torch.float32, torch.int16, torch.bool, torch.bfloat16]:
        for n in [0, 2, 30_001] + ([b // 3 for b in big] if dtype == torch.float32 else []):
            def f(dtype=dtype, n=n):
                rows = world * n
                x = gen(rank, "a2a", rows * 3, dtype).view(rows, 3)
                out = torch.empty_like(x)
                dist.all_to_all_single(out, x)
                want = torch.cat([gen(r, "a2a", rows * 3, dtype).view(rows, 3)[rank * n:(rank + 1) * n] for r in range(world)])
                if m := same(out, want, dtype):
                    return f"even: {m}"
                # uneven: rank s sends (s + d + 1) * n // 2 rows to rank d
                def cnt(s, d):
                    return (s + d + 1) * max(n, 1) // 2
                send = [cnt(rank, d) for d in range(world)]
                recv = [cnt(s, rank) for s in range(world)]
                xs = gen(rank, "a2au", sum(send) * 2, dtype).view(sum(send), 2)
                out = torch.empty(sum(recv), 2, dtype=dtype)
                dist.all_to_all_single(out, xs, output_split_sizes=recv, input_split_sizes=send)
                parts = []
                for s in range(world):
                    ss = [cnt(s, d) for d in range(world)]
                    xsrc = gen(s, "a2au", sum(ss) * 2, dtype).view(sum(ss), 2)
                    parts.append(xsrc[sum(ss[:rank]):sum(ss[:rank + 1])])
                if m := same(out, torch.cat(parts), dtype):
                    return f"uneven: {m}"
                outs = [torch.empty(r + 1, dtype=dtype) for r in range(world)]
                ins = [gen(rank, f"a2al{d}", rank + 1, dtype) for d in range(world)]
                dist.all_to_all(outs, ins)
                for s in range(world):
                    if m := same(outs[s], gen(s, f"a2al{rank}", s + 1, dtype), dtype):
                        return f"list part {s}: {m}"
                return ""
            check("all_to_all", f"{dtype}/{n}", f)

    def p2p():
        if world == 1:
            return ""
        nxt, prv = (rank + 1) % world, (rank - 1) % world
        for n in [0, 1, 1000, 3_000_001]:
            for tag in [0, 7]:
                x = gen(rank, f"p2p{tag}", n, torch.float32)
                y = torch.empty(n)
                reqs = [dist.isend(x, nxt, tag=tag), dist.irecv(y, prv, tag=tag)]
                for q in reqs:
                    q.wait()
                if m := same(y, gen(prv, f"p2p{tag}", n, torch.float32), torch.float32):
                    return f"ring n={n} tag={tag}: {m}"
        # a burst of messages in flight, smaller and larger than the 1 MiB shm ring, waited for in reverse order:
        # waiting threads drain the rings themselves while the progress thread does too
        sizes = [(i * 97_531) % 700_000 + (i % 3) * 250_000 for i in range(24)]
        ys = [torch.empty(n) for n in sizes]
        reqs = []
        for i, n in enumerate(sizes):
            reqs += [dist.isend(gen(rank, f"burst{i}", n, torch.float32), nxt, tag=100 + i),
                     dist.irecv(ys[i], prv, tag=100 + i)]
        for q in reversed(reqs):
            q.wait()
        for i, n in enumerate(sizes):
            if m := same(ys[i], gen(prv, f"burst{i}", n, torch.float32), torch.float32):
                return f"burst message {i} ({n} floats): {m}"
        # tags keep two messages apart even when received in the other order
        if rank == 0:
            dist.send(torch.full((4,), 1.0), 1, tag=1)
            dist.send(torch.full((4,), 2.0), 1, tag=2)
        elif rank == 1:
            a, b = torch.empty(4), torch.empty(4)
            dist.recv(b, 0, tag=2)
            dist.recv(a, 0, tag=1)
            if a[0] != 1.0 or b[0] != 2.0:
                return f"tag matching: got {a[0]} {b[0]}"
        # any-source recv reports the sender
        if rank == 0:
            got = set()
            for _ in range(world - 1):
                t = torch.empty(2)
                src = dist.recv(t, tag=5)
                if int(t[0]) != src:
                    return f"any-source: payload {t[0]} from {src}"
                got.add(src)
            if got != set(range(1, world)):
                return f"any-source senders {got}"
        else:
            dist.send(torch.full((2,), float(rank)), 0, tag=5)
        # non-contiguous send and recv buffers
        if rank in (0, 1) and world > 1:
            base = torch.arange(20.0).view(4, 5)
            if rank == 0:
                dist.send(base.t(), 1)
            else:
                out = torch.empty(10, 4)[::2]
                dist.recv(out, 0)
                if not torch.equal(out, base.t()):
                    return "non-contiguous recv mismatch"
        return ""
    check("send_recv", "all", p2p)

    def p2p_waits():
        """Every way of waiting for a point-to-point transfer wakes up when the data comes, including a
        receiver that sleeps before the sender writes (over shared memory the sender then has to ring it: a
        waiter that is not woken sits until the progress thread's periodic pass, up to 100 ms, so the median
        of those rounds would be tens of milliseconds instead of about one), and messages beyond the ring,
        whose sender sleeps until the receiver frees space."""
        if world == 1:
            return ""
        nxt, prv = (rank + 1) % world, (rank - 1) % world
        delay = 0.001

        def wait_plain(y, src):
            dist.irecv(y, src).wait()

        def wait_future(y, src):
            dist.irecv(y, src).get_future().wait()

        def wait_polling(y, src):
            w = dist.irecv(y, src)
            deadline = time.monotonic() + 30
            while not w.is_completed():
                if time.monotonic() > deadline:
                    raise TimeoutError("is_completed() never turned true")
                time.sleep(0)   # let the sending thread have the GIL

        def wait_any(y, src):
            got = dist.recv(y)
            if got != src:
                raise AssertionError(f"any-source recv from {got}, expected {src}")

        styles = {"wait": wait_plain, "future": wait_future, "is_completed": wait_polling, "any-source": wait_any}
        problems = []   # every rank runs every round (an early return would leave the others waiting)
        for name, waiter in styles.items():
            for n in (4, 300_000, 1_100_000):   # one message, a quarter of the 1 MiB ring, beyond the ring (floats)
                dist.barrier()
                asleep_first = []
                for i in range(20 if n < 1_000_000 else 8):
                    x = gen(rank, f"w{name}{i}", n, torch.float32)
                    y = torch.empty(n)
                    # start together: without it the time includes the sender still checking its last round
                    # (tens of ms for a 4 MiB message when 3 ranks share 2 cores), not only the wake-up
                    dist.barrier()
                    # odd rounds: the receiver is asleep before the sender writes; even rounds: the message
                    # is written before the receiver looks (nobody waits for it yet)
                    t0 = time.perf_counter()
                    if i % 2:
                        s = threading.Thread(target=lambda: (time.sleep(delay), dist.send(x, nxt)))
                        s.start()
                        waiter(y, prv)
                        s.join()
                        asleep_first.append(time.perf_counter() - t0)
                    else:
                        w = dist.isend(x, nxt)
                        time.sleep(delay)
                        waiter(y, prv)
                        w.wait()
                    if m := same(y, gen(prv, f"w{name}{i}", n, torch.float32), torch.float32):
                        problems.append(f"{name} n={n} round {i}: {m}")
                asleep_first.sort()
                median = asleep_first[len(asleep_first) // 2]
                # a message beyond the ring also needs the receiver's and the sender's progress threads to hand
                # the ring back and forth (several wake-ups, slow with 4 ranks on 2 cores: medians up to about
                # 15 ms there); a lost wake-up stalls a hand-off for up to 100 ms
                if median > (0.025 if n < 1_000_000 else 0.05):
                    problems.append(f"{name} n={n}: a receiver asleep before the send took {median * 1e3:.1f} ms "
                                    f"(median; rounds {[round(t * 1e3, 1) for t in asleep_first]} ms): a waiter "
                                    f"was not woken")
        return "; ".join(problems)
    check("p2p_waits", "all", p2p_waits)

    def misc():
        # mk's threads carry names (top -H, gdb, py-spy): the group's worker, and a progress thread per
        # provider this rank uses (shm for peers on this host, tcp for the others)
        import glob
        names = set()
        for path in glob.glob("/proc/self/task/*/comm"):
            try:
                names.add(open(path).read().strip())
            except OSError:
                pass  # the thread ended meanwhile
        want = {"mk-worker"}
        from superkernel.backend import transports
        routes = set(transports()) - {"self"}
        want |= {f"mk-{t}-progress" for t in routes}
        if not want <= names:
            return f"thread names: missing {sorted(want - names)} (have {sorted(n for n in names if n.startswith('mk'))})"
        # non-contiguous tensors in collectives
        t = gen(rank, "nc", 60, torch.float32).view(6, 10).t()
        dist.all_reduce(t)
        want = reference([gen(r, "nc", 60, torch.float32).view(6, 10).t() for r in range(world)], "SUM", torch.float32)
        if m := same(t, want, torch.float32):
            return f"non-contiguous all_reduce: {m}"
        # async work and futures
        t = gen(rank, "fut", 1000, torch.float32)
        w = dist.all_reduce(t, async_op=True)
        fut = w.get_future()
        w.wait()
        res = fut.wait()
        if not w.is_completed() or not torch.equal(res[0], t):
            return "future did not resolve to the output"
        if m := same(t, reference([gen(r, "fut", 1000, torch.float32) for r in range(world)], "SUM", torch.float32), torch.float32):
            return f"async all_reduce: {m}"
        # many outstanding async collectives complete in order
        ts = [torch.full((100,), float(i + rank)) for i in range(20)]
        ws = [dist.all_reduce(x, async_op=True) for x in ts]
        for i, (w, x) in enumerate(zip(ws, ts)):
            w.wait()
            if x[0] != sum(i + r for r in range(world)):
                return f"async #{i}: {x[0]}"
        dist.barrier()
        # the coalesced entry points torch uses inside a coalescing manager
        a, b = gen(rank, "co1", 33, torch.float32), gen(rank, "co2", 5, torch.float32)
        ga = torch.empty(world * 4)
        rs_in = gen(rank, "co3", world * 3, torch.float32)
        rs_out = torch.empty(3)
        with dist._coalescing_manager(async_ops=True) as cm:
            dist.all_reduce(a)
            dist.all_reduce(b)
        cm.wait()
        with dist._coalescing_manager(async_ops=True) as cm:
            dist.all_gather_into_tensor(ga, torch.full((4,), float(rank)))
        cm.wait()
        with dist._coalescing_manager(async_ops=True) as cm:
            dist.reduce_scatter_tensor(rs_out, rs_in)
        cm.wait()
        for key, n, got in (("co1", 33, a), ("co2", 5, b)):
            if m := same(got, reference([gen(r, key, n, torch.float32) for r in range(world)], "SUM", torch.float32), torch.float32):
                return f"coalesced all_reduce {key}: {m}"
        if not torch.equal(ga, torch.arange(world).float().repeat_interleave(4)):
            return f"coalesced all_gather_into_tensor: {ga}"
        want = reference([gen(r, "co3", world * 3, torch.float32) for r in range(world)], "SUM", torch.float32)
        if m := same(rs_out, want[rank * 3:(rank + 1) * 3], torch.float32):
            return f"coalesced reduce_scatter_tensor: {m}"
        # gloo second opinion
        g = dist.new_group(backend="gloo")
        for n in [1, 1000, 250_001]:
            a = gen(rank, "gl", n, torch.float32)
            b = a.clone()
            dist.all_reduce(a)
            dist.all_reduce(b, group=g)
            if not torch.allclose(a, b, rtol=1e-5, atol=1e-6):
                return f"differs from gloo at n={n}"
        dist.destroy_process_group(g)
        # a subgroup of the even ranks
        evens = list(range(0, world, 2))
        sub = dist.new_group(evens, backend="mk")
        if rank in evens:
            x = torch.tensor([float(rank)])
            dist.all_reduce(x, group=sub)
            if x.item() != sum(evens):
                return f"subgroup all_reduce {x.item()} != {sum(evens)}"
        return ""
    check("misc", "all", misc)


def main() -> None:
    global rank, world, VERBOSE, PER_HOST
    large = "--large" in sys.argv
    if "--per-host" in sys.argv:
        PER_HOST = int(sys.argv[sys.argv.index("--per-host") + 1])
    VERBOSE = "--verbose" in sys.argv
    if "--only" in sys.argv:
        ONLY.update(sys.argv[sys.argv.index("--only") + 1].split(","))
    dist.init_process_group("mk")
    rank, world = dist.get_rank(), dist.get_world_size()
    from superkernel import backend
    transports = backend.transports()
    run(large)
    dist.barrier()
    # one write() per line: ranks of one torchrun share its stdout (print() writes the newline separately)
    sys.stdout.write("REPORT " + json.dumps({"rank": rank, "transports": transports, "failures": failures,
                                             "timings": {k: round(v, 2) for k, v in timings.items()}}) + "\n")
    sys.stdout.flush()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
