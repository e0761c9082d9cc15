"""How windows copy to and from mapped memory (``mk::copy_bytes``) against one plain memcpy, in one run.

A same-host window put or get is one copy between the origin's buffer and the target's mapped block.
``copy_bytes`` copies up to half the last-level cache with one memcpy and streams larger blocks with
non-temporal stores (64 KiB memcpy pieces where the CPU has no AVX2, or with streaming turned off: glibc turns
one large memcpy into a single ``rep movsb``, which on the AMD EPYC VM this project is developed on ran at
60-70% of the speed of pieces beyond the cache). This benchmark shows what each choice gains, size by size,
with both methods measured alternately on the same buffers.

    python bench/window_copy.py                       # 256 KiB .. 256 MiB
    python bench/window_copy.py --sizes 16M,64M --seconds 0.5

Columns: GB/s = bytes copied per second (1e9 B/s; a copy of N bytes counts as N, as in bench/memcpy.py),
best of the rounds for each method; ``mk/memcpy`` = how many times faster copy_bytes is.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from collectives import parse_size  # noqa: E402
from report import format_size  # noqa: E402


def rate(fn, nbytes: int, seconds: float) -> float:  # noqa: ANN001
    """Best bytes/s of ``fn`` over rounds that together take about ``seconds``."""
    fn()
    best = float("inf")
    deadline = time.perf_counter() + seconds
    while True:
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
        if time.perf_counter() > deadline:
            return nbytes / best / 1e9


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="256K,1M,4M,16M,24M,64M,256M")
    p.add_argument("--seconds", type=float, default=0.3, help="per size, method and round")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds per size (the best is kept)")
    args = p.parse_args(argv)
    from superkernel import _C

    sizes = [parse_size(s) for s in args.sizes.split(",")]
    src = np.random.default_rng(0).integers(0, 256, max(sizes), dtype=np.uint8)
    dst = np.zeros(max(sizes), dtype=np.uint8)
    np.copyto(dst, src)                        # fault every page in
    ts, td = torch.from_numpy(src), torch.from_numpy(dst)
    print(f"# mk copy_bytes against numpy copyto (glibc memcpy), one thread, load {os.getloadavg()[0]:.2f}")
    print(f"{'size':>10} | {'method':>7} | {'mk GB/s':>9} | {'memcpy GB/s':>11} | {'mk/memcpy':>9}")
    for n in sizes:
        a, b, x, y = src[:n], dst[:n], ts[:n], td[:n]
        mk = cp = 0.0
        for _ in range(args.rounds):
            mk = max(mk, rate(lambda: _C.copy_bytes(y, x), n, args.seconds))
            cp = max(cp, rate(lambda: np.copyto(b, a), n, args.seconds))
        b[:] = 0
        _C.copy_bytes(y, x)
        if not np.array_equal(b, a):
            raise SystemExit(f"copy_bytes of {format_size(n)} produced different bytes")
        print(f"{format_size(n):>10} | {_C.copy_method(n):>7} | {mk:>9.2f} | {cp:>11.2f} | {mk / cp:>8.2f}x",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
