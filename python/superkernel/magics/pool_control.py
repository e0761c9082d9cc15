"""``%restart [--ranks N]``, ``%timeout S``, ``%output raw|collapse [--max-lines N]``."""
from __future__ import annotations

import argparse
import shlex
from typing import Any


async def restart(kernel: Any, args: str, parent: dict[str, Any]) -> str:
    """Tear the pool down and start it again (optionally with N ranks). Rank namespaces are lost."""
    p = argparse.ArgumentParser(prog="%restart", add_help=False, exit_on_error=False)
    p.add_argument("--ranks", type=int, default=None)
    try:
        a = p.parse_args(shlex.split(args))
    except (argparse.ArgumentError, SystemExit) as e:
        raise ValueError(str(e) or "usage: %restart [--ranks N]") from e
    if a.ranks is not None and a.ranks < 1:
        raise ValueError("--ranks must be at least 1")
    return await kernel.restart_pool(a.ranks, parent)


async def timeout(kernel: Any, args: str, parent: dict[str, Any]) -> str:
    """%timeout S: every following cell is interrupted after S seconds (0 or 'off' disables)."""
    s = args.strip()
    if s in ("", "show"):
        return f"cell timeout: {kernel.cell_timeout:g} s" if kernel.cell_timeout else "cell timeout: off"
    seconds = 0.0 if s in ("off", "none") else float(s)
    if seconds < 0:
        raise ValueError("timeout must be >= 0")
    kernel.cell_timeout = seconds or None
    return f"cell timeout: {seconds:g} s" if seconds else "cell timeout: off"


async def output(kernel: Any, args: str, parent: dict[str, Any]) -> str:
    """%output raw|collapse [--max-lines N]: how rank output is merged (N=0: no per-rank line cap)."""
    p = argparse.ArgumentParser(prog="%output", add_help=False, exit_on_error=False)
    p.add_argument("mode", nargs="?", choices=["raw", "collapse"], default=None)
    p.add_argument("--max-lines", type=int, default=None)
    try:
        a = p.parse_args(shlex.split(args))
    except (argparse.ArgumentError, SystemExit) as e:
        raise ValueError(str(e) or "usage: %output raw|collapse [--max-lines N]") from e
    if a.mode:
        kernel.output_mode = a.mode
    if a.max_lines is not None:
        kernel.max_lines = max(0, a.max_lines)
    cap = kernel.max_lines or "no"
    return f"output: {kernel.output_mode}, {cap} line cap per rank"
