"""Collective benchmark: mk against Gloo and Open MPI, on the same ranks, in one run.

Recommended (all three measured on the same processes; MPI needs mpirun):

    mpirun --allow-run-as-root -np 2 python bench/collectives.py
    mpirun --allow-run-as-root --oversubscribe -np 4 python bench/collectives.py --quick

Under torchrun (mk and Gloo only; MPI is reported unavailable, since torchrun's ranks are no MPI job):

    torchrun --nproc-per-node 2 bench/collectives.py

Rank, size and local rank come from torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT)
or, under mpirun, from Open MPI's (OMPI_COMM_WORLD_*); then MASTER_ADDR/PORT for torch's store are agreed
through MPI_COMM_WORLD (rank 0 picks a free port). A plain ``python bench/collectives.py`` runs one rank.

Backends: ``mk`` (``import superkernel`` registers it; SUPERKERNEL_TRANSPORT=shm|tcp|auto forces its transport),
``gloo`` (a group of its own, separate from the default group that only coordinates the benchmark) and
``mpi`` (mpi4py on numpy buffers of the same size and dtype, in place where torch's op is in place). A
backend that cannot be used is reported as unavailable with the reason, and the others are still measured.

Each (op, size, backend): one call whose result is checked (a wrong result is flagged with '!', the timing
is still reported), two calls to estimate the time, warm-up, then as many timed iterations as fit in
--time seconds (between --min-iters and --max-iters, the same count on every rank). The table, JSON and PNG
follow the conventions written in bench/report.py (nccl-tests' sizes and bus bandwidth; latency = average
per iteration, max over ranks). Rank 0 also measures the single-thread memcpy bandwidth (bench/memcpy.py),
the ceiling of the shm path. This is a benchmark, not a test: it reports numbers, it asserts nothing.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from report import (  # noqa: E402
    ALL_OPS, BACKEND_ORDER, bus_factor, format_header, format_op_table, format_size, format_targets, plot)

DTYPES = ("float32", "float64", "int32", "bfloat16", "float16")
MPI_DTYPES = ("float32", "float64", "int32")  # numpy + Open MPI reductions; no 16-bit floats
WARMUP_CALLS = 200  # small allreduces per backend before the first measurement
QUICK_SIZES = (8, 1 << 10, 64 << 10, 1 << 20, 16 << 20)


# ----------------------------------------------------------------------------------------------- launch
@dataclass
class Launch:
    launcher: str  # "torchrun" | "mpirun" | "single"
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    mpi_comm: Any = None  # mpi4py's COMM_WORLD under mpirun


def detect_launch() -> Launch:
    """Rank/size from torchrun's environment, else Open MPI's, else a single process.

    Under mpirun, sets RANK/WORLD_SIZE/LOCAL_RANK/LOCAL_WORLD_SIZE and MASTER_ADDR/PORT (unless given) so that
    torch's env:// initialisation and anything reading torchrun's variables work unchanged.
    """
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return Launch("torchrun", int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0)),
                      int(env.get("LOCAL_WORLD_SIZE", env["WORLD_SIZE"])))
    if "OMPI_COMM_WORLD_SIZE" in env:
        env.setdefault("OMP_NUM_THREADS", "1")  # as torchrun does for several ranks per host
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
        launch = Launch("mpirun", comm.Get_rank(), comm.Get_size(),
                        int(env.get("OMPI_COMM_WORLD_LOCAL_RANK", 0)),
                        int(env.get("OMPI_COMM_WORLD_LOCAL_SIZE", comm.Get_size())), comm)
        _agree_master(comm)
        env["RANK"], env["WORLD_SIZE"] = str(launch.rank), str(launch.world_size)
        env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"] = str(launch.local_rank), str(launch.local_world_size)
        return launch
    env.setdefault("MASTER_ADDR", "127.0.0.1")
    env.setdefault("MASTER_PORT", str(_free_port("127.0.0.1")))
    env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"] = "0", "1", "0", "1"
    return Launch("single", 0, 1, 0, 1)


def _free_port(addr: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((addr, 0))
        return int(s.getsockname()[1])


def _agree_master(comm: Any) -> None:
    """MASTER_ADDR/PORT for torch's TCPStore, decided by rank 0 and broadcast over MPI_COMM_WORLD."""
    hosts = comm.allgather(socket.gethostname())
    if comm.Get_rank() == 0:
        addr = os.environ.get("MASTER_ADDR") or (
            "127.0.0.1" if len(set(hosts)) == 1 else socket.gethostbyname(socket.gethostname()))
        port = os.environ.get("MASTER_PORT") or str(_free_port("0.0.0.0"))
        chosen = (addr, port)
    else:
        chosen = None
    addr, port = comm.bcast(chosen, root=0)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = addr, port


# ---------------------------------------------------------------------------------------------- buffers
@dataclass
class Shape:
    """Element counts of one op at one nominal size (nccl-tests: size = the larger buffer)."""

    count: int  # elements of the larger buffer
    per_rank: int  # elements of one rank's slice (allgather input, reduce_scatter output, all_to_all block)
    itemsize: int

    @property
    def nbytes(self) -> int:
        return self.count * self.itemsize


def shape_for(op: str, nbytes: int, itemsize: int, world_size: int) -> Shape:
    count = max(1, nbytes // itemsize)
    if op in ("allgather", "reduce_scatter", "all_to_all"):
        per = max(1, count // world_size)
        return Shape(per * world_size, per, itemsize)
    return Shape(count, count, itemsize)


class Case:
    """One op at one size on one backend: ``run()`` does one call; ``check()`` validates one call."""

    def run(self) -> None:
        raise NotImplementedError

    def check(self) -> str:
        """Fill the inputs with known values, run once, compare; return "ok" or what is wrong."""
        raise NotImplementedError

    def reset(self) -> None:
        """Zero the buffers (so repeated in-place sums cannot overflow during timing)."""
        raise NotImplementedError


def expected_values(op: str, rank: int, n: int, shape: Shape, m: int = 100
                    ) -> tuple[list[tuple[int, int, float]], Any]:
    """Inputs and expected outputs as lists of (start, stop, value) segments: small integers, exact in the
    dtype when ``m`` (the per-slice offset) is chosen for it (100; 8 for 16-bit floats with up to 4 ranks)."""
    per = shape.per_rank
    if op == "allreduce":
        return [(0, shape.count, rank + 1)], [(0, shape.count, n * (n + 1) // 2)]
    if op == "allgather":
        return [(0, per, rank + 1)], [(s * per, (s + 1) * per, s + 1) for s in range(n)]
    if op == "reduce_scatter":
        return ([(s * per, (s + 1) * per, rank + 1 + m * s) for s in range(n)],
                [(0, per, n * (n + 1) // 2 + n * m * rank)])
    if op == "broadcast":
        return [(0, shape.count, 7 if rank == 0 else 0)], [(0, shape.count, 7)]
    if op == "all_to_all":
        return ([(s * per, (s + 1) * per, m * rank + s) for s in range(n)],
                [(s * per, (s + 1) * per, m * s + rank) for s in range(n)])
    raise ValueError(op)


def _compare(out: Any, segments: list[tuple[int, int, float]], to_list: Callable[[Any], list[float]]) -> str:
    for start, stop, value in segments:
        seg = out[start:stop]
        lo_hi = to_list(seg)
        if lo_hi[0] != value or lo_hi[1] != value:
            return f"elements [{start}:{stop}) expected {value}, got min {lo_hi[0]} max {lo_hi[1]}"
    return "ok"


class TorchCase(Case):
    def __init__(self, op: str, shape: Shape, dtype: str, group: Any, rank: int, n: int) -> None:
        import torch
        import torch.distributed as dist

        self.op, self.shape, self.group, self.rank, self.n = op, shape, group, rank, n
        self.dist, self.torch = dist, torch
        tdtype = getattr(torch, dtype)
        if op in ("allreduce", "broadcast"):
            self.inp = self.out = torch.zeros(shape.count, dtype=tdtype)
        elif op == "allgather":
            self.inp, self.out = torch.zeros(shape.per_rank, dtype=tdtype), torch.zeros(shape.count, dtype=tdtype)
        elif op == "reduce_scatter":
            self.inp, self.out = torch.zeros(shape.count, dtype=tdtype), torch.zeros(shape.per_rank, dtype=tdtype)
        elif op == "all_to_all":
            self.inp, self.out = torch.zeros(shape.count, dtype=tdtype), torch.zeros(shape.count, dtype=tdtype)
        elif op == "barrier":
            self.inp = self.out = None
        else:
            raise ValueError(f"unknown op {op!r}")

    def run(self) -> None:
        d, g, op = self.dist, self.group, self.op
        if op == "allreduce":
            d.all_reduce(self.inp, group=g)
        elif op == "allgather":
            d.all_gather_into_tensor(self.out, self.inp, group=g)
        elif op == "reduce_scatter":
            d.reduce_scatter_tensor(self.out, self.inp, group=g)
        elif op == "broadcast":
            d.broadcast(self.inp, src=0, group=g)
        elif op == "all_to_all":
            d.all_to_all_single(self.out, self.inp, group=g)
        else:
            d.barrier(group=g)

    def check(self) -> str:
        if self.op == "barrier":
            self.run()
            return "ok"
        inputs, expected = expected_values(self.op, self.rank, self.n, self.shape,
                                           8 if self.inp.element_size() == 2 else 100)
        self.out.fill_(-1)
        for start, stop, value in inputs:
            self.inp[start:stop] = value
        self.run()
        return _compare(self.out, expected, lambda t: [t.min().item(), t.max().item()])

    def reset(self) -> None:
        if self.inp is not None:
            self.inp.zero_()
            self.out.zero_()


class MpiCase(Case):
    def __init__(self, op: str, shape: Shape, dtype: str, comm: Any, rank: int, n: int) -> None:
        import numpy as np
        from mpi4py import MPI

        self.op, self.shape, self.comm, self.rank, self.n, self.MPI = op, shape, comm, rank, n, MPI
        ndtype = np.dtype(dtype)
        if op in ("allreduce", "broadcast"):
            self.inp = self.out = np.zeros(shape.count, dtype=ndtype)
        elif op == "allgather":
            self.inp, self.out = np.zeros(shape.per_rank, dtype=ndtype), np.zeros(shape.count, dtype=ndtype)
        elif op == "reduce_scatter":
            self.inp, self.out = np.zeros(shape.count, dtype=ndtype), np.zeros(shape.per_rank, dtype=ndtype)
        elif op == "all_to_all":
            self.inp, self.out = np.zeros(shape.count, dtype=ndtype), np.zeros(shape.count, dtype=ndtype)
        elif op == "barrier":
            self.inp = self.out = None
        else:
            raise ValueError(f"unknown op {op!r}")

    def run(self) -> None:
        c, op, MPI = self.comm, self.op, self.MPI
        if op == "allreduce":
            c.Allreduce(MPI.IN_PLACE, self.inp, op=MPI.SUM)
        elif op == "allgather":
            c.Allgather(self.inp, self.out)
        elif op == "reduce_scatter":
            c.Reduce_scatter_block(self.inp, self.out, op=MPI.SUM)
        elif op == "broadcast":
            c.Bcast(self.inp, root=0)
        elif op == "all_to_all":
            c.Alltoall(self.inp, self.out)
        else:
            c.Barrier()

    def check(self) -> str:
        if self.op == "barrier":
            self.run()
            return "ok"
        inputs, expected = expected_values(self.op, self.rank, self.n, self.shape)
        self.out.fill(-1)
        for start, stop, value in inputs:
            self.inp[start:stop] = value
        self.run()
        return _compare(self.out, expected, lambda a: [a.min().item(), a.max().item()])

    def reset(self) -> None:
        if self.inp is not None:
            self.inp.fill(0)
            self.out.fill(0)


# -------------------------------------------------------------------------------------------- backends
@dataclass
class Backend:
    name: str
    available: bool
    reason: str = ""
    detail: str = ""
    group: Any = None  # torch ProcessGroup, or mpi4py communicator for "mpi"

    def case(self, op: str, shape: Shape, dtype: str, rank: int, n: int) -> Case:
        if self.name == "mpi":
            return MpiCase(op, shape, dtype, self.group, rank, n)
        return TorchCase(op, shape, dtype, self.group, rank, n)

    def barrier(self) -> None:
        if self.name == "mpi":
            self.group.Barrier()
        else:
            import torch.distributed as dist

            dist.barrier(group=self.group)


def _all_agree(ok: bool) -> bool:
    """True when ``ok`` holds on every rank (over the default, coordinating group)."""
    import torch
    import torch.distributed as dist

    flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _count_ranks(flag: bool) -> int:
    """How many ranks have ``flag`` set (over the default, coordinating group)."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([1 if flag else 0], dtype=torch.int32)
    dist.all_reduce(t)
    return int(t.item())


def _errors_by_rank(error: str, n: int) -> str:
    """Every rank's error message, identical ones grouped: "ranks [0, 1]: msg; rank 2: other"."""
    import torch.distributed as dist

    errors: list[str | None] = [None] * n
    dist.all_gather_object(errors, error)
    groups: dict[str, list[int]] = {}
    for r, e in enumerate(errors):
        if e:
            groups.setdefault(e, []).append(r)
    return "; ".join(f"rank{'s' if len(rs) > 1 else ''} {rs if len(rs) > 1 else rs[0]}: {e}"
                     for e, rs in groups.items())


def _extension_stamp() -> str:
    """Which superkernel._C is measured: its path and modification time (several builds may coexist)."""
    try:
        import superkernel._C as ext

        path = Path(ext.__file__ or "?")
        when = _dt.datetime.fromtimestamp(path.stat().st_mtime, _dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        return f"{path} built {when}"
    except Exception as e:  # noqa: BLE001 - informational only
        return f"superkernel._C not inspectable ({type(e).__name__})"


def setup_backends(wanted: list[str], launch: Launch, timeout: _dt.timedelta, dtype: str
                   ) -> dict[str, Backend]:
    import torch.distributed as dist

    out: dict[str, Backend] = {}
    for name in BACKEND_ORDER:
        if name not in wanted:
            out[name] = Backend(name, False, "not requested (--backends)")
            continue
        if name == "mpi":
            if launch.mpi_comm is None:
                out[name] = Backend(name, False, "not launched by mpirun: run under mpirun to measure MPI on "
                                                 "the same ranks")
            elif dtype not in MPI_DTYPES:
                out[name] = Backend(name, False, f"no {dtype} reductions in numpy/Open MPI")
            else:
                from mpi4py import MPI

                lib = MPI.Get_library_version().strip().splitlines()[0]
                out[name] = Backend(name, True, detail=f"mpi4py on numpy buffers; {lib}", group=launch.mpi_comm)
            continue
        reason = ""
        if name == "mk":
            try:
                import superkernel  # noqa: F401  (registers the backend)

                if "mk" not in dist.Backend.backend_list:
                    reason = "'import superkernel' did not register a backend named 'mk'"
            except Exception as e:  # noqa: BLE001 - report any import failure as the reason
                reason = f"import superkernel failed: {type(e).__name__}: {e}".splitlines()[0][:200]
        if not _all_agree(not reason):
            out[name] = Backend(name, False, reason or "unavailable on another rank")
            continue
        try:
            group = dist.new_group(backend=name, timeout=timeout)
            err = ""
        except Exception as e:  # noqa: BLE001
            group, err = None, f"new_group(backend={name!r}) failed: {type(e).__name__}: {e}".splitlines()[0]
        if not _all_agree(not err):
            out[name] = Backend(name, False, err or "new_group failed on another rank")
            continue
        detail = f"torch.distributed backend {name!r}"
        if name == "mk":
            detail += f", SUPERKERNEL_TRANSPORT={os.environ.get('SUPERKERNEL_TRANSPORT', 'auto (unset)')}"
            detail += f", {_extension_stamp()}"
        out[name] = Backend(name, True, detail=detail, group=group)
    return out


# ------------------------------------------------------------------------------------------- measuring
@dataclass
class Budget:
    seconds: float
    min_iters: int
    max_iters: int
    warmup_max: int


def _rank_stats(value: float) -> tuple[float, float, float]:
    """(max, min, mean) of ``value`` over ranks, over the default group."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([value, -value, value], dtype=torch.float64)
    mx = t[:2].clone()
    dist.all_reduce(mx, op=dist.ReduceOp.MAX)
    total = t[2:].clone()
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    return mx[0].item(), -mx[1].item(), total[0].item() / dist.get_world_size()


def _median_of_slowest(stamps: list[float]) -> float:
    """Median over iterations of the slowest rank's duration of each iteration (tails show in avg vs p50)."""
    import torch
    import torch.distributed as dist

    durations = torch.tensor(stamps, dtype=torch.float64).diff()
    dist.all_reduce(durations, op=dist.ReduceOp.MAX)
    return durations.median().item()


def warm_up_backends(backends: list[Backend], dtype: str, rank: int, n: int) -> None:
    """A few small allreduces and barriers on every backend, so that one-time costs (connections, mappings,
    first-touch) do not land in the first measured point."""
    for b in backends:
        case = b.case("allreduce", Shape(2, 2, 4), dtype, rank, n)
        for _ in range(WARMUP_CALLS):
            case.run()
        b.barrier()


def measure(case: Case, backend: Backend, budget: Budget) -> dict[str, Any]:
    check = case.check()
    check_all = "ok" if _all_agree(check == "ok") else (check if check != "ok" else "wrong on another rank")
    case.reset()
    t0 = time.perf_counter()
    for _ in range(2):
        case.run()
    probe, _, _ = _rank_stats((time.perf_counter() - t0) / 2)
    iters = int(min(budget.max_iters, max(budget.min_iters, math.ceil(budget.seconds / max(probe, 1e-9)))))
    warmup = min(budget.warmup_max, max(2, iters // 5))
    for _ in range(warmup):
        case.run()
    backend.barrier()
    stamps = [0.0] * (iters + 1)
    clock = time.perf_counter
    stamps[0] = clock()
    for i in range(iters):
        case.run()
        stamps[i + 1] = clock()
    per_iter = (stamps[-1] - stamps[0]) / iters
    mx, mn, mean = _rank_stats(per_iter)
    p50 = _median_of_slowest(stamps)
    return {"iters": iters, "warmup": warmup + 2, "lat_us": mx * 1e6, "lat_us_min_rank": mn * 1e6,
            "lat_us_p50": p50 * 1e6,
            "lat_us_mean_rank": mean * 1e6, "check": check_all}


def size_list(args: argparse.Namespace) -> list[int]:
    if args.sizes:
        return sorted({parse_size(s) for s in args.sizes.split(",")})
    if args.quick:
        return [s for s in QUICK_SIZES if s <= parse_size(args.max_bytes)]
    lo, hi, factor = parse_size(args.min_bytes), parse_size(args.max_bytes), args.factor
    if lo <= 0 or hi < lo or factor < 2:
        raise SystemExit(f"bad size range: --min-bytes {lo} --max-bytes {hi} --factor {factor}")
    sizes, s = [], lo
    while s <= hi:
        sizes.append(s)
        s *= factor
    if sizes[-1] != hi:
        sizes.append(hi)
    return sizes


def parse_size(text: str) -> int:
    text = text.strip().upper().replace("IB", "").replace("B", "")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(float(text[:-1] if mult != 1 else text) * mult)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backends", default="mk,gloo,mpi", help="comma-separated subset of mk,gloo,mpi")
    p.add_argument("--ops", default=",".join(ALL_OPS), help="comma-separated subset of " + ",".join(ALL_OPS))
    p.add_argument("--min-bytes", default="8", help="smallest size (default 8)")
    p.add_argument("--max-bytes", default="64M", help="largest size (default 64M)")
    p.add_argument("--factor", type=int, default=2, help="size step factor (default 2: powers of two)")
    p.add_argument("--sizes", help="explicit comma-separated sizes, e.g. 8,1K,16M (overrides the range)")
    p.add_argument("--quick", action="store_true", help="sizes 8 B, 1 KiB, 64 KiB, 1 MiB, 16 MiB; shorter timing")
    p.add_argument("--dtype", default="float32", choices=DTYPES)
    p.add_argument("--time", type=float, default=None,
                   help="target seconds of timed iterations per (op, size, backend) (default 0.1, quick 0.04)")
    p.add_argument("--min-iters", type=int, default=None, help="default 5 (quick 3)")
    p.add_argument("--max-iters", type=int, default=1000)
    p.add_argument("--warmup-max", type=int, default=50,
                   help="warm-up calls: a fifth of the timed iterations, at most this many (default 50)")
    p.add_argument("--timeout", type=float, default=120.0, help="torch group timeout, seconds (default 120)")
    p.add_argument("--out-dir", default=str(HERE / "results"), help="where JSON and PNG go (bench/results)")
    p.add_argument("--tag", default="", help="file name tag (default: <n>r-<launcher>-<date>)")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--no-memcpy", action="store_true", help="skip the memcpy bandwidth measurement")
    p.add_argument("--p50", action="store_true", help="also show the median latency (p50) column")
    p.add_argument("--hosts-desc", default="", help="free text describing the placement, for the header")
    args = p.parse_args(argv)
    if args.time is None:
        args.time = 0.04 if args.quick else 0.1
    if args.min_iters is None:
        args.min_iters = 3 if args.quick else 5
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    launch = detect_launch()
    import torch
    import torch.distributed as dist

    if launch.launcher == "mpirun":
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    ops = [o for o in args.ops.split(",") if o]
    bad = [o for o in ops if o not in ALL_OPS]
    if bad:
        raise SystemExit(f"unknown op(s) {bad}; choose from {ALL_OPS}")
    wanted = [b for b in args.backends.split(",") if b]
    if any(b not in BACKEND_ORDER for b in wanted):
        raise SystemExit(f"unknown backend in {wanted}; choose from {BACKEND_ORDER}")
    sizes = size_list(args)
    timeout = _dt.timedelta(seconds=args.timeout)

    memcpy = None
    if launch.rank == 0 and not args.no_memcpy:
        from memcpy import measure_memcpy

        memcpy = measure_memcpy().to_json()
    # The coordinating group (agreement, timing statistics) waits longer than the measured groups, so that a
    # rank whose measured collective timed out still finds the others waiting for it here.
    dist.init_process_group("gloo", timeout=timeout * 3 + _dt.timedelta(seconds=60))
    n, rank = launch.world_size, launch.rank
    backends = setup_backends(wanted, launch, timeout, args.dtype)
    hostnames = [None] * n
    dist.all_gather_object(hostnames, socket.gethostname())
    nhosts = len(set(hostnames))
    hosts_desc = args.hosts_desc or (f"{nhosts} host{'s' if nhosts > 1 else ''}, "
                                     f"{launch.local_world_size} per host")
    doc: dict[str, Any] = {
        "meta": {
            "world_size": n, "launcher": launch.launcher, "dtype": args.dtype, "hosts": hostnames,
            "hosts_desc": hosts_desc, "torch_version": torch.__version__, "date": _dt.datetime.now(
                _dt.timezone.utc).isoformat(timespec="seconds"), "memcpy": memcpy, "args": vars(args),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "torch_threads": torch.get_num_threads(),
            "nproc": os.cpu_count(), "git_commit": _git_commit() if rank == 0 else None,
            "superkernel_transport": os.environ.get("SUPERKERNEL_TRANSPORT"),
            "backends": {b.name: {"available": b.available, "reason": b.reason, "detail": b.detail}
                         for b in backends.values()},
        },
        "results": [],
        "errors": [],
    }
    broken: dict[tuple[str, str], str] = {}
    live = [b for b in backends.values() if b.available]
    warm_up_backends(live, args.dtype, rank, n)
    if rank == 0:
        print(format_header(doc), flush=True)
    budget = Budget(args.time, args.min_iters, args.max_iters, args.warmup_max)
    itemsize = torch.empty(0, dtype=getattr(torch, args.dtype)).element_size()
    for op in ops:
        op_sizes = [0] if op == "barrier" else sorted({shape_for(op, s, itemsize, n).nbytes for s in sizes})
        for nbytes in op_sizes:
            shape = shape_for(op, max(nbytes, 1), itemsize, n) if op != "barrier" else Shape(0, 0, itemsize)
            for b in live:
                if (b.name, op) in broken or (b.name, "*") in broken:
                    continue
                error = ""
                try:
                    case = b.case(op, shape, args.dtype, rank, n)
                    m = measure(case, b, budget)
                except Exception as e:  # noqa: BLE001 - report the backend's failure, go on with the others
                    error = f"{type(e).__name__}: {e}".splitlines()[0][:300]
                failed = _count_ranks(bool(error))
                if failed:
                    # Failed everywhere (e.g. not supported): skip this op's larger sizes on this backend.
                    # Failed on some ranks only: the group may be out of step, so drop the backend.
                    everywhere = failed == n
                    reason = _errors_by_rank(error, n)
                    key = (b.name, op) if everywhere else (b.name, "*")
                    broken[key] = reason
                    doc["errors"].append({"op": op, "backend": b.name, "bytes": shape.nbytes, "rank": rank,
                                          "failed_ranks": failed, "error": reason})
                    if rank == 0:
                        what = "its larger sizes" if everywhere else f"all further {b.name} measurements"
                        print(f"# ! {b.name} {op} {format_size(shape.nbytes)} failed on {failed} of {n} ranks: "
                              f"{reason} (skipping {what})", file=sys.stderr, flush=True)
                    continue
                size = shape.nbytes if op != "barrier" else 0
                sec = m["lat_us"] / 1e6
                algbw = size / sec / 1e9 if sec > 0 else 0.0
                doc["results"].append({"op": op, "backend": b.name, "bytes": size, "count": shape.count, **m,
                                       "algbw_GBps": algbw, "busbw_GBps": algbw * bus_factor(op, n)})
                del case
        if rank == 0:
            print("\n" + format_op_table(doc, op, args.p50), flush=True)
    if rank == 0:
        targets = format_targets(doc)
        if targets:
            print("\n" + targets, flush=True)
        write_outputs(doc, args, launch)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def _git_commit() -> str | None:
    """The checkout's commit (with "+dirty" when bench or sources differ), or None outside a git checkout."""
    import subprocess

    try:
        head = subprocess.run(["git", "-C", str(HERE), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10)
        dirty = subprocess.run(["git", "-C", str(HERE), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if head.returncode != 0:
        return None
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def write_outputs(doc: dict[str, Any], args: argparse.Namespace, launch: Launch) -> None:
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    tag = args.tag or f"{launch.world_size}r-{launch.launcher}-{stamp}"
    json_path = out_dir / f"collectives-{tag}.json"
    json_path.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    print(f"\n# json: {json_path}", flush=True)
    if not args.no_plot:
        png_path = out_dir / f"collectives-{tag}.png"
        try:
            plot(doc, str(png_path))
            print(f"# plot: {png_path}", flush=True)
        except Exception as e:  # noqa: BLE001 - a failed plot must not lose the numbers
            print(f"# plot failed: {type(e).__name__}: {e}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
