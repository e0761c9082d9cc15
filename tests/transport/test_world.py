"""The test worlds' launcher (world.py): a rank forked by the fork server starts as a new interpreter would, so
the suites' ranks behave the same either way: the same argv, __main__, environment, thread count, session,
sys.path, working directory, stdin, exit codes, uncaught exceptions and kills; only a random draw differs (it
differs between ranks too)."""
from __future__ import annotations

import os
import subprocess

import pytest

from tests.transport.world import HERE, ForkedRank, collect, start_world

MODES = ["forked", "new interpreter"]


@pytest.fixture(params=MODES)
def mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("SUPERKERNEL_TEST_FORKSERVER", "1" if request.param == "forked" else "0")
    return request.param


def launch(mode: str, args: list[str], env: dict[str, str] | None = None, n: int = 3, timeout: float = 60):
    procs = start_world(n, "world_probe.py", args, env=env)
    assert all(isinstance(p, ForkedRank) == (mode == "forked") for p in procs), [type(p) for p in procs]
    return collect(procs, timeout)


def test_a_rank_sees_what_a_new_interpreter_would(mode: str) -> None:
    results = launch(mode, ["ok", "--flag"], env={"PROBE_VALUE": "x y", "OMP_NUM_THREADS": "2"})
    draws = set()
    for r, res in enumerate(results):
        assert res.returncode == 0, res.stderr
        rep = res.report()
        assert rep["argv"] == [str(HERE / "world_probe.py"), "ok", "--flag"] and rep["name"] == "__main__", rep
        assert rep["rank"] == str(r) and rep["probe"] == "x y" and rep["threads"] == 2, rep
        assert rep["sid_is_pid"] and rep["path0"] == str(HERE) and rep["cwd"] == os.getcwd(), rep
        assert rep["stdin"] == "" and not rep["superkernel_loaded"], rep
        assert f"stderr of rank {r}" in res.stderr
        draws.add(rep["draw"])
    assert len(draws) == len(results), "ranks share their random state"


def test_the_thread_count_is_the_ranks_own(mode: str) -> None:
    results = launch(mode, ["ok"], env={"OMP_NUM_THREADS": "1"}, n=1)
    assert results[0].report()["threads"] == 1


@pytest.mark.parametrize("args,code", [(["code", "3"], 3), (["code", "0"], 0), (["raise"], 1)])
def test_exit_codes_and_uncaught_exceptions(mode: str, args: list[str], code: int) -> None:
    for res in launch(mode, args, n=2):
        assert res.returncode == code, (res.returncode, res.stderr)
        if args == ["raise"]:
            assert "Traceback (most recent call last)" in res.stderr
            assert "ValueError: raised by world_probe" in res.stderr, res.stderr


def test_a_script_that_is_not_there(mode: str) -> None:
    procs = start_world(2, "no_such_script.py", [])
    for res in collect(procs, 60):
        assert res.returncode == 2 and "can't open file" in res.stderr and "no_such_script.py" in res.stderr, res


def test_ranks_past_the_deadline_are_killed(mode: str) -> None:
    # long enough for a new interpreter to import torch and report on a loaded machine (seen taking over 4 s)
    results = launch(mode, ["hang"], n=2, timeout=8)
    for res in results:
        assert res.returncode == -9, res.returncode
        assert "killed after the 8s timeout" in res.stderr
        assert res.report()["rank"] == str(res.rank)  # what it printed before is kept


def test_a_variable_read_before_the_script_runs_starts_a_new_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SUPERKERNEL_TEST_FORKSERVER", "1")
    procs = start_world(2, "world_probe.py", ["ok"], env={"PYTHONHASHSEED": "7"})
    assert all(isinstance(p, subprocess.Popen) for p in procs)
    assert all(r.returncode == 0 for r in collect(procs, 60))
