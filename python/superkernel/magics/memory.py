"""``%memory``: the pool's TensorStores as tables (per rank: capacity, used, free, objects), each printed by
the store's group rank 0.

Reading another rank's allocator header is one-sided, so rank 0 builds the whole table alone; the other
ranks print nothing and do not need to take part.
"""
from __future__ import annotations

from typing import Any

from IPython.core.magic import Magics, line_magic, magics_class


def format_usage(name: str, rows: list[Any], hosts: list[str] | None = None) -> str:
    from superkernel.byte_sizes import format_bytes as human

    cols = ["rank", "host", "capacity", "used", "free", "used %", "objects", "largest free"]
    cells = []
    for u in rows:
        cells.append([str(u.rank), hosts[u.rank] if hosts and u.rank < len(hosts) else "-", human(u.capacity),
                      human(u.used), human(u.free), f"{100 * u.used / u.capacity:.1f}" if u.capacity else "-",
                      str(u.objects), human(u.largest_free)])
    cap = sum(u.capacity for u in rows)
    used = sum(u.used for u in rows)
    cells.append(["all", "", human(cap), human(used), human(cap - used),
                  f"{100 * used / cap:.1f}" if cap else "-", str(sum(u.objects for u in rows)), ""])
    width = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(cols)]
    lines = [f"TensorStore {name}",
             "  ".join(c.rjust(w) if i != 1 else c.ljust(w) for i, (c, w) in enumerate(zip(cols, width))),
             "  ".join("-" * w for w in width)]
    for r in cells:
        lines.append("  ".join(c.rjust(w) if i != 1 else c.ljust(w) for i, (c, w) in enumerate(zip(r, width))))
    return "\n".join(line.rstrip() for line in lines)


@magics_class
class MemoryMagics(Magics):
    @line_magic
    def memory(self, line: str) -> None:
        """Per-rank capacity, used bytes and number of objects of every live TensorStore (printed by the
        store's group rank 0: global rank 0 for stores over the whole pool)."""
        ns = self.shell.user_ns
        try:
            from superkernel.memory.tensor_store import live_stores
        except Exception as e:  # noqa: BLE001 - e.g. the MPI flavour without torch
            if ns.get("rank", 0) == 0:
                print(f"%memory: TensorStore unavailable here ({type(e).__name__}: {e})")
            return
        stores = live_stores()
        mine = [s for s in stores if s.rank == 0]
        if not stores and ns.get("rank", 0) == 0:
            print("%memory: no TensorStore in this pool (create one on every rank: "
                  "store = superkernel.memory.TensorStore(capacity_per_rank='256MiB'))")
            return
        tables = []
        for s in mine:
            hosts = None
            try:
                from superkernel.backend import peer_hosts

                hosts = peer_hosts(s.group)
            except Exception:  # noqa: BLE001 - not an mk group: no host column
                pass
            tables.append(format_usage(f"{s.name} ({s.world_size} ranks)", s.stats(), hosts))
        if tables:
            print("\n\n".join(tables))
