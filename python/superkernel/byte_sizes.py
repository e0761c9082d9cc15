"""Byte counts as people write them: ``"512 MiB"`` -> 536870912 and back (binary units, torch-free)."""
from __future__ import annotations


def parse_bytes(value: int | str) -> int:
    """``1073741824``, ``"1GiB"``, ``"512 MiB"``, ``"64M"``, ``"1.5G"``, ``"4k"`` -> bytes (binary units)."""
    if isinstance(value, int):
        return value
    t = value.strip().upper().replace(" ", "").removesuffix("B").removesuffix("I")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}.get(t[-1:], 1)
    return int(float(t[:-1] if mult != 1 else t) * mult)


def format_bytes(n: float) -> str:
    """536870912 -> ``"512 MiB"``, 1536 -> ``"1.5 KiB"``, 100 -> ``"100 B"``."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            v = n / (1 << shift)
            return f"{v:.0f} {unit}" if v == int(v) else f"{v:.1f} {unit}"
    return f"{int(n)} B"
