"""A rank that cannot start prints its traceback in one piece, even while other ranks print theirs."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

from superkernel.worker import PIPE_BUF

# Each child fails 80 frames deep, as a rank does inside init_process_group, and reports it the way the
# worker does. All children share one pipe, like the ranks under a launcher.
CHILD = textwrap.dedent("""
    import sys
    import time
    from superkernel.worker import _report_startup_failure

    def dive(n, tag):  # two alternating functions, so Python does not fold the frames into one line
        if n == 0:
            raise RuntimeError(f"rank {tag} could not start: " + "x" * int(sys.argv[2]))
        dive_too(n - 1, tag)

    def dive_too(n, tag):
        dive(n, tag)

    try:
        dive(int(sys.argv[3]), sys.argv[1])
    except RuntimeError as e:
        time.sleep(max(0.0, float(sys.argv[4]) - time.time()))  # all children report at the same moment
        _report_startup_failure(e)
""")


def run_children(n: int, message_len: int, depth: int) -> str:
    """Start n failing children at once on one shared pipe; return everything they wrote."""
    r, w = os.pipe()
    start_at = time.time() + 3.0  # after every child has imported superkernel
    with os.fdopen(r, "rb") as reader:
        try:
            procs = [subprocess.Popen([sys.executable, "-c", CHILD, str(i), str(message_len), str(depth),
                                       str(start_at)],
                                      stdout=w, stderr=w) for i in range(n)]
        finally:
            os.close(w)
        text = reader.read().decode()
    for p in procs:
        assert p.wait(timeout=60) == 0
    return text


def blocks(text: str) -> list[list[str]]:
    """Tracebacks as the kernel finds them: from the header to the first unindented line."""
    lines = text.splitlines()
    found = []
    for i, line in enumerate(lines):
        if line.startswith("Traceback (most recent call last)"):
            block = [line]
            for nxt in lines[i + 1:]:
                block.append(nxt)
                if nxt and not nxt[0].isspace():
                    break
            found.append(block)
    return found


def test_concurrent_tracebacks_do_not_interleave():
    n = 4
    for _ in range(2):
        text = run_children(n, 10, 40)
        found = blocks(text)
        assert len(found) == n, text
        tags = set()
        for block in found:
            last = block[-1]
            assert last.startswith("RuntimeError: rank "), block
            tags.add(last.split()[2])
            frames = [b for b in block if b.lstrip().startswith("File ")]
            assert len(frames) == 82, block  # <string> module, 41 calls of each dive: nothing from another child
            assert all(not b.startswith("Traceback") for b in block[1:])
        assert tags == {str(i) for i in range(n)}


def test_a_long_traceback_is_shortened_to_one_atomic_write():
    text = run_children(1, 10, 400)
    assert len(text.encode()) <= PIPE_BUF
    (block,) = blocks(text)
    assert block[-1].startswith("RuntimeError: rank 0 could not start")
    assert "  ..." in block
    assert 0 < sum(b.lstrip().startswith("File ") for b in block) < 400


def test_a_huge_message_keeps_the_header_and_the_end():
    text = run_children(1, 3 * PIPE_BUF, 5)
    assert len(text.encode()) <= PIPE_BUF
    assert text.startswith("Traceback (most recent call last)")
    assert text.rstrip().endswith("x" * 100)


def test_the_report_is_a_single_write(monkeypatch):
    """The guarantee behind the tests above, checked directly: one write() of at most PIPE_BUF bytes to fd 2."""
    import superkernel.worker as worker

    writes: list[tuple[int, bytes]] = []
    monkeypatch.setattr(worker.os, "write", lambda fd, data: writes.append((fd, bytes(data))) or len(data))
    try:
        raise ValueError("Unknown backend type bogus")
    except ValueError as e:
        worker._report_startup_failure(e)
    assert len(writes) == 1
    fd, data = writes[0]
    assert fd == 2 and len(data) <= PIPE_BUF
    assert data.startswith(b"Traceback (most recent call last)")
    assert data.rstrip().endswith(b"ValueError: Unknown backend type bogus")
