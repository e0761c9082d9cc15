"""Single-thread memcpy bandwidth of this machine: the physical ceiling of a shared-memory transport.

A shared-memory collective moves every byte at least once through memory (a copy into a shared segment,
or one ``process_vm_readv``), so one core's memcpy bandwidth bounds what the shm path of one rank can reach.

    python bench/memcpy.py                 # 256 MiB, best of 5
    python bench/memcpy.py --mib 1024 --repeat 3

Reported as bytes copied per second (GB/s = 1e9 B/s), the convention of STREAM's "Copy" minus its factor 2:
a copy of N bytes reads N and writes N, and counts as N.
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass

import numpy as np


@dataclass(frozen=True)
class MemcpyResult:
    bytes: int
    repeat: int
    best_seconds: float
    median_seconds: float

    @property
    def best_gbps(self) -> float:
        return self.bytes / self.best_seconds / 1e9

    @property
    def median_gbps(self) -> float:
        return self.bytes / self.median_seconds / 1e9

    def to_json(self) -> dict[str, float | int]:
        return {**asdict(self), "best_GBps": self.best_gbps, "median_GBps": self.median_gbps}


def measure_memcpy(nbytes: int = 256 << 20, repeat: int = 5) -> MemcpyResult:
    """Copy ``nbytes`` from one buffer to another with numpy (a single-threaded memcpy), ``repeat`` times.

    Both buffers are touched first so page faults are not measured.
    """
    if nbytes <= 0 or repeat <= 0:
        raise ValueError(f"measure_memcpy: nbytes and repeat must be positive (got {nbytes}, {repeat})")
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.zeros(nbytes, dtype=np.uint8)
    np.copyto(dst, src)  # fault in both buffers
    times: list[float] = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t0)
    times.sort()
    return MemcpyResult(bytes=nbytes, repeat=repeat, best_seconds=times[0], median_seconds=times[len(times) // 2])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=256, help="buffer size in MiB (default 256)")
    parser.add_argument("--repeat", type=int, default=5, help="number of timed copies (default 5)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args()
    result = measure_memcpy(args.mib << 20, args.repeat)
    if args.json:
        print(json.dumps(result.to_json()))
    else:
        print(f"# single-thread memcpy, {args.mib} MiB: best {result.best_gbps:.2f} GB/s, "
              f"median {result.median_gbps:.2f} GB/s (of {args.repeat})")


if __name__ == "__main__":
    main()
