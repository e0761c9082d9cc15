"""``%info`` (one table of the whole pool, printed by rank 0) and ``%hostname``."""
from __future__ import annotations

import os
import socket
from typing import Any

from IPython.core.magic import Magics, line_magic, magics_class

from superkernel.magics.collective import gather_to_zero


def rank_row(ns: dict[str, Any]) -> dict[str, Any]:
    row: dict[str, Any] = {
        "rank": ns.get("rank", 0),
        "local": ns.get("local_rank", ns.get("rank", 0)),
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "device": str(ns.get("device", "cpu")),
        "memory": "-",
        "backend": ns.get("__superkernel_backend__", "-").split(" (")[0],
    }
    if "mk" in row["backend"]:
        try:
            from superkernel.backend import transports

            row["transports"] = transports()
        except Exception:
            pass
    torch = ns.get("torch")
    if torch is not None and torch.cuda.is_available() and row["device"].startswith("cuda"):
        free, total = torch.cuda.mem_get_info()
        row["memory"] = f"{(total - free) / 2**30:.1f}/{total / 2**30:.1f} GiB"
        row["device"] += f" {torch.cuda.get_device_name()}"
    return row


def _transport(backend: str, same_host: bool) -> str:
    if "mk" in backend:
        return "shm" if same_host else "tcp"
    if "MPI" in backend:
        return "mpi"
    return "tcp"


def format_table(rows: list[dict[str, Any]]) -> str:
    hosts = [r["host"] for r in rows]
    for r in rows:
        kinds: dict[str, int] = {}
        for other in rows:
            if other["rank"] != r["rank"]:
                known = r.get("transports")
                if known and other["rank"] < len(known):
                    t = known[other["rank"]]     # what the mk backend actually connected
                else:
                    t = _transport(r["backend"], other["host"] == r["host"])
                kinds[t] = kinds.get(t, 0) + 1
        r["peers"] = ", ".join(f"{k}x{n}" for k, n in sorted(kinds.items())) or "-"
    cols = ["rank", "local", "host", "pid", "device", "memory", "backend", "peers"]
    width = {c: max(len(c), *(len(str(r[c])) for r in rows)) for c in cols}
    lines = ["  ".join(c.ljust(width[c]) for c in cols), "  ".join("-" * width[c] for c in cols)]
    lines += ["  ".join(str(r[c]).ljust(width[c]) for c in cols) for r in rows]
    lines.append(f"world size {len(rows)} on {len(set(hosts))} host(s)")
    return "\n".join(lines)


@magics_class
class InfoMagics(Magics):
    @line_magic
    def info(self, line: str) -> None:
        """Table of the pool: rank, host, pid, device and memory, backend, transport per peer."""
        ns = self.shell.user_ns
        rows = gather_to_zero(ns, rank_row(ns))
        if rows is not None:
            print(format_table(rows))

    @line_magic
    def hostname(self, line: str) -> None:
        """Print this rank's host name (identical names collapse into one line)."""
        print(socket.gethostname())
