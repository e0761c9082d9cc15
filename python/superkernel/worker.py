"""One worker per rank: an IPython shell whose output goes, signed, to the kernel.

Launched by the pool (``torchrun ... -m superkernel.worker --connection-file F --flavor torch``, or under
``mpirun``). Threads:

* main thread: initialises the rank (``torch.distributed`` / MPI), then reads requests (execute, complete,
  inspect, push, pull) from its own socket and runs them in an IPython ``InteractiveShell``.
* control thread: reads the control socket and acts at once on ``interrupt`` (KeyboardInterrupt in the cell
  it names, even one the main thread has not received yet: ``cell_interrupts``) and ``shutdown``, even while a
  cell runs.
  It also sends heartbeats and exits the rank when the kernel process is gone.
* ipykernel's IOPub thread: sends everything (streams, displays, replies) on the PUSH socket, in order.

Output is captured at the file-descriptor level with ipykernel's ``OutStream(watchfd=...)``, so C-level
output and ``!cmd`` are captured too.
"""
from __future__ import annotations

import argparse
import logging
import os
import pickle
import socket
import sys
import threading
import time
from typing import Any

from superkernel import default_group
from superkernel.cell_interrupts import CellInterrupts
from superkernel.protocol import ConnectionInfo, WorkerChannels

log = logging.getLogger("superkernel.worker")

HEARTBEAT_INTERVAL = 0.5
# A rank on another host than the kernel cannot watch the kernel's pid; it exits when the kernel's pings
# (every second) stop for this long.
KERNEL_SILENCE = float(os.environ.get("SUPERKERNEL_KERNEL_SILENCE", "30"))
STREAM_FLUSH_INTERVAL = 0.03


# ---------------------------------------------------------------------------------------------- rank setup


def rank_environment(flavor: str) -> tuple[int, int, int]:
    """(rank, world_size, local_rank) from the launcher's environment: torchrun, Open MPI, or Slurm."""
    env = os.environ
    for r, w, lr in (
        ("RANK", "WORLD_SIZE", "LOCAL_RANK"),
        ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
        ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),
        ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),
    ):
        if r in env and w in env:
            return int(env[r]), int(env[w]), int(env.get(lr, env[r]))
    return 0, 1, 0


def rendezvous_env() -> None:
    """Under srun there is no torchrun to set MASTER_ADDR: rank 0 runs on the first node of the job step
    (Slurm's block distribution), which hosts torch's TCPStore. The kernel chose MASTER_PORT."""
    env = os.environ
    nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
    if "MASTER_ADDR" in env or not nodes or "SLURM_PROCID" not in env:
        return
    import subprocess

    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodes], capture_output=True, text=True, timeout=30)
        first = out.stdout.split()[0] if out.returncode == 0 and out.stdout.split() else nodes.split(",")[0]
    except (OSError, subprocess.TimeoutExpired):
        first = nodes.split(",")[0]
    env["MASTER_ADDR"] = first
    env.setdefault("MASTER_PORT", "29500")


def choose_backend() -> tuple[str, str]:
    """The torch.distributed backend string and a note on why it was chosen.

    ``SUPERKERNEL_BACKEND`` wins. Otherwise ``mk`` when ``import superkernel.backend`` registers it, else
    gloo (with nccl for CUDA tensors when a GPU is present).
    """
    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    forced = os.environ.get("SUPERKERNEL_BACKEND")
    if forced:
        if "mk" in forced:
            _register_mk()
        return forced, "from SUPERKERNEL_BACKEND"
    why = _register_mk()
    if "mk" in dist.Backend.backend_list:
        return ("cpu:mk,cuda:nccl" if cuda else "mk"), "mk backend available"
    return ("cpu:gloo,cuda:nccl" if cuda else "gloo"), f"mk backend not available ({why}); using gloo"


def _register_mk() -> str:
    try:
        from superkernel.backend import register_backend

        register_backend()
        return "registered"
    except Exception as e:  # the C++ extension may be missing in a development tree
        return f"{type(e).__name__}: {e}"


def init_torch(rank: int, world_size: int, local_rank: int) -> dict[str, Any]:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    backend, why = choose_backend()
    rendezvous_env()
    timeout = timedelta(seconds=float(os.environ.get("SUPERKERNEL_DIST_TIMEOUT", "1800")))
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout)
    default_group.remember(default_group.InitArgs(backend, rank, world_size, timeout))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    ns: dict[str, Any] = {
        "torch": torch,
        "dist": dist,
        "rank": rank,
        "local_rank": local_rank,
        "world_size": world_size,
        "device": device,
    }
    try:
        import superkernel.ops as mk_ops  # type: ignore[import-not-found]

        ns["mk"] = mk_ops
    except Exception:
        pass
    log.info("rank %d: torch.distributed backend %s (%s)", rank, backend, why)
    ns["__superkernel_backend__"] = f"{backend} ({why})"
    return ns


def init_mpi() -> dict[str, Any]:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    return {
        "MPI": MPI,
        "comm": comm,
        "rank": comm.Get_rank(),
        "size": comm.Get_size(),
        "world_size": comm.Get_size(),
        "__superkernel_backend__": f"MPI ({MPI.Get_library_version().splitlines()[0].strip()})",
    }


# ------------------------------------------------------------------------------------------------- worker


class Worker:
    def __init__(self, info: ConnectionInfo, flavor: str) -> None:
        self.flavor = flavor
        self.rank, self.world_size, self.local_rank = rank_environment(flavor)
        if flavor == "torch":
            self.namespace = init_torch(self.rank, self.world_size, self.local_rank)
        elif flavor == "mpi":
            self.namespace = init_mpi()
            self.rank, self.world_size = self.namespace["rank"], self.namespace["size"]
        else:
            self.namespace = {"rank": self.rank, "world_size": self.world_size, "local_rank": self.local_rank}
        os.environ.pop("SUPERKERNEL_FRONTEND", None)  # user code in the rank gets the full package
        self.info = info
        self.channels = WorkerChannels(info, self.rank)
        self.session = self.channels.session
        self.cells = CellInterrupts()
        self._kernel_heard = time.monotonic()
        self.stopping = threading.Event()
        self._start_io()
        self._start_shell()

    # -- output capture (ipykernel's machinery) --
    def _start_io(self) -> None:
        from ipykernel.iostream import IOPubThread

        from superkernel.capture import RankOutStream

        self.pub = IOPubThread(self.channels.push)
        self.pub.start()
        sys.stdout.flush()
        sys.stderr.flush()
        self.stdout = RankOutStream(self.session, self.pub, "stdout", watchfd="force")
        self.stderr = RankOutStream(self.session, self.pub, "stderr", watchfd="force")
        for s in (self.stdout, self.stderr):
            s.flush_interval = STREAM_FLUSH_INTERVAL
        sys.stdout, sys.stderr = self.stdout, self.stderr
        # worker logs go to the launcher's stderr (the pool log), not into the user's cell output
        copy = getattr(self.stderr, "_original_stdstream_copy", None)
        if copy is not None:
            log_stream = os.fdopen(os.dup(copy), "w", buffering=1)
            for h in logging.getLogger().handlers:
                if isinstance(h, logging.StreamHandler):
                    h.setStream(log_stream)

    def _start_shell(self) -> None:
        from superkernel.rank_shell import RankShell

        self.shell = RankShell.instance(user_ns=dict(self.namespace))
        self.shell.worker = self
        dh = self.shell.displayhook
        dh.session, dh.pub_socket, dh.topic = self.session, self.pub, b"execute_result"
        dp = self.shell.display_pub
        dp.session, dp.pub_socket, dp.topic = self.session, self.pub, b"display_data"
        from superkernel.magics import rank_side

        rank_side.register(self.shell)

    # -- sending --
    def send(self, msg_type: str, content: dict[str, Any], parent: dict[str, Any] | None = None,
             buffers: list[bytes] | None = None) -> None:
        """Send through the IOPub thread *behind* anything already queued there.

        A stream flush queued on the IOPub thread queues its own send when it runs; building this message in
        the IOPub thread too puts it after that send, so a reply never overtakes the rank's output.
        """
        self.pub.schedule(lambda: self.session.send(self.pub, msg_type, content, parent=parent or {},
                                                    buffers=buffers))

    def hello(self) -> None:
        import platform

        self.send("hello", {
            "rank": self.rank, "world_size": self.world_size, "local_rank": self.local_rank,
            "pid": os.getpid(), "host": socket.gethostname(), "flavor": self.flavor,
            "backend": self.namespace.get("__superkernel_backend__", ""),
            "device": str(self.namespace.get("device", "cpu")), "python": platform.python_version(),
            "pool_id": self.info.pool_id,
        })

    # -- control thread --
    def control_loop(self) -> None:
        last_beat = 0.0
        self._kernel_heard = time.monotonic()
        while not self.stopping.is_set():
            msg = self.channels.recv_request(timeout=0.1, control=True)
            now = time.monotonic()
            if msg is not None:
                self._kernel_heard = now
            if now - last_beat > HEARTBEAT_INTERVAL:
                last_beat = now
                self.send("heartbeat", {"busy": self.cells.running is not None})
                if not self._kernel_alive():
                    log.error("rank %d: kernel process %d on %s is gone; exiting", self.rank, self.info.kernel_pid,
                              self.info.kernel_host)
                    os._exit(3)
            if msg is None:
                continue
            kind = msg["header"]["msg_type"]
            if kind == "ping":
                continue
            if kind == "interrupt_request":
                self.cells.interrupt(msg["content"].get("cell"))
            elif kind == "shutdown_request":
                self.stopping.set()
                if self.cells.interrupt():
                    threading.Timer(2.0, lambda: os._exit(0)).start()

    def _kernel_alive(self) -> bool:
        """False once the kernel process is gone (or a zombie nobody has reaped yet)."""
        if self.info.kernel_host != socket.gethostname():
            return time.monotonic() - self._kernel_heard < KERNEL_SILENCE
        try:
            os.kill(self.info.kernel_pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        try:
            with open(f"/proc/{self.info.kernel_pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
            return state not in ("Z", "X")
        except (OSError, IndexError):
            return True

    # -- main thread --
    def serve(self) -> None:
        self.cells.install()
        threading.Thread(target=self.control_loop, name="superkernel-control", daemon=True).start()
        self.hello()
        handlers = {
            "execute_request": self.do_execute,
            "complete_request": self.do_complete,
            "inspect_request": self.do_inspect,
            "push_request": self.do_push,
            "pull_request": self.do_pull,
        }
        while not self.stopping.is_set():
            try:
                msg = self.channels.recv_request(timeout=0.1)
                if msg is None:
                    continue
                handler = handlers.get(msg["header"]["msg_type"])
                if handler is None:
                    self.send("log", {"text": f"unknown request {msg['header']['msg_type']}"}, msg)
                    continue
                handler(msg)
            except KeyboardInterrupt:
                continue  # (SIGINT is ignored outside cells; this is a request's own KeyboardInterrupt)
        self.flush()
        self.pub.stop()

    def flush(self) -> None:
        """Queue everything this rank printed so far (fd-level output included) ahead of what is sent next.

        Both fds get their sync marker at once; then both streams' flushes are scheduled on the IOPub thread,
        whose queue is FIFO, so a reply sent afterwards cannot overtake them (no need to wait for the sends).
        """
        started = [s for s in (self.stdout, self.stderr) if s.start_sync()]
        for s in started:
            s.wait_sync()
        self.pub.schedule(self.stdout._flush)
        self.pub.schedule(self.stderr._flush)

    def do_execute(self, msg: dict[str, Any]) -> None:
        c = msg["content"]
        shell = self.shell
        shell.set_parent(msg)
        if c.get("execution_count"):
            shell.execution_count = int(c["execution_count"])
        shell.last_error = None
        cell = msg["header"]["msg_id"]
        result = None
        delay = os.environ.get("SUPERKERNEL_TEST_CELL_DELAY_MS")  # tests: an interrupt overtakes the cell
        if delay:
            time.sleep(int(delay) / 1000)
        try:
            try:
                if self.cells.begin(cell):
                    result = shell.run_cell(c["code"], store_history=c.get("store_history", True),
                                            silent=c.get("silent", False))
                else:
                    evalue = f"the cell was interrupted on rank {self.rank} before it started"
                    shell.last_error = {"ename": "KeyboardInterrupt", "evalue": evalue,
                                        "traceback": [f"KeyboardInterrupt: {evalue}"]}
            finally:
                self.cells.end(cell)
        except KeyboardInterrupt:  # outside the user's code (a hook), or as the cell ended
            shell.last_error = {"ename": "KeyboardInterrupt", "evalue": "", "traceback": ["KeyboardInterrupt"]}
            self.cells.end(cell)
        try:
            self.flush()
        except KeyboardInterrupt:
            self.flush()
        reply: dict[str, Any] = {"execution_count": c.get("execution_count") or shell.execution_count - 1}
        err = shell.last_error
        if err is None and result is not None and not result.success:
            e = result.error_in_exec or result.error_before_exec
            err = {"ename": type(e).__name__, "evalue": str(e), "traceback": shell._last_traceback or []}
        if err is not None:
            reply.update(status="error", **err)
        else:
            reply["status"] = "ok"
            reply["user_expressions"] = shell.user_expressions(c.get("user_expressions") or {})
        reply["payload"] = shell.payload_manager.read_payload()
        shell.payload_manager.clear_payload()
        try:  # the kernel makes the default group again on every rank when one says it is aborted
            reply["mk_aborted"] = default_group.aborted_reason()
        except Exception as e:  # (a half-destroyed group): reported, not fatal
            log.warning("rank %d: the default group's state: %s", self.rank, e)
        self.send("execute_reply", reply, msg)

    def do_complete(self, msg: dict[str, Any]) -> None:
        from IPython.core.completer import provisionalcompleter, rectify_completions

        code, pos = msg["content"]["code"], msg["content"].get("cursor_pos")
        pos = len(code) if pos is None else pos
        with provisionalcompleter():
            comps = list(rectify_completions(code, self.shell.Completer.completions(code, pos)))
        start = comps[0].start if comps else pos
        end = comps[0].end if comps else pos
        self.send("complete_reply", {"status": "ok", "matches": [c.text for c in comps], "cursor_start": start,
                                     "cursor_end": end, "metadata": {}}, msg)

    def do_inspect(self, msg: dict[str, Any]) -> None:
        from IPython.utils.tokenutil import token_at_cursor

        c = msg["content"]
        name = token_at_cursor(c["code"], c.get("cursor_pos", len(c["code"])))
        reply: dict[str, Any] = {"status": "ok", "data": {}, "metadata": {}, "found": False}
        try:
            reply["data"] = self.shell.object_inspect_mime(name, detail_level=c.get("detail_level", 0))
            reply["data"].pop("text/html", None)
            reply["found"] = True
        except KeyError:
            pass
        self.send("inspect_reply", reply, msg)

    def do_push(self, msg: dict[str, Any]) -> None:
        try:
            value = pickle.loads(msg["buffers"][0])
            self.shell.user_ns[msg["content"]["name"]] = value
            self.send("push_reply", {"status": "ok"}, msg)
        except Exception as e:
            self.send("push_reply", {"status": "error", "ename": type(e).__name__, "evalue": str(e)}, msg)

    def do_pull(self, msg: dict[str, Any]) -> None:
        name = msg["content"]["name"]
        try:
            value = eval(name, self.shell.user_global_ns, self.shell.user_ns)  # an expression is fine too
            data = pickle.dumps(_without_torch(value), protocol=5)
            self.send("pull_reply", {"status": "ok"}, msg, buffers=[data])
        except Exception as e:
            self.send("pull_reply", {"status": "error", "ename": type(e).__name__, "evalue": str(e)}, msg)


def _without_torch(value: Any) -> Any:
    """Tensors travel as numpy arrays, so the kernel process never needs torch to unpickle them."""
    torch = sys.modules.get("torch")
    if torch is None:
        return value
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy()
    if isinstance(value, (list, tuple)):
        return type(value)(_without_torch(v) for v in value)
    if isinstance(value, dict):
        return {k: _without_torch(v) for k, v in value.items()}
    return value


PIPE_BUF = 4096  # POSIX: a write of at most this many bytes to a pipe is not interleaved with others


def _report_startup_failure(exc: BaseException) -> None:
    """Print why this rank could not start as one write to stderr.

    All ranks share the launcher's pipe; printed line by line, two ranks' tracebacks interleave and the kernel
    can no longer find the cause. Frames are dropped from the middle until the text fits in one atomic write.
    """
    import traceback

    lines = traceback.format_exception(type(exc), exc, exc.__traceback__)
    data = "".join(lines).encode(errors="replace")
    while len(data) > PIPE_BUF and len(lines) > 3:
        del lines[1]
        data = "".join(lines[:1] + ["  ...\n"] + lines[1:]).encode(errors="replace")
    if len(data) > PIPE_BUF:  # a huge message: keep the header (the kernel looks for it) and the end
        head = lines[0].encode()
        data = head + data[len(data) - (PIPE_BUF - len(head)):]
    try:
        sys.stdout.flush()
        sys.stderr.flush()
        os.write(2, data)
    except OSError:
        pass  # stderr is gone: the exit code still says the rank failed


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m superkernel.worker")
    p.add_argument("--connection-file", required=True)
    p.add_argument("--flavor", choices=["torch", "mpi", "plain"], default="torch")
    args = p.parse_args(argv)
    logging.basicConfig(level=os.environ.get("SUPERKERNEL_LOG_LEVEL", "INFO"),
                        format="[superkernel worker %(process)d] %(levelname)s %(message)s", stream=sys.__stderr__)
    info = ConnectionInfo.read(args.connection_file)
    try:
        worker = Worker(info, args.flavor)
    except BaseException as e:
        _report_startup_failure(e)
        os._exit(1)
    try:
        worker.serve()
    finally:
        if args.flavor == "torch":
            import torch.distributed as dist

            if dist.is_initialized():
                try:
                    dist.destroy_process_group()
                except Exception:
                    pass
    os._exit(0)


if __name__ == "__main__":
    main()
