"""``%pull``, ``%push``, ``%scatter``, ``%gather``: move data between the notebook and the ranks.

Values travel pickled inside signed messages. Tensors arrive in the notebook as numpy arrays (the kernel
process does not import torch).
"""
from __future__ import annotations

import argparse
import pickle
import shlex
from typing import Any

from superkernel.merge import format_ranks, parse_ranks


def _args(prog: str, args: str, *, rank: bool) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=f"%{prog}", add_help=False, exit_on_error=False)
    p.add_argument("names", nargs="+")
    if rank:
        p.add_argument("--rank", "--ranks", dest="rank", default=None)
    try:
        return p.parse_args(shlex.split(args))
    except (argparse.ArgumentError, SystemExit) as e:
        raise ValueError(str(e) or f"usage: %{prog} NAME [--rank R]") from e


def _ranks(kernel: Any, spec: str | None) -> list[int]:
    world = kernel.pool.world_size
    return list(range(world)) if spec is None else parse_ranks(spec, world)


async def _pull_one(kernel: Any, rank: int, name: str) -> Any:
    ev = await kernel.request(rank, "pull_request", {"name": name})
    c = ev.msg["content"]
    if c.get("status") != "ok":
        raise KeyError(f"rank {rank}: {c.get('ename')}: {c.get('evalue')}")
    return pickle.loads(ev.msg["buffers"][0])


async def pull(kernel: Any, args: str, parent: dict[str, Any]) -> str:
    """%pull NAME [--rank R]: NAME from rank R (or a list, one value per rank) into the notebook namespace."""
    await kernel.ensure_pool(parent)
    a = _args("pull", args, rank=True)
    ns = kernel.shell.user_ns
    ranks = _ranks(kernel, a.rank)
    for name in a.names:
        values = [await _pull_one(kernel, r, name) for r in ranks]
        ns[name] = values[0] if a.rank is not None and len(ranks) == 1 else values
    return f"pulled {', '.join(a.names)} from {format_ranks(ranks)}"


async def _push_value(kernel: Any, ranks: list[int], name: str, values: list[Any]) -> None:
    for r, v in zip(ranks, values):
        ev = await kernel.request(r, "push_request", {"name": name}, buffers=[pickle.dumps(v, protocol=5)])
        c = ev.msg["content"]
        if c.get("status") != "ok":
            raise ValueError(f"rank {r}: {c.get('ename')}: {c.get('evalue')}")


async def push(kernel: Any, args: str, parent: dict[str, Any]) -> str:
    """%push NAME [NAME ...] [--rank R]: copy notebook variables to the ranks."""
    await kernel.ensure_pool(parent)
    a = _args("push", args, rank=True)
    ranks = _ranks(kernel, a.rank)
    ns = kernel.shell.user_ns
    for name in a.names:
        if name not in ns:
            raise KeyError(f"{name!r} is not defined in the notebook namespace (use %%local to create it)")
        await _push_value(kernel, ranks, name, [ns[name]] * len(ranks))
    return f"pushed {', '.join(a.names)} to {format_ranks(ranks)}"


def split_evenly(seq: Any, parts: int) -> list[Any]:
    """Contiguous chunks whose lengths differ by at most one (like numpy.array_split)."""
    n = len(seq)
    base, extra = divmod(n, parts)
    out, start = [], 0
    for i in range(parts):
        stop = start + base + (1 if i < extra else 0)
        out.append(seq[start:stop])
        start = stop
    return out


async def scatter(kernel: Any, args: str, parent: dict[str, Any]) -> str:
    """%scatter NAME: rank r gets the r-th contiguous chunk of the notebook's sequence NAME."""
    await kernel.ensure_pool(parent)
    a = _args("scatter", args, rank=False)
    ranks = _ranks(kernel, None)
    ns = kernel.shell.user_ns
    for name in a.names:
        if name not in ns:
            raise KeyError(f"{name!r} is not defined in the notebook namespace")
        chunks = split_evenly(ns[name], len(ranks))
        await _push_value(kernel, ranks, name, chunks)
    return f"scattered {', '.join(a.names)} over {format_ranks(ranks)}"


def concatenate(parts: list[Any]) -> Any:
    if parts and all(isinstance(p, (list, tuple)) for p in parts):
        return [x for p in parts for x in p]
    if parts and all(type(p).__module__ == "numpy" and hasattr(p, "ndim") and p.ndim > 0 for p in parts):
        import numpy as np

        return np.concatenate(parts)
    return list(parts)


async def gather(kernel: Any, args: str, parent: dict[str, Any]) -> str:
    """%gather NAME: concatenate every rank's NAME (in rank order) into the notebook namespace."""
    await kernel.ensure_pool(parent)
    a = _args("gather", args, rank=False)
    ranks = _ranks(kernel, None)
    for name in a.names:
        kernel.shell.user_ns[name] = concatenate([await _pull_one(kernel, r, name) for r in ranks])
    return f"gathered {', '.join(a.names)} from {format_ranks(ranks)}"
