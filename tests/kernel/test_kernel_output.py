"""The merged cell output of a 2-rank torch kernel: collapse, order, results, errors, rich output, magics."""
from __future__ import annotations

import re

from conftest import labelled


def test_identical_lines_collapse_and_rank_lines_keep_order(kernel2):
    r = kernel2.ok("print('same')\nfor i in range(3): print(f'r{rank} line {i}')\nprint('same end')")
    out = r.stream().splitlines()
    assert out[0] == "[ranks 0,1] same"
    assert out[-1] == "[ranks 0,1] same end"
    for rank in (0, 1):
        mine = [l.split("]")[-1].strip() if l.startswith("[") else l.strip() for l in out[1:-1]]
        assert [l for l in mine if l.startswith(f"r{rank} ")] == [f"r{rank} line {i}" for i in range(3)]
    assert any(l.startswith("[rank 0] r0 line") for l in out) and any(l.startswith("[rank 1] r1 line") for l in out)


def test_streams_arrive_live(kernel2):
    """Output printed early in a long cell is shown while the cell still runs (collapsed across ranks)."""
    r = kernel2.ok("import time\nprint('early', flush=True)\ntime.sleep(1.5)\nprint('late')")
    streams = [m for m in r.msgs if m["msg_type"] == "stream"]
    assert labelled("".join(m["content"]["text"] for m in streams)) == [("[ranks 0,1]", "early"),
                                                                       ("[ranks 0,1]", "late")]
    assert "early" in streams[0]["content"]["text"] and streams[0]["arrived"] < 0.5, streams
    assert "late" not in streams[0]["content"]["text"] and streams[-1]["arrived"] > 1.4


def test_no_line_lost_or_reordered_within_a_rank(kernel2):
    kernel2.ok("%output raw --max-lines 0")
    try:
        # !cmd output is ordered with print(); a bare os.system() is only ordered at the end of the cell
        # (its fd output goes through a pipe and a watcher thread, as in ipykernel)
        r = kernel2.ok("for i in range(3000):\n    print(f'r{rank} {i}')\n"
                       "    if i % 1000 == 999:\n        !echo r{rank} shell{i}")
    finally:
        kernel2.ok("%output collapse --max-lines 1000")
    per_rank: dict[str, list[str]] = {"[rank 0]": [], "[rank 1]": []}
    for label, line in labelled(r.stream()):
        per_rank[label].append(line)
    for rank in (0, 1):
        expected = []
        for i in range(3000):
            expected.append(f"r{rank} {i}")
            if i % 1000 == 999:
                expected.append(f"r{rank} shell{i}")
        assert per_rank[f"[rank {rank}]"] == expected


def test_one_execute_result_collapsed_or_listed(kernel2):
    assert kernel2.ok("6*7").result == "[ranks 0,1] 42"
    assert kernel2.ok("rank * 10").result == "[rank 0] 0\n[rank 1] 10"


def test_all_reduce_in_a_cell(kernel2):
    r = kernel2.ok("t = torch.ones(4) * (rank + 1)\ndist.all_reduce(t)\nt.tolist()")
    assert r.result == "[ranks 0,1] [3.0, 3.0, 3.0, 3.0]"


def test_one_error_grouping_identical_tracebacks_and_reply_status_error(kernel2):
    r = kernel2.run("1/0")
    assert r.status == "error"
    assert len(r.errors) == 1
    err = r.errors[0]
    assert err["ename"] == "ZeroDivisionError"
    assert err["evalue"].startswith("[ranks 0,1]")
    assert sum("[ranks 0,1] ZeroDivisionError" in l for l in err["traceback"]) == 1
    assert r.reply["ename"] == "ZeroDivisionError"


def test_error_on_one_rank_only_fails_the_cell(kernel2):
    r = kernel2.run("if rank == 1:\n    raise ValueError('bad shard')\nprint('fine')")
    assert r.status == "error"
    assert "[rank 0] fine" in r.stream()
    assert r.errors[0]["evalue"].startswith("[rank 1] bad shard")


def test_fd_level_output_is_captured(kernel2):
    r = kernel2.ok("import os, ctypes\nos.system('echo from-shell')\nlibc = ctypes.CDLL(None)\n"
                   "libc.printf(b'from-c\\n'); libc.fflush(None)")
    assert labelled(r.stream()) == [("[ranks 0,1]", "from-shell"), ("[ranks 0,1]", "from-c")]


def test_shell_escape_and_magics(kernel2):
    r = kernel2.ok("!hostname\n%hostname")
    lines = labelled(r.stream())
    assert len(lines) == 2 and all(label == "[ranks 0,1]" for label, _ in lines)
    info = kernel2.ok("%info").stream()
    assert "world size 2" in info and re.search(r"\b1\s+1\s+\S+\s+\d+\s+cpu", info)
    bar = kernel2.ok("%barrier 10").stream()
    assert "median" in bar and " all " in bar


def test_rich_output_forwarded_with_rank(kernel2):
    r = kernel2.ok("from IPython.display import HTML, display\ndisplay(HTML(f'<b>{rank}</b>'))")
    shown = r.of_type("display_data")
    assert sorted(d["metadata"]["superkernel"]["rank"] for d in shown) == [0, 1]
    assert {d["data"]["text/html"] for d in shown} == {"<b>0</b>", "<b>1</b>"}


def test_identical_rich_output_collapses_and_keeps_its_place(kernel2):
    r = kernel2.ok("from IPython.display import HTML, display\nprint('before')\ndisplay(HTML('<i>same</i>'))\n"
                   "print('after')")
    shown = r.of_type("display_data")
    assert len(shown) == 1 and shown[0]["metadata"]["superkernel"]["ranks"] == [0, 1]
    order = [(m["msg_type"], m["content"].get("text", "")) for m in r.msgs
             if m["msg_type"] in ("stream", "display_data")]
    text_before = "".join(t for _, t in order[:[k for k, _ in order].index("display_data")])
    assert "before" in text_before and "after" not in text_before


def test_matplotlib_inline_png(kernel2):
    r = kernel2.ok("%matplotlib inline\nimport matplotlib.pyplot as plt\nplt.plot([0, rank]); plt.show()")
    pngs = [d for d in r.of_type("display_data") if "image/png" in d["data"]]
    assert len(pngs) == 2  # different plots: one per rank
    r = kernel2.ok("plt.plot([0, 1]); plt.show()")
    pngs = [d for d in r.of_type("display_data") if "image/png" in d["data"]]
    assert len(pngs) == 1 and pngs[0]["metadata"]["superkernel"]["ranks"] == [0, 1]  # the same plot: once


def test_progress_lines_update_in_place(kernel2):
    r = kernel2.ok("from tqdm import tqdm\nimport time\nfor i in tqdm(range(20)): time.sleep(0.01)")
    assert "it/s" not in r.stream("stderr")  # not a flood of \r lines in the stream
    shown = r.of_type("display_data")
    assert len(shown) == 2  # one progress line per rank ...
    ids = {d["transient"]["display_id"] for d in shown}
    updates = r.of_type("update_display_data")
    assert updates and {u["transient"]["display_id"] for u in updates} <= ids  # ... updated in place
    final = {u["data"]["text/plain"] for u in updates if "20/20" in u["data"]["text/plain"]}
    assert any(t.startswith("[rank 0]") for t in final) and any(t.startswith("[rank 1]") for t in final)


def test_line_cap_and_output_modes(kernel2):
    kernel2.ok("%output --max-lines 5")
    r = kernel2.ok("for i in range(50): print(i)")
    lines = r.stream().splitlines()
    assert [l.removeprefix("[ranks 0,1]").strip() for l in lines[:5]] == [str(i) for i in range(5)]
    assert lines[0] == "[ranks 0,1] 0"
    assert lines[-1].strip().startswith("… 45 more lines from ranks 0,1")
    kernel2.ok("%output raw --max-lines 1000")
    # raw: every rank's line with its own label, in arrival order
    assert sorted(kernel2.ok("print('x')").stream().splitlines()) == ["[rank 0] x", "[rank 1] x"]
    kernel2.ok("%output collapse")
    assert kernel2.ok("print('x')").stream() == "[ranks 0,1] x\n"


def test_rank_subset_and_collective_warning(kernel2):
    r = kernel2.ok("%%rank 1\nprint('only', rank)")
    assert r.stream() == "[rank 1] only 1\n"
    r = kernel2.ok("%%rank 0\nif False:\n    dist.all_reduce(torch.ones(1))")
    assert "calls a collective (dist.all_reduce)" in r.stream("stderr")
    r = kernel2.run("%%rank 5\npass")
    assert r.status == "error" and "rank 5 does not exist" in r.errors[0]["evalue"]


def test_local_push_pull_scatter_gather(kernel2):
    kernel2.ok("%%local\ndata = list(range(10))\nscale = 3")
    kernel2.ok("%push scale\n%scatter data")
    r = kernel2.ok("print(rank, data, scale)")
    assert sorted(labelled(r.stream())) == [("[rank 0]", "0 [0, 1, 2, 3, 4] 3"), ("[rank 1]", "1 [5, 6, 7, 8, 9] 3")]
    kernel2.ok("data = [x * scale for x in data]\nt = torch.arange(2) + rank")
    kernel2.ok("%gather data\n%pull t\n%pull rank --rank 1")
    r = kernel2.ok("%%local\nprint(data)\nprint(type(t[0]).__name__, [x.tolist() for x in t])\nprint(rank)\n"
                   "import sys; print('torch' in sys.modules)")
    assert r.stream().splitlines() == [str([x * 3 for x in range(10)]), "ndarray [[0, 1], [1, 2]]", "1", "False"]
    r = kernel2.run("%pull nothing_here")
    assert r.status == "error" and "rank 0" in r.errors[0]["evalue"]


def test_completion_and_inspection_from_rank_zero(kernel2):
    kernel2.ok("only_on_rank0_variable = 1 if rank == 0 else None\nif rank: del only_on_rank0_variable")
    msg_id = kernel2.kc.complete("only_on_ran", 11)
    reply = kernel2.kc.get_shell_msg(timeout=10)
    assert reply["parent_header"]["msg_id"] == msg_id
    assert "only_on_rank0_variable" in reply["content"]["matches"]
    kernel2.kc.inspect("world_size", 10)
    reply = kernel2.kc.get_shell_msg(timeout=10)
    assert reply["content"]["found"] and "int" in reply["content"]["data"]["text/plain"]


def test_pip_on_all_ranks_keeps_the_pool(kernel2):
    r = kernel2.ok("%pip install --no-index --no-deps tqdm", timeout=300)
    assert "Requirement already satisfied" in r.stream() or "already satisfied" in r.stream().lower()
    assert kernel2.ok("world_size + rank - rank").result == "[ranks 0,1] 2"


def test_timeout_interrupts_and_keeps_namespace(kernel2):
    kernel2.ok("kept = 'still here'")
    kernel2.ok("%timeout 1")
    r = kernel2.run("import time\ntime.sleep(30)")
    kernel2.ok("%timeout off")
    assert r.status == "error" and r.elapsed < 4
    assert r.reply["ename"] == "CellTimeout" and "%timeout of 1 s" in r.reply["evalue"]
    assert kernel2.ok("kept").result == "[ranks 0,1] 'still here'"


def test_interrupt_sleep_on_every_rank_within_one_second(kernel2):
    import time

    kernel2.ok("before = rank + 100")
    msg_id = kernel2.execute("import time\ntime.sleep(100)")
    time.sleep(1.0)  # the cell is running on every rank
    t0 = time.monotonic()
    kernel2.km.interrupt_kernel()
    r = kernel2.collect(msg_id, timeout=30, t0=t0)
    assert r.elapsed < 1.0, r.elapsed
    assert r.status == "error" and r.reply["ename"] == "KeyboardInterrupt"
    assert "[ranks 0,1]" in r.reply["evalue"]
    assert kernel2.ok("before").result == "[rank 0] 100\n[rank 1] 101"


def test_interrupt_a_local_cell(kernel2):
    import time

    msg_id = kernel2.execute("%%local\nimport time\nlocal_before = 1\ntime.sleep(100)")
    time.sleep(1.0)
    t0 = time.monotonic()
    kernel2.km.interrupt_kernel()
    r = kernel2.collect(msg_id, timeout=30, t0=t0)
    assert r.elapsed < 1.0 and r.status == "error" and r.reply["ename"] == "KeyboardInterrupt"
    assert kernel2.ok("%%local\nlocal_before").result == "1"
    assert kernel2.ok("rank").result == "[rank 0] 0\n[rank 1] 1"


def test_sigint_to_the_kernel_process_interrupts_the_ranks(kernel2):
    """Front ends that interrupt with a signal (interrupt_mode "signal") instead of a message."""
    import signal
    import time

    msg_id = kernel2.execute("import time\ntime.sleep(100)")
    time.sleep(1.0)
    t0 = time.monotonic()
    kernel2.km.signal_kernel(signal.SIGINT)
    r = kernel2.collect(msg_id, timeout=30, t0=t0)
    assert r.elapsed < 1.0 and r.reply["ename"] == "KeyboardInterrupt"
    assert kernel2.ok("1").result == "[ranks 0,1] 1"


def test_an_interrupt_that_overtakes_the_cell_still_ends_it(kernel2):
    """The interrupt reaches rank 1 before rank 1 has taken the cell off its socket (a 1.5 s test delay there
    stands in for a main thread that is slow to get to it): the cell ends with KeyboardInterrupt on both ranks,
    without starting on rank 1, and the pool and the namespaces are kept."""
    import time

    pids = kernel2.ok("import os\nos.getpid()").result
    kernel2.ok("%%rank 1\nos.environ['SUPERKERNEL_TEST_CELL_DELAY_MS'] = '1500'")
    try:
        msg_id = kernel2.execute("import time\nprint('started')\ntime.sleep(100)")
        time.sleep(0.5)  # rank 0 runs the cell; rank 1 has not started it
        t0 = time.monotonic()
        kernel2.km.interrupt_kernel()
        r = kernel2.collect(msg_id, timeout=30, t0=t0)
    finally:
        kernel2.ok("%%rank 1\nos.environ.pop('SUPERKERNEL_TEST_CELL_DELAY_MS')")
    assert r.status == "error" and r.reply["ename"] == "KeyboardInterrupt", r.reply
    assert "interrupted on rank 1 before it started" in "\n".join(r.errors[0]["traceback"]), r.errors
    assert labelled(r.stream()) == [("[rank 0]", "started")], r.stream()
    assert r.elapsed < 2.5, r.elapsed  # rank 1's delay, not the interrupt grace and a SIGTERM
    assert kernel2.ok("os.getpid()").result == pids
