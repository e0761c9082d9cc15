"""What packing b once saves the GEMM ops' chunked fp32 products (kernels/packed_gemm.h), in one run.

For each shape [m, k] x [k, n] and chunk count C: the product made as C row blocks, each with ATen's matmul
(MKL packs b again for every block), against the same blocks from b packed once (MKL's packed sgemm), and
one GEMM over all rows as the baseline; the packing itself is inside the packed time. Single-threaded by
default (as each rank of the 2-rank benchmarks runs). Prints a table; nothing is written.

    python bench/packed_gemm.py
    python bench/packed_gemm.py --shapes 1024x1536x2048,512x512x512 --chunks 2,4,8 --threads 2
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from superkernel import _C


def median_ms(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="1024x1536x2048,1024x768x2048,1024x2048x1024,512x1024x1024,1024x128x1024,"
                                        "256x256x256")
    ap.add_argument("--chunks", default="2,4,8,16")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=9)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not _C.packed_gemm_available():
        raise SystemExit("MKL's packed sgemm is not available in this process (or SUPERKERNEL_OPS_PACKED_B=0)")
    print(f"# fp32, {args.threads} thread(s), median of {args.reps}; ms per product (speedup = plain / packed)")
    print(f"{'shape':>16} | {'one GEMM':>8} | " + " | ".join(f"C={c:<2} plain / packed" for c in
                                                             map(int, args.chunks.split(","))))
    g = torch.Generator().manual_seed(0)
    for shape in args.shapes.split(","):
        m, k, n = map(int, shape.split("x"))
        a, b = torch.randn(m, k, generator=g), torch.randn(k, n, generator=g)
        whole = median_ms(lambda: a @ b, args.reps)
        cells = []
        for c in map(int, args.chunks.split(",")):
            # interleaved, so drifting load hits both alike
            plain, packed = [], []
            for _ in range(args.reps):
                plain.append(median_ms(lambda: _C.chunked_mm(a, b, c, False), 1))
                packed.append(median_ms(lambda: _C.chunked_mm(a, b, c, True), 1))
            p, q = statistics.median(plain), statistics.median(packed)
            cells.append(f"{p:7.2f} / {q:7.2f} ({p / q:.2f}x)")
        print(f"{shape:>16} | {whole:8.2f} | " + " | ".join(cells), flush=True)
    probe = _C.packed_gemm_probe()  # (what the ops go by: kernels/packed_gemm.h)
    print(f"# this process's probe (512x1024x1024 in 4 row blocks, best of 4): plain {probe['plain_ms']:.2f} ms, "
          f"packed {probe['packed_ms']:.2f} ms: packing {'pays' if probe['pays'] else 'does not pay'} here "
          f"(packed <= {probe['ratio']} x plain), so the ops {'pack' if probe['pays'] else 'do not pack'} b "
          f"unless SUPERKERNEL_OPS_PACKED_B says otherwise")


if __name__ == "__main__":
    main()
