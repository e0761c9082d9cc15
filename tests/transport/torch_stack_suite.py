"""Runs inside every rank of a world (see world.py) whose default group is mk: the parts of PyTorch built on
torch.distributed, each checked against the same computation done on one rank without communication (every
rank regenerates every rank's data from a shared seed). Prints one REPORT line: per family, the failures
(empty when all held), and how many collectives the mk group ran during it (a family that mk did not carry
would count none).

Families: ``ddp`` (DistributedDataParallel: the broadcast of rank 0's parameters, bucketed gradient
averaging over several steps), ``fsdp2`` (fully_shard: all_gather of parameters, reduce_scatter of gradients,
shapes the world size does not divide), ``dtensor`` (DeviceMesh and DTensor redistributions: Shard to
Replicate, Shard(0) to Shard(1), Partial to Replicate), ``batch_p2p`` (batch_isend_irecv both ways round a
ring), ``funcol`` (the functional collectives, eager and traced by torch.compile), ``split_group``
(dist.split_group: members in the listed order, a rank left out of every split), ``debug`` (what
TORCH_DISTRIBUTED_DEBUG=DETAIL needs and does: the worlds run with it set and without)."""
from __future__ import annotations

import datetime
import json
import os
import sys
import traceback
from collections import defaultdict
from collections.abc import Callable

import torch
import torch.distributed as dist

import superkernel  # noqa: F401  (registers "mk")
from superkernel.backend import collective_runs, transports

STEPS = 3
LR = 0.05
failures: dict[str, list[str]] = defaultdict(list)
runs: dict[str, int] = {}


def batch(step: int, r: int) -> torch.Tensor:
    """Rank r's input at a training step: 5 rows of 11 features, the same on every rank that asks."""
    g = torch.Generator().manual_seed(1000 * step + r)
    return torch.randn(5, 11, generator=g)


def model(seed: int) -> torch.nn.Module:
    """Layer widths the world sizes 2-4 do not divide, so FSDP2's shards are uneven."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(11, 13), torch.nn.Tanh(), torch.nn.Linear(13, 7))


def train(m: torch.nn.Module, loss: Callable[[int], torch.Tensor]) -> None:
    """STEPS steps of SGD on m, each step's loss from loss(step)."""
    opt = torch.optim.SGD(m.parameters(), lr=LR)
    for step in range(STEPS):
        loss(step).backward()
        opt.step()
        opt.zero_grad()


def reference(world: int) -> list[torch.Tensor]:
    """Rank 0's model trained on one rank: each step's gradient is the mean over ranks of each rank's
    gradient (what DDP and FSDP2 average), computed as the gradient of the mean loss."""
    m = model(0)
    train(m, lambda step: sum(m(batch(step, r)).pow(2).sum() for r in range(world)) / world)
    return [p.detach().clone() for p in m.parameters()]


def compare(family: str, got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        if g.shape != w.shape:
            failures[family].append(f"parameter {i}: shape {tuple(g.shape)}, want {tuple(w.shape)}")
        elif not torch.allclose(g, w, rtol=1e-5, atol=1e-6):
            failures[family].append(f"parameter {i}: max difference {(g - w).abs().max().item():.3g}")


def check_ddp(rank: int, world: int) -> None:
    m = model(seed=rank)  # each rank starts elsewhere: DDP must broadcast rank 0's parameters
    ddp = torch.nn.parallel.DistributedDataParallel(m, bucket_cap_mb=1e-4)  # (one bucket per parameter)
    train(ddp, lambda step: ddp(batch(step, rank)).pow(2).sum())
    compare("ddp", [p.detach() for p in m.parameters()], reference(world))


def check_fsdp2(rank: int, world: int) -> None:
    from torch.distributed.fsdp import fully_shard
    m = model(seed=0)
    for layer in m:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(m)
    shard = next(iter(m.parameters())).to_local()
    if shard.shape[0] == 13:
        failures["fsdp2"].append(f"the first weight is not sharded (local shape {tuple(shard.shape)})")
    train(m, lambda step: m(batch(step, rank)).pow(2).sum())
    compare("fsdp2", [p.full_tensor() for p in m.parameters()], reference(world))


def check_dtensor(rank: int, world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    mesh = init_device_mesh("cpu", (world,))
    if dist.get_backend(mesh.get_group()) != "mk":
        failures["dtensor"].append(f"the mesh's group is {dist.get_backend(mesh.get_group())}, not mk")
    g = torch.Generator().manual_seed(7)
    a = torch.randn(9, 5, generator=g, dtype=torch.float64)  # 9 rows: uneven shards
    b = torch.randn(5, 6, generator=g, dtype=torch.float64)
    da = distribute_tensor(a, mesh, [Shard(0)])
    db = distribute_tensor(b, mesh, [Replicate()])
    cases: dict[str, tuple[Callable[[], torch.Tensor], torch.Tensor]] = {
        "Shard(0) @ Replicate, gathered": (lambda: (da @ db).full_tensor(), a @ b),
        "Shard(0) to Shard(1), gathered": (lambda: da.redistribute(mesh, [Shard(1)]).full_tensor(), a),
        "Shard(0) to Replicate": (lambda: da.redistribute(mesh, [Replicate()]).to_local(), a),
        "a sum over the sharded dim (Partial to Replicate)": (lambda: da.sum(0).full_tensor(), a.sum(0)),
    }
    for name, (fn, want) in cases.items():
        got = fn()
        if got.shape != want.shape or not torch.allclose(got, want, rtol=1e-12, atol=1e-12):
            failures["dtensor"].append(f"{name}: got shape {tuple(got.shape)}, max difference "
                                       f"{(got - want).abs().max().item() if got.shape == want.shape else 'n/a'}")


def check_batch_p2p(rank: int, world: int) -> None:
    if world < 2:
        return
    right, left = (rank + 1) % world, (rank - 1) % world
    to_right = torch.arange(4 + rank, dtype=torch.float32) + 100 * rank
    to_left = torch.arange(3 + rank, dtype=torch.int64) - 100 * rank
    from_left = torch.empty(4 + left)
    from_right = torch.empty(3 + right, dtype=torch.int64)
    ops = [dist.P2POp(dist.isend, to_right, right), dist.P2POp(dist.irecv, from_left, left),
           dist.P2POp(dist.isend, to_left, left), dist.P2POp(dist.irecv, from_right, right)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    if not torch.equal(from_left, torch.arange(4 + left, dtype=torch.float32) + 100 * left):
        failures["batch_p2p"].append(f"from rank {left}: {from_left.tolist()}")
    if not torch.equal(from_right, torch.arange(3 + right, dtype=torch.int64) - 100 * right):
        failures["batch_p2p"].append(f"from rank {right}: {from_right.tolist()}")


def check_funcol(rank: int, world: int) -> None:
    import torch.distributed._functional_collectives as fc
    group = dist.group.WORLD
    xs = [torch.arange(6 * world, dtype=torch.float32) * (r + 1) for r in range(world)]
    x = xs[rank]

    def calls(t: torch.Tensor) -> list[torch.Tensor]:
        return [fc.all_reduce(t, "sum", group),
                fc.all_gather_tensor(t, 0, group),
                fc.reduce_scatter_tensor(t, "sum", 0, group),
                fc.all_to_all_single(t, None, None, group),
                fc.broadcast(t, 0, group)]

    total = sum(xs)
    want = [total, torch.cat(xs), total.chunk(world)[rank],
            torch.cat([xs[r].chunk(world)[rank] for r in range(world)]), xs[0]]
    names = ["all_reduce", "all_gather_tensor", "reduce_scatter_tensor", "all_to_all_single", "broadcast"]
    compiled = torch.compile(calls, backend="aot_eager", fullgraph=True)
    for how, fn in (("eager", calls), ("torch.compile", compiled)):
        for name, got, w in zip(names, fn(x), want, strict=True):
            if not torch.equal(got, w):
                failures["funcol"].append(f"{how} {name}: {got.tolist()[:8]}..., want {w.tolist()[:8]}...")


def check_split_group(rank: int, world: int) -> None:
    """dist.split_group (as Gloo and NCCL offer it): the listed order is the new ranks' order, a rank in no
    split gets NON_GROUP_MEMBER, and each new group is an mk group of its own."""
    if world < 2:
        return
    ranks = list(range(world))
    # reversed order inside each split; from 3 ranks on, one rank belongs to none: [[1], [0]], [[2, 0]],
    # [[3, 1], [0]]
    rest = ranks[-2::-2][1 if world >= 3 else 0:]
    splits = [ranks[::-2]] + ([rest] if rest else [])
    mine = next((sp for sp in splits if rank in sp), None)
    g = dist.split_group(split_ranks=splits)
    if mine is None:
        if g is not dist.GroupMember.NON_GROUP_MEMBER:
            failures["split_group"].append(f"in no split, yet got a group ({g})")
        return
    problems = []
    if dist.get_backend(g) != "mk":
        problems.append(f"backend {dist.get_backend(g)}")
    if (g.rank(), g.size()) != (mine.index(rank), len(mine)):
        problems.append(f"rank {g.rank()} of {g.size()}, want {mine.index(rank)} of {len(mine)}")
    x = torch.tensor([float(rank + 1), float(g.rank())])
    dist.all_reduce(x, group=g)
    want = [float(sum(r + 1 for r in mine)), float(sum(range(len(mine))))]
    if x.tolist() != want:
        problems.append(f"all_reduce gave {x.tolist()}, want {want}")
    out = [torch.empty(1) for _ in mine]
    dist.all_gather(out, torch.tensor([float(rank)]), group=g)
    if [t.item() for t in out] != [float(r) for r in mine]:
        problems.append(f"all_gather gave {[t.item() for t in out]}, want {mine} in the listed order")
    # a fused op finds the new group by its name, as it finds any other
    from superkernel.ops import gemm_allreduce
    gen = torch.Generator().manual_seed(3)
    parts = [(torch.randn(6, 4, generator=gen, dtype=torch.float64), torch.randn(4, 5, generator=gen, dtype=torch.float64))
             for _ in mine]
    a, b = parts[mine.index(rank)]
    got = gemm_allreduce(a.float(), b.float(), g)
    want_y = sum(pa @ pb for pa, pb in parts)
    if not torch.allclose(got.double(), want_y, rtol=1e-5, atol=1e-5):
        problems.append(f"gemm_allreduce: max difference {(got.double() - want_y).abs().max().item():.3g}")
    failures["split_group"] += [f"split {mine}: {p}" for p in problems]
    dist.destroy_process_group(g)


def check_debug(rank: int, world: int) -> None:
    """What TORCH_DISTRIBUTED_DEBUG=DETAIL relies on (a sequence number that counts collectives alike on every
    rank) and, when it is set, that its checking wrapper really sits in front of mk, catches calls that
    disagree before mk sees them, and leaves the fused ops and superkernel.backend working through it."""
    from superkernel.ops import gemm_allreduce
    pg = dist.distributed_c10d._get_default_group()
    detail = dist.get_debug_level() == dist.DebugLevel.DETAIL
    wrapped = type(pg._get_backend(torch.device("cpu"))).__name__ == "_ProcessGroupWrapper"
    if wrapped != detail:
        failures["debug"].append(f"debug level {dist.get_debug_level()}, yet the backend is "
                                 f"{type(pg._get_backend(torch.device('cpu'))).__name__}")
    before = pg._get_sequence_number_for_group()
    for _ in range(3):
        dist.all_reduce(torch.ones(2))
    seqs = [None] * world
    dist.all_gather_object(seqs, (before, pg._get_sequence_number_for_group()))
    if any(b + 3 != a for b, a in seqs) or len(set(seqs)) != 1:
        failures["debug"].append(f"sequence numbers (before, after) by rank: {seqs}")
    gen = torch.Generator().manual_seed(11)
    parts = [(torch.randn(5, 3, generator=gen), torch.randn(3, 4, generator=gen)) for _ in range(world)]
    got = gemm_allreduce(*parts[rank])
    want = sum(a.double() @ b.double() for a, b in parts)
    if not torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5):
        failures["debug"].append(f"gemm_allreduce: max difference {(got.double() - want).abs().max().item():.3g}")
    try:
        dist.all_reduce(torch.ones(4 + rank))
        failures["debug"].append("an all_reduce whose sizes differ by rank returned")
    except RuntimeError as e:
        # (mk itself: every rank is told on one host; over tcp a pair that disagrees aborts the group)
        said = ("Detected mismatch between collectives",) if detail else ("every rank must pass matching arguments",
                                                                           "disagree on the")
        if not any(x in str(e) for x in said):
            failures["debug"].append(f"the mismatch raised: {str(e)[:300]}")


FAMILIES: dict[str, Callable[[int, int], None]] = {
    "ddp": check_ddp, "fsdp2": check_fsdp2, "dtensor": check_dtensor, "batch_p2p": check_batch_p2p,
    "funcol": check_funcol, "split_group": check_split_group,
    "debug": check_debug}  # (last: without DETAIL, mk's mismatch over tcp leaves the group aborted)


def main() -> None:
    dist.init_process_group("mk", timeout=datetime.timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    for family, check in FAMILIES.items():
        before = sum(collective_runs().values())
        try:
            check(rank, world)
        except Exception:  # noqa: BLE001 - reported per family, the test decides
            failures[family].append(traceback.format_exc(limit=6))
        runs[family] = sum(collective_runs().values()) - before
        if family != "debug":
            dist.barrier()
    sys.stdout.write("REPORT " + json.dumps({"rank": rank, "world": world, "transports": transports(),
                                             "debug": str(dist.get_debug_level()),
                                             "failures": failures, "runs": runs}) + "\n")
    sys.stdout.flush()
    os._exit(0)  # (no destroy: over tcp the mismatch left the group aborted)


if __name__ == "__main__":
    main()
