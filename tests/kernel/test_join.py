"""Unit tests of superkernel.join: which torchrun arguments span hosts, and the command `join` runs."""
from __future__ import annotations

import os
import stat

from superkernel.join import JoinSpec, spans_hosts, torchrun_command
from superkernel.protocol import ConnectionInfo


def test_spans_hosts() -> None:
    assert not spans_hosts([])
    assert not spans_hosts(["--nnodes=1"])
    assert not spans_hosts(["--nnodes", "1"])
    assert spans_hosts(["--nnodes=2"])
    assert spans_hosts(["--nnodes", "1:4"])
    assert spans_hosts(["--rdzv-endpoint=h:1"])


def test_join_file_round_trip_and_command(tmp_path) -> None:
    info = ConnectionInfo("tcp://10.0.0.1:1", "tcp://10.0.0.1:2", "k" * 64, "pool1", 123, "hosta")
    spec = JoinSpec(info, ["--nnodes=2", "--node-rank=0", "--master-addr=10.0.0.1"], 3, "mk")
    path = tmp_path / "join.json"
    spec.write(str(path))
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    back = JoinSpec.read(str(path))
    assert back == spec
    cmd = torchrun_command(back, "/tmp/conn.json", node_rank=1)
    assert "--nproc-per-node=3" in cmd and "--node-rank=1" in cmd and "--node-rank=0" not in cmd
    assert cmd[-5:] == ["superkernel.worker", "--connection-file", "/tmp/conn.json", "--flavor", "torch"]
