"""``%barrier [N]``: barrier latency across the pool (min / median / max per rank), printed by rank 0."""
from __future__ import annotations

import statistics
import time

from IPython.core.magic import Magics, line_magic, magics_class

from superkernel.magics.collective import barrier, gather_to_zero


@magics_class
class BarrierMagics(Magics):
    @line_magic("barrier")
    def barrier_magic(self, line: str) -> None:
        """Time N (default 50) barriers after one warm-up; rank 0 prints a table in microseconds."""
        n = int(line.strip() or 50)
        ns = self.shell.user_ns
        barrier(ns)
        samples = []
        for _ in range(n):
            t0 = time.perf_counter()
            barrier(ns)
            samples.append((time.perf_counter() - t0) * 1e6)
        mine = (ns.get("rank", 0), min(samples), statistics.median(samples), max(samples))
        rows = gather_to_zero(ns, mine)
        if rows is None:
            return
        print(f"barrier latency over {n} barriers (us)")
        print(f"{'rank':>4}  {'min':>9}  {'median':>9}  {'max':>9}")
        for r, lo, med, hi in rows:
            print(f"{r:>4}  {lo:9.1f}  {med:9.1f}  {hi:9.1f}")
        meds = [row[2] for row in rows]
        print(f" all  {min(row[1] for row in rows):9.1f}  {statistics.median(meds):9.1f}  {max(row[3] for row in rows):9.1f}")
