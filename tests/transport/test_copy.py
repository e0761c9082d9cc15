"""mk::copy_bytes, the copy behind same-host window puts and gets: every method (memcpy, streaming stores,
64 KiB pieces) copies exactly the bytes asked for, at any length and alignment, and never past them."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from superkernel import _C

MiB = 1 << 20
STREAM_AT = _C.copy_method(256 * MiB)


@pytest.mark.parametrize("use", ["window", "collective"])
@pytest.mark.parametrize("n", [0, 1, 31, 4095, MiB - 1, MiB, MiB + 3, 3 * MiB + 65537, 40 * MiB + 77])
@pytest.mark.parametrize("shift", [(0, 0), (1, 0), (0, 7), (13, 29)])
def test_copies_exactly(n: int, shift: tuple[int, int], use: str) -> None:
    s, d = shift
    src = torch.randint(0, 256, (n + s + 64,), dtype=torch.uint8)
    dst = torch.full((n + d + 64,), 0xA5, dtype=torch.uint8)
    _C.copy_bytes(dst[d:d + n], src[s:s + n], use)
    assert torch.equal(dst[d:d + n], src[s:s + n])
    assert bool((dst[:d] == 0xA5).all()) and bool((dst[d + n:] == 0xA5).all()), "wrote outside the range"


def test_methods_by_size() -> None:
    assert _C.copy_method(MiB - 1, "window") == _C.copy_method(MiB - 1, "collective") == "memcpy"
    assert _C.copy_method(MiB, "window") == "memcpy"      # up to half the last-level cache (16 MiB on the CI VM)
    assert _C.copy_method(MiB, "collective") == "pieces"  # from 1 MiB
    assert _C.copy_method(MiB) == "memcpy"                # the default: as windows copy
    assert STREAM_AT in ("pieces", "stream")   # "pieces" where the CPU has no AVX2
    with pytest.raises(ValueError, match="window"):
        _C.copy_method(MiB, "other")


def test_stream_threshold_override() -> None:
    """0 turns streaming off (beyond half the cache: 64 KiB pieces, which then copy exactly); a threshold
    of 1 MiB streams from there."""
    code = ("from superkernel import _C; import torch; "
            "a = torch.randint(0, 256, (300 << 20,), dtype=torch.uint8); b = torch.zeros_like(a); "
            "_C.copy_bytes(b, a); print(_C.copy_method(2 << 20), _C.copy_method(2 << 20, 'collective'), "
            "_C.copy_method(1 << 30), bool(torch.equal(a, b)))")

    def run(value: str) -> list[str]:
        env = {**os.environ, "SUPERKERNEL_STREAM_COPY_BYTES": value}
        return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                              check=True, timeout=120).stdout.split()
    assert run("0") == ["memcpy", "pieces", "pieces", "True"]
    if STREAM_AT == "stream":
        assert run(str(MiB)) == ["stream", "stream", "stream", "True"]


def test_tiny_stream_threshold_never_streams_small_blocks() -> None:
    """A threshold below 1 MiB streams from 1 MiB only: smaller blocks (down to a few bytes, shorter than the
    streaming path's alignment head) stay memcpy and copy exactly."""
    code = ("from superkernel import _C; import torch\n"
            "for n in (0, 5, 31, 100, 4096, (1 << 20) - 1):\n"
            "    a = torch.randint(0, 256, (n,), dtype=torch.uint8); b = torch.zeros_like(a)\n"
            "    _C.copy_bytes(b, a); assert torch.equal(a, b), n; assert _C.copy_method(n) == 'memcpy', n\n"
            "print('ok')")
    env = {**os.environ, "SUPERKERNEL_STREAM_COPY_BYTES": "16"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.split() == ["ok"], out.stderr


def test_rejects_mismatched_sizes() -> None:
    with pytest.raises(RuntimeError, match="dst holds 4 bytes, src 8"):
        _C.copy_bytes(torch.zeros(4, dtype=torch.uint8), torch.zeros(8, dtype=torch.uint8))
