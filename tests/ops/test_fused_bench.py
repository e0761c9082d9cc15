"""bench/fused_ops.py runs end to end (every case family, tiny shapes, two timed rounds) on a 2-rank local
mk world, prints its table and writes JSON in which every variant was timed. The benchmark is how the fused
ops' speed is claimed, so a change that breaks it (a case factory, the baseline, the machine-CPU column)
must fail here, not in the next measurement session. It asserts nothing about speed."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.transport.world import free_port

ROOT = Path(__file__).resolve().parents[2]
KINDS = ("fused", "fused_again", "unfused", "unfused_again", "compute", "comm", "both")


def run_bench(tmp: Path, tag: str, families: str, shapes: str, blocks: int, extra: tuple[str, ...] = ()) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
            str(ROOT / "bench" / "fused_ops.py"), "--families", families, "--shapes", shapes,
            "--time", "0.01", "--min-iters", "2", "--max-iters", "2", "--blocks", str(blocks), "--machine-cpu",
            "--out-dir", str(tmp), "--tag", tag, *extra]
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert "unwaited collective" not in proc.stderr, proc.stderr[-3000:]
    assert "A/A =" in proc.stdout, proc.stdout[-3000:]
    assert "fused/cpu bound" in proc.stdout and "# cpu bound = max(ideal, " in proc.stdout, proc.stdout[-3000:]
    assert "speedup 95% CI" in proc.stdout and "slower than unfused beyond noise (CI below 1): " in proc.stdout, \
        proc.stdout[-3000:]
    assert (tmp / f"fused-{tag}.png").stat().st_size > 0
    return json.loads((tmp / f"fused-{tag}.json").read_text(encoding="utf-8"))


@pytest.mark.parametrize("families,shapes,ops,blocks,pin", [
    ("gemm,attention,train", "32x16x24,1x4x2x16x8",
     {"allgather_gemm", "gemm_allreduce", "gemm_reducescatter", "ring_attention"}, 1, False),
    ("moe", "64x16x24x2x2", {"moe_dispatch_gemm", "moe_combine"}, 2, True),
], ids=["gemm-attention-train", "moe-2-blocks-pinned"])
def test_every_family_runs(tmp_path: Path, families: str, shapes: str, ops: set[str], blocks: int, pin: bool) -> None:
    """(--pin: each rank runs on one CPU, rank r on the r-th of those this process may use, modulo their
    count; the JSON records every rank's CPUs)"""
    # (the settle, a busy wait before every timed call, is what bench/netns.py passes on shaped links)
    doc = run_bench(tmp_path, families.replace(",", "-"), families, shapes, blocks,
                    ("--pin",) if pin else ("--settle-ms", "0.5"))
    mine = sorted(os.sched_getaffinity(0))
    want = [[mine[r % len(mine)]] for r in range(2)] if pin else [mine, mine]
    assert doc["meta"]["cpus_by_rank"] == want, doc["meta"]
    assert ("pinned" in doc["meta"]["hosts_desc"]) == pin, doc["meta"]
    rows = doc["results"]
    assert {r["family"] for r in rows} == set(families.split(",")), rows
    assert {r["op"] for r in rows} == ops, rows
    assert any("fwd+bwd" in r["shape"] for r in rows) == ("train" in families), rows
    for r in rows:
        for kind in KINDS:
            assert r[f"{kind}_ms"] > 0, (r["op"], r["shape"], kind)
            assert r[f"{kind}_cpu"] >= 0, (r["op"], r["shape"], kind)
        # every block times each pass for --min-iters rounds (2 here), and the rows pool them
        assert r["iters"] == 2 * blocks and r["iters_bounds"] == 2 * blocks, r
        assert r["ideal_ms"] == max(r["compute_ms"], r["comm_ms"])
        cpus = doc["meta"]["machine_cpus"]
        assert cpus == os.cpu_count(), doc["meta"]
        assert r["cpu_bound_ms"] == max(r["ideal_ms"], (r["compute_cpu"] + r["comm_cpu"]) * 1e3 / cpus), r
        assert len(r["fused_ideal_by_block"]) == blocks and all(v > 0 for v in r["fused_ideal_by_block"]), r
        lo, hi = r["speedup_ci95"]  # (over the pair pass's rounds: 2 per block here)
        assert 0 < lo <= hi, r


@pytest.mark.parametrize("backend", ["mk", "gloo"])
def test_op_entry_bench_runs(tmp_path: Path, backend: str) -> None:
    """bench/op_entry.py (the fused ops' call cost through the eager entry, the former OpOverload path and
    unfused) runs on 2 ranks, checks that the three give the same result, prints its table and writes JSON. On
    mk over TCP with --carry, also without carrying the payload in the agreement (no-carry)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
            str(ROOT / "bench" / "op_entry.py"), "--backend", backend, "--shapes", "8x8x8", "--calls", "5",
            "--rounds", "3", "--out-dir", str(tmp_path)]
    names = {"entry", "overload", "unfused"}
    if backend == "mk":
        argv.append("--carry")
        env["SUPERKERNEL_TRANSPORT"] = "tcp"
        names.add("no-carry")
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert "overload/entry" in proc.stdout, proc.stdout[-3000:]
    (path,) = tmp_path.glob(f"op-entry-2r-{backend}-*.json")
    rows = json.loads(path.read_text(encoding="utf-8"))["rows"]
    assert {r["op"] for r in rows} == {"allgather_gemm", "gemm_allreduce", "gemm_reducescatter"}
    for r in rows:
        for timing in ("loop_us", "barrier_us"):
            assert set(r[timing]) == names and all(v > 0 for v in r[timing].values()), r


@pytest.mark.parametrize("settle", ["spin", "sleep"])
def test_gather_paths_bench_runs(tmp_path: Path, settle: str) -> None:
    """bench/gather_paths.py (allgather_gemm's paths against unfused and its parts) runs on 2 ranks of mk over
    TCP, prints every variant's median and writes it to JSON."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SUPERKERNEL_TRANSPORT": "tcp"}
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
            str(ROOT / "bench" / "gather_paths.py"), "--shape", "24x8x16", "--rounds", "3", "--warmup", "2",
            "--settle-ms", "0.5", "--out-dir", str(tmp_path), "--tag", settle]
    if settle == "sleep":
        argv.append("--settle-sleep")
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    doc = json.loads((tmp_path / f"gather-paths-{settle}.json").read_text(encoding="utf-8"))
    assert doc["settle_sleep"] == (settle == "sleep"), doc
    want = {"unfused", "tiny+unfused", "plain", "ring1", "ring2", "automatic", "product", "allgather",
            "allgather+sleep+product"}
    assert set(doc["median_ms"]) == want and all(v > 0 for v in doc["median_ms"].values()), doc
    for name in want:
        assert f"{name:>24} |" in proc.stdout, proc.stdout[-3000:]


def test_exchange_channel_bench_runs(tmp_path: Path) -> None:
    """bench/exchange_channel.py (a small exchange through Gloo or through its own TCP connections, received on
    the calling thread or on a helper thread, before gemm_allreduce's unfused composition) runs on 2 Gloo ranks,
    prints every variant and writes them to JSON."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
            str(ROOT / "bench" / "exchange_channel.py"), "--shape", "24x8x16", "--rounds", "3", "--warmup", "2",
            "--settle-ms", "0.5", "--out-dir", str(tmp_path), "--tag", "t"]
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    doc = json.loads((tmp_path / "exchange-channel-t.json").read_text(encoding="utf-8"))
    want = {"unfused", "gloo-allreduce+unfused", "gloo-sendrecv+unfused", "socket+unfused", "socket-overlap",
            "thread+unfused", "thread-overlap", "fused-1", "fused-auto", "product", "allreduce"}
    assert doc["backend"] == "gloo" and set(doc["stats"]) == want, doc
    assert all(v["median_ms"] > 0 and v["p75_ms"] >= v["median_ms"] for v in doc["stats"].values()), doc
    for name in want:
        assert f"{name:>24} |" in proc.stdout, proc.stdout[-3000:]


def test_exchange_channel_refuses_a_connection_without_the_token() -> None:
    """The benchmark's own connections: a connection that presents another token is closed and the wait goes
    on; the one with the token (and an expected rank) is accepted."""
    import socket
    import threading

    from bench import exchange_channel as ec  # (it puts bench/ on sys.path for its own imports)

    token = bytes(range(ec.TOKEN_BYTES))
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(4)
        listener.settimeout(10)
        port = listener.getsockname()[1]
        got: dict = {}
        t = threading.Thread(target=lambda: got.update(peer=ec.accept_peer(listener, token, {1})))
        t.start()
        bad = socket.create_connection(("127.0.0.1", port))
        bad.sendall(bytes(ec.TOKEN_BYTES) + (1).to_bytes(4, "little"))
        assert bad.recv(1) == b"", "a connection with the wrong token was kept open"
        good = socket.create_connection(("127.0.0.1", port))
        good.sendall(token + (1).to_bytes(4, "little"))
        t.join(10)
        rank, conn = got["peer"]
        assert rank == 1
        conn.sendall(b"x")
        assert good.recv(1) == b"x"
        for c in (bad, good, conn):
            c.close()


@pytest.mark.parametrize("seconds,sleep", [(0.002, False), (0.002, True), (0.0, False)])
def test_settled_start_waits_for_every_rank_before_the_settle(monkeypatch: pytest.MonkeyPatch, seconds: float,
                                                              sleep: bool) -> None:
    """The settle starts only after a barrier: a rank that finished its call first must not spin on cores
    the other rank's call still needs (the namespace hosts share them). With no settle, one barrier."""
    from bench import fused_ops  # (it puts bench/ on sys.path for its own imports)
    events: list[str] = []

    class Dist:
        def barrier(self) -> None:
            events.append("barrier")

    def settle(s: float, asleep: bool = False) -> None:
        events.append(f"settle {s} {asleep}")

    monkeypatch.setattr(fused_ops, "settle", settle)
    fused_ops.settled_start(Dist(), seconds, sleep)
    assert events == (["barrier", f"settle {seconds} {sleep}", "barrier"] if seconds > 0 else ["barrier"])


def test_exchange_channel_receiver_reports_each_exchange_and_the_peer_gone(monkeypatch: pytest.MonkeyPatch) -> None:
    """The helper thread of the thread variants: wait() returns once every peer's message came, times out
    naming the ranks when none comes, and raises naming the rank whose connection ended."""
    import socket

    from bench import exchange_channel as ec

    mine, theirs = socket.socketpair()
    try:
        receiver = ec.Receiver({1: mine})
        theirs.sendall(bytes(ec.EXCHANGE_BYTES))
        receiver.wait()
        monkeypatch.setattr(ec, "SOCKET_TIMEOUT_S", 0.2)
        with pytest.raises(TimeoutError, match=r"ranks \[1\]"):
            receiver.wait()
        theirs.sendall(bytes(ec.EXCHANGE_BYTES // 2))  # half a message, then the peer goes
        theirs.close()
        monkeypatch.setattr(ec, "SOCKET_TIMEOUT_S", 10.0)
        with pytest.raises(ConnectionError, match="rank 1's connection ended"):
            receiver.wait()
    finally:
        mine.close()
        theirs.close()
