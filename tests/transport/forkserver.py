"""A fork server for the test worlds' ranks (tests/transport/world.py): one process per test session that has
imported torch once (~2.5 s of CPU on the CI machines, most of a rank's start) and forks a rank for each
request, which then runs its script as ``python script.py args`` would, in its own session, with the
environment, argv and stdio the request gives, and exits through the interpreter's normal shutdown.

Nothing of superkernel is imported here, so the extension loads in each rank, after its environment is set.
torch reads no variable the tests set at import; OpenMP's thread count, read by libgomp when it loads, is
applied in the rank from its own OMP_NUM_THREADS.

Protocol (over the socket whose descriptor is argv[1]): each request is one sendmsg of a JSON object {argv, env, cwd}
with three descriptors: the rank's stdout and stderr, and one end of a socketpair that reports to the
requester: "pid <pid>\\n" once forked, then "exit <code>\\n" (a negative code: killed by that signal) once
reaped. The server exits when the requester closes its end of that socket."""
from __future__ import annotations

import array
import json
import os
import runpy
import selectors
import signal
import socket
import sys

import torch  # noqa: F401  (the point: imported once, before any fork)
import torch.distributed  # noqa: F401

MAX_REQUEST = 1 << 20
script_globals: dict = {}


def receive(control: socket.socket) -> tuple[dict, list[int]] | None:
    """One request and its three descriptors; None at EOF."""
    fds = array.array("i")
    msg, ancdata, _flags, _addr = control.recvmsg(MAX_REQUEST, socket.CMSG_LEN(3 * fds.itemsize))
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[:len(data) - len(data) % fds.itemsize])
    if not msg:
        return None
    if len(fds) != 3:
        raise RuntimeError(f"forkserver: request with {len(fds)} descriptors, expected 3")
    return json.loads(msg), list(fds)


def become_rank(request: dict, stdout: int, stderr: int) -> int:
    """In the forked child: take the request's stdio, session, environment and argv, run the script as
    __main__, and return its exit code (what `python script.py` would exit with)."""
    os.setsid()
    devnull = os.open(os.devnull, os.O_RDONLY)
    for fd, target in ((devnull, 0), (stdout, 1), (stderr, 2)):
        os.dup2(fd, target)
        os.close(fd)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD):
        signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    threads = os.environ.get("OMP_NUM_THREADS")
    if threads and threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))
    script = request["argv"][0]
    try:
        open(script, "rb").close()
    except OSError as e:  # as the interpreter says it
        print(f"{sys.executable}: can't open file {os.path.abspath(script)!r}: [Errno {e.errno}] {e.strerror}",
              file=sys.stderr)
        return 2
    sys.argv = list(request["argv"])
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    global script_globals
    try:
        # (kept until the interpreter's shutdown, as a script's module is: atexit handlers run before it goes)
        script_globals = runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        if e.code is None:
            return 0
        if isinstance(e.code, int):
            return e.code
        print(e.code, file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # as the interpreter does: the traceback, then death by SIGINT
        sys.excepthook(*sys.exc_info())
        sys.stderr.flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        return 1
    except BaseException:  # what the interpreter prints for an uncaught exception, and its exit code
        sys.excepthook(*sys.exc_info())
        return 1
    return 0


def serve(control: socket.socket) -> int | None:
    """Serve requests until the requester goes away (returns None), or, in a forked child, return its exit
    code once its script has run."""
    sel = selectors.DefaultSelector()
    sel.register(control, selectors.EVENT_READ)
    children: dict[int, tuple[int, socket.socket]] = {}  # pidfd -> (pid, report socket)
    while True:
        for key, _ in sel.select():
            if key.fileobj is control:
                got = receive(control)
                if got is None:
                    return None
                request, (stdout, stderr, report_fd) = got
                report = socket.socket(fileno=report_fd)
                pid = os.fork()
                if pid == 0:
                    sel.close()
                    control.close()
                    report.close()
                    for pidfd, (_, other) in children.items():
                        os.close(pidfd)
                        other.close()
                    return become_rank(request, stdout, stderr)
                os.close(stdout)
                os.close(stderr)
                pidfd = os.pidfd_open(pid)
                children[pidfd] = (pid, report)
                sel.register(pidfd, selectors.EVENT_READ)
                report.sendall(f"pid {pid}\n".encode())
            else:
                pidfd = key.fd
                pid, report = children.pop(pidfd)
                sel.unregister(pidfd)
                os.close(pidfd)
                _, status = os.waitpid(pid, 0)
                try:
                    report.sendall(f"exit {os.waitstatus_to_exitcode(status)}\n".encode())
                except OSError:
                    pass  # the requester stopped listening
                report.close()


def main() -> int:
    code = serve(socket.socket(fileno=int(sys.argv[1])))
    return 0 if code is None else code


if __name__ == "__main__":
    sys.exit(main())
