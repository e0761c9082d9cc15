"""What a probe found: the hosts' hardware, the ranks on each host, and the measured series.

A :class:`ProbeReport` is plain data (JSON round trip) so the CLI, the magic, the notebook and the plot can
all work from one object, and a saved run can be re-printed.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from superkernel.probe.hardware import HostHardware
from superkernel.probe.measure import Series


@dataclass
class ProbeReport:
    world_size: int
    backend: str
    launcher: str
    date: str
    hosts: list[HostHardware]
    ranks_per_host: dict[str, list[int]]
    series: list[Series] = field(default_factory=list)
    memcpy_GBps: float | None = None          # one core's memcpy on rank 0: the ceiling of the shm path
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def find(self, test: str, provider: str | None = None, scope: str | None = None) -> Series | None:
        for s in self.series:
            if s.test != test:
                continue
            if provider is not None and (s.route is None or s.route.provider != provider):
                continue
            if scope is not None and (s.route is None or s.route.scope != scope):
                continue
            return s
        return None

    def to_json(self) -> dict[str, Any]:
        return {"world_size": self.world_size, "backend": self.backend, "launcher": self.launcher,
                "date": self.date, "hosts": [h.to_json() for h in self.hosts],
                "ranks_per_host": self.ranks_per_host, "series": [s.to_json() for s in self.series],
                "memcpy_GBps": self.memcpy_GBps, "notes": self.notes, "seconds": self.seconds}

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=1)

    @staticmethod
    def from_json(d: dict[str, Any]) -> "ProbeReport":
        return ProbeReport(d["world_size"], d["backend"], d["launcher"], d["date"],
                           [HostHardware.from_json(h) for h in d["hosts"]], d["ranks_per_host"],
                           [Series.from_json(s) for s in d["series"]], d.get("memcpy_GBps"), d.get("notes", []),
                           d.get("seconds", 0.0))
