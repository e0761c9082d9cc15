"""Two "hosts" on one machine: two network namespaces joined by a veth pair, for multi-host tests and benches.

Each host is a network namespace (``sk-<pid>-<seq>-a`` / ``-b``) with ``lo`` up and one veth end named
``eth0`` carrying an address of a private /24 that exists only inside the two namespaces (default
10.231.7.1 and 10.231.7.2). Commands run in a host through ``ip netns exec`` plus ``unshare --uts``, so
each host also has its own hostname, resolvable in both hosts through ``/etc/netns/<ns>/hosts`` (which
``ip netns exec`` mounts over /etc/hosts for the command only). Nothing is added to the machine's own
network namespace: all traffic of a job targets the two namespace addresses or loopback.

Each host also gets its own /dev/shm (``/dev/shm/<ns>`` of the machine, bind-mounted over /dev/shm in the
command's private mount namespace; ``private_shm=False`` shares the machine's), so shared memory cannot
silently connect the two hosts; a test can look for leaked segments in ``host.shm_dir``. What is still
shared: the pid namespace (``process_vm_readv`` across hosts would work), the boot id, the file system.

Optionally the link is shaped in both directions with ``tc ... tbf rate <rate>`` (e.g. "1gbit"), with a peak
rate just above it, so that it never carries more than its rate (see TwoHosts.__enter__).

Cleanup is guaranteed as far as a process can: the context manager, an ``atexit`` hook, and at every new
creation the removal of namespaces left behind by dead processes (their pid is part of the name). Deleting a
namespace deletes its veth end, and the peer end with it.

Usage (as root):

    from tests.netns.hosts import TwoHosts, run_torch_job, unavailable_reason   # repo root on sys.path
    # (or, from a test module under tests/:  from ..netns.hosts import ...)

    with TwoHosts(rate="1gbit") as hosts:
        results = run_torch_job(hosts, "script.py", ["--arg"], nproc_per_host=2, timeout=120)
        for r in results:
            print(r.host, r.returncode, r.stdout)
"""
from __future__ import annotations

import atexit
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

PREFIX = "sk"
NETNS_ETC = Path("/etc/netns")
SHM_ROOT = Path("/dev/shm")  # private /dev/shm of host X: /dev/shm/<netns of X>
IFNAME = "eth0"
DEFAULT_SUBNET = "10.231.7"  # a /24 that only ever exists inside the two namespaces
CMD_TIMEOUT = 30.0  # seconds for each `ip`/`tc` administration command
_NAME_RE = re.compile(rf"^{PREFIX}-(\d+)-(\d+)-[ab]$")
_seq = itertools.count()
_live: list[TwoHosts] = []
_live_lock = threading.Lock()


class NetnsError(RuntimeError):
    """An administration command (`ip`, `tc`) failed; the message names the command and its stderr."""


def _admin(argv: Sequence[str], timeout: float = CMD_TIMEOUT, check: bool = True) -> subprocess.CompletedProcess:
    try:
        proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired as e:
        raise NetnsError(f"`{' '.join(argv)}` did not finish within {timeout:.0f} s") from e
    except FileNotFoundError as e:
        raise NetnsError(f"`{argv[0]}` not found: {e}") from e
    if check and proc.returncode != 0:
        raise NetnsError(f"`{' '.join(argv)}` failed (exit {proc.returncode}): {proc.stderr.strip()}")
    return proc


def unavailable_reason() -> str | None:
    """Why two hosts cannot be made here (not root, no `ip`/`unshare`, namespaces refused), or None."""
    if os.geteuid() != 0:
        return f"network namespaces need root (euid {os.geteuid()})"
    for tool in ("ip", "unshare", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` not found (Debian: iproute2 / util-linux)"
    probe = f"{PREFIX}-{os.getpid()}-probe"
    try:
        _admin(["ip", "netns", "add", probe])
    except NetnsError as e:
        return f"cannot create a network namespace: {e}"
    _admin(["ip", "netns", "del", probe], check=False)
    return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cleanup_stale() -> list[str]:
    """Delete namespaces (and their /etc/netns entries) of this harness whose creating process is dead."""
    removed: list[str] = []
    listing = _admin(["ip", "netns", "list"], check=False).stdout
    names = {line.split()[0] for line in listing.splitlines() if line.strip()}
    for root in (NETNS_ETC, SHM_ROOT):
        if root.is_dir():
            names |= {p.name for p in root.iterdir()}
    for name in sorted(names):
        m = _NAME_RE.match(name)
        if m and not _pid_alive(int(m.group(1))):
            _admin(["ip", "netns", "del", name], check=False)
            shutil.rmtree(NETNS_ETC / name, ignore_errors=True)
            shutil.rmtree(SHM_ROOT / name, ignore_errors=True)
            removed.append(name)
    return removed


def parse_rate(rate: str) -> int:
    """tc-style rate ("10gbit", "100mbit", "500kbit", "1000000bit") in bits per second."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmg]?)bit\s*", rate.lower())
    if not m:
        raise ValueError(f"rate {rate!r}: expected a number followed by bit, kbit, mbit or gbit")
    return int(float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)])


_ENTER = 'hostname "$0" && { [ -z "$1" ] || mount --bind "$1" /dev/shm; } && shift && exec "$@"'


@dataclass(frozen=True)
class NetnsHost:
    netns: str
    hostname: str
    address: str
    ifname: str = IFNAME
    shm_dir: Path | None = None  # this host's /dev/shm (a directory of the machine's /dev/shm), if private

    def argv(self, argv: Sequence[str]) -> list[str]:
        """``argv`` wrapped to run inside this host: its network namespace, its own hostname and, when
        ``shm_dir`` is set, its own /dev/shm (bind-mounted in the command's private mount namespace)."""
        return ["ip", "netns", "exec", self.netns, "unshare", "--uts", "--",
                "sh", "-c", _ENTER, self.hostname, str(self.shm_dir or ""), *argv]

    def run(self, argv: Sequence[str], timeout: float, env: Mapping[str, str] | None = None,
            check: bool = False) -> subprocess.CompletedProcess:
        """Run a command in this host and capture its output (text); raises TimeoutExpired on timeout."""
        proc = subprocess.run(self.argv(argv), capture_output=True, text=True, timeout=timeout,
                              env=dict(env) if env is not None else None, check=False)
        if check and proc.returncode != 0:
            raise NetnsError(f"on {self.hostname}: `{' '.join(argv)}` failed (exit {proc.returncode}): "
                             f"{proc.stderr.strip()}")
        return proc

    def operstate(self) -> str:
        return _admin(["ip", "netns", "exec", self.netns, "cat",
                       f"/sys/class/net/{self.ifname}/operstate"]).stdout.strip()

    def link_bytes(self) -> tuple[int, int]:
        """(rx_bytes, tx_bytes) of this host's veth end."""
        out = _admin(["ip", "netns", "exec", self.netns, "sh", "-c",
                      f"cat /sys/class/net/{self.ifname}/statistics/rx_bytes "
                      f"/sys/class/net/{self.ifname}/statistics/tx_bytes"]).stdout.split()
        return int(out[0]), int(out[1])


@dataclass
class ProcResult:
    host: str  # hostname of the host it ran on
    argv: list[str]
    returncode: int | None  # None: killed at the timeout
    stdout: str
    stderr: str
    timed_out: bool
    seconds: float

    def describe(self) -> str:
        status = "timed out" if self.timed_out else f"exit {self.returncode}"
        return (f"--- {self.host}: {status} after {self.seconds:.1f} s: {' '.join(self.argv)}\n"
                f"--- stdout:\n{self.stdout}\n--- stderr:\n{self.stderr}")


PEAK_BUCKET_BYTES = 70000  # tbf's peak bucket: the largest packet veth hands it (64 KiB of GSO data + headers)


@dataclass(eq=False)
class TwoHosts:
    """Context manager: two namespace hosts ``a`` (x.x.x.1) and ``b`` (x.x.x.2) joined by a veth pair."""

    rate: str | None = None  # tbf rate in each direction, e.g. "1gbit"; None: unshaped
    subnet: str = DEFAULT_SUBNET  # first three octets of the private /24
    mtu: int | None = None
    private_shm: bool = True  # each host sees its own /dev/shm, as separate machines would
    a: NetnsHost = field(init=False)
    b: NetnsHost = field(init=False)
    _procs: list[subprocess.Popen] = field(init=False, default_factory=list)
    _created: list[str] = field(init=False, default_factory=list)
    _closed: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        if not re.fullmatch(r"(10\.\d{1,3}\.\d{1,3})|(192\.168\.\d{1,3})|(172\.(1[6-9]|2\d|3[01])\.\d{1,3})",
                            self.subnet):
            raise ValueError(f"subnet {self.subnet!r}: give the first three octets of a private /24")
        if self.rate is not None:
            parse_rate(self.rate)  # fail before anything is created
        base = f"{PREFIX}-{os.getpid()}-{next(_seq)}"
        shm = (lambda name: SHM_ROOT / name) if self.private_shm else (lambda name: None)
        self.a = NetnsHost(f"{base}-a", f"{base}-a", f"{self.subnet}.1", shm_dir=shm(f"{base}-a"))
        self.b = NetnsHost(f"{base}-b", f"{base}-b", f"{self.subnet}.2", shm_dir=shm(f"{base}-b"))

    @property
    def hosts(self) -> tuple[NetnsHost, NetnsHost]:
        return self.a, self.b

    def __enter__(self) -> TwoHosts:
        reason = unavailable_reason()
        if reason:
            raise NetnsError(reason)
        cleanup_stale()
        with _live_lock:
            _live.append(self)
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _create(self) -> None:
        a, b = self.a, self.b
        for h in (a, b):
            _admin(["ip", "netns", "add", h.netns])
            self._created.append(h.netns)
            if h.shm_dir is not None:
                h.shm_dir.mkdir(mode=0o1777)
                h.shm_dir.chmod(0o1777)
            etc = NETNS_ETC / h.netns
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(
                f"127.0.0.1 localhost\n::1 localhost\n{a.address} {a.hostname}\n{b.address} {b.hostname}\n",
                encoding="utf-8")
        # Both ends are created directly inside their namespaces: nothing appears in the machine's namespace.
        _admin(["ip", "link", "add", a.ifname, "netns", a.netns, "type", "veth",
                "peer", "name", b.ifname, "netns", b.netns])
        for h in (a, b):
            _admin(["ip", "-n", h.netns, "link", "set", "lo", "up"])
            _admin(["ip", "-n", h.netns, "addr", "add", f"{h.address}/24", "dev", h.ifname])
            if self.mtu:
                _admin(["ip", "-n", h.netns, "link", "set", h.ifname, "mtu", str(self.mtu)])
            _admin(["ip", "-n", h.netns, "link", "set", h.ifname, "up"])
            if self.rate:
                bps = parse_rate(self.rate)
                burst = max(64 << 10, int(bps / 8 * 0.004))  # >= 4 ms of traffic: enough for HZ=250 timers
                # The peak bucket (one packet: veth's GSO packets are up to 64 KiB, plus headers) refilled at
                # 1% over the rate: after an idle spell the full main bucket no longer lets its 4 ms of traffic
                # through at memory speed. Without it a 256 KiB allgather between the hosts took 0.38 ms
                # after 10 ms of idle link (5.5 Gbit/s on a "1 Gbit/s" link), with it 2.06 (its 2.1 ms of
                # wire time; bench/README.md).
                _admin(["ip", "netns", "exec", h.netns, "tc", "qdisc", "add", "dev", h.ifname, "root", "tbf",
                        "rate", self.rate, "burst", str(burst), "latency", "50ms",
                        "peakrate", str(int(bps * 1.01)), "mtu", str(PEAK_BUCKET_BYTES)])
        # veth comes up asynchronously: wait until both ends report operstate "up".
        deadline = time.monotonic() + 10
        while not all(h.operstate() == "up" for h in (a, b)):
            if time.monotonic() > deadline:
                raise NetnsError(f"veth {a.ifname} of {a.netns}/{b.netns} not up after 10 s")
            time.sleep(0.05)

    def spawn(self, host: NetnsHost, argv: Sequence[str], env: Mapping[str, str] | None,
              stdout: object, stderr: object) -> subprocess.Popen:
        """Start ``argv`` in ``host`` in a new session; it is killed (with its descendants) at close()."""
        proc = subprocess.Popen(host.argv(argv), env=dict(env) if env is not None else None,
                                stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr, start_new_session=True)
        self._procs.append(proc)
        return proc

    def run_parallel(self, jobs: Sequence[tuple[NetnsHost, Sequence[str], Mapping[str, str] | None]],
                     timeout: float) -> list[ProcResult]:
        """Run one command per (host, argv, env) concurrently; wait at most ``timeout`` seconds for all.

        At the timeout every unfinished command is killed with all its descendants (SIGTERM, then SIGKILL
        after 5 s) and reported with ``timed_out=True``. Outputs go through temporary files, so a chatty
        process cannot block on a full pipe.
        """
        t0 = time.monotonic()
        started: list[tuple[NetnsHost, list[str], subprocess.Popen, object, object]] = []
        try:
            for host, argv, env in jobs:
                out = tempfile.TemporaryFile(mode="w+", encoding="utf-8", errors="replace")
                err = tempfile.TemporaryFile(mode="w+", encoding="utf-8", errors="replace")
                started.append((host, list(argv), self.spawn(host, argv, env, out, err), out, err))
            deadline = t0 + timeout
            results: list[ProcResult] = []
            for host, argv, proc, out, err in started:
                timed_out = False
                try:
                    proc.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    timed_out = True
                    kill_tree(proc)
                results.append(ProcResult(host.hostname, argv, None if timed_out else proc.returncode,
                                          _read(out), _read(err), timed_out, time.monotonic() - t0))
            return results
        finally:
            for _, _, proc, out, err in started:
                if proc.poll() is None:
                    kill_tree(proc)
                out.close()
                err.close()

    def close(self) -> None:
        """Kill what was spawned, delete both namespaces and their /etc/netns entries. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for proc in self._procs:
            if proc.poll() is None:
                kill_tree(proc)
        problems = []
        for name in self._created:
            r = _admin(["ip", "netns", "del", name], check=False)
            if r.returncode != 0 and "No such file" not in r.stderr:
                problems.append(f"ip netns del {name}: {r.stderr.strip()}")
        for h in (self.a, self.b):
            shutil.rmtree(NETNS_ETC / h.netns, ignore_errors=True)
            if h.shm_dir is not None and h.netns in self._created:
                shutil.rmtree(h.shm_dir, ignore_errors=True)
        try:
            NETNS_ETC.rmdir()  # only when empty: other users' entries stay
        except OSError:
            pass
        with _live_lock:
            if self in _live:
                _live.remove(self)
        if problems:
            raise NetnsError("; ".join(problems))


def _read(f: object) -> str:
    f.flush()  # type: ignore[attr-defined]
    f.seek(0)  # type: ignore[attr-defined]
    return f.read()  # type: ignore[attr-defined]


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(")") + 2:].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def kill_tree(proc: subprocess.Popen, grace: float = 5.0) -> None:
    """SIGTERM ``proc``, its process group and all its descendants (torchrun puts workers in sessions of their
    own); SIGKILL whatever is left after ``grace`` seconds; reap ``proc``."""
    pids = [proc.pid, *_descendants(proc.pid)]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
        pids = [p for p in pids if _pid_alive(p) and not _is_zombie(p)]
        if not pids and proc.poll() is not None:
            return
    proc.wait(timeout=grace)


def _is_zombie(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat[stat.rindex(")") + 2] == "Z"


RDZV_MODES = ("static", "c10d")


def torchrun_argv(script: str, script_args: Sequence[str], nnodes: int, node_rank: int, nproc_per_node: int,
                  master_addr: str, master_port: int, python: str = sys.executable, rdzv: str = "static",
                  run_id: str = "sk-netns") -> list[str]:
    """torchrun for one node of an ``nnodes``-node job.

    static: ``--node-rank`` fixed, TCPStore of node 0 at ``master_addr:master_port``.
    c10d: torchrun's dynamic rendezvous at ``master_addr:master_port`` (node ranks in order of arrival; the
    node whose address is the endpoint hosts the store).
    """
    common = [python, "-m", "torch.distributed.run", f"--nnodes={nnodes}", f"--nproc-per-node={nproc_per_node}"]
    if rdzv == "static":
        return [*common, f"--node-rank={node_rank}", f"--master-addr={master_addr}",
                f"--master-port={master_port}", script, *script_args]
    if rdzv == "c10d":
        return [*common, "--rdzv-backend=c10d", f"--rdzv-endpoint={master_addr}:{master_port}",
                f"--rdzv-id={run_id}", script, *script_args]
    raise ValueError(f"rdzv {rdzv!r}: choose one of {RDZV_MODES}")


_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE",
                "SUPERKERNEL_HOST_ID")  # an inherited host id would make the two hosts one


def job_env(host: NetnsHost, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The caller's environment minus any launcher variables, with Gloo and mk bound to the host's veth."""
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS and not k.startswith("OMPI_")}
    env["GLOO_SOCKET_IFNAME"] = host.ifname
    env["SUPERKERNEL_SOCKET_IFNAME"] = host.ifname  # mk's TCP listen interface
    env.update(extra or {})
    return env


def run_torch_job(hosts: TwoHosts, script: str, script_args: Sequence[str] = (), nproc_per_host: int = 2,
                  timeout: float = 120.0, env: Mapping[str, str] | None = None, master_port: int = 29500,
                  python: str = sys.executable, rdzv: str = "static",
                  host_env: Sequence[Mapping[str, str]] = ()) -> list[ProcResult]:
    """Run ``script`` as one torch job of 2 × ``nproc_per_host`` ranks: torchrun in each host, rendezvous at
    host a's veth address. With ``rdzv="static"`` host a is node 0 (ranks 0..n-1) and host b node 1; with
    ``"c10d"`` torchrun's dynamic rendezvous assigns the node ranks. Returns one ProcResult per host (a
    first). ``env`` adds variables for both hosts, ``host_env`` (a's, b's) for one of them."""
    jobs = []
    for node_rank, host in enumerate(hosts.hosts):
        argv = torchrun_argv(script, script_args, 2, node_rank, nproc_per_host, hosts.a.address, master_port,
                             python, rdzv, run_id=f"{hosts.a.netns}-job")
        own = host_env[node_rank] if node_rank < len(host_env) else {}
        jobs.append((host, argv, job_env(host, {**(env or {}), **own})))
    return hosts.run_parallel(jobs, timeout)


def run_mpi_job(hosts: TwoHosts, argv: Sequence[str], workdir: Path, nproc_per_host: int = 1,
                timeout: float = 120.0, env: Mapping[str, str] | None = None,
                mpirun_args: Sequence[str] = ()) -> ProcResult:
    """Run ``argv`` as one Open MPI job of 2 × ``nproc_per_host`` ranks: mpirun in host a, which starts
    host b's daemon through an rsh agent (written into ``workdir``) that enters host b as ``NetnsHost.argv``
    does, where ssh would log in to a real host. Open MPI's control and TCP traffic is bound to the veth.
    ``env`` adds variables for every rank (exported with -x); ``mpirun_args`` go before the command."""
    agent = workdir / "netns-rsh"
    # (mpirun runs in host a's mount namespace, whose /dev/shm hides host b's directory: the agent goes back
    # to this process's mount namespace before it enters host b)
    prefixes = {h.hostname: ["nsenter", f"--mount=/proc/{os.getpid()}/ns/mnt", "--", *h.argv([])]
                for h in hosts.hosts}
    agent.write_text(
        f"#!{sys.executable}\n"
        "# Open MPI's rsh agent for two namespace hosts: <host> <command line> -> the line run in that host\n"
        "import os, sys\n"
        f"prefixes = {prefixes!r}\n"
        "host, line = sys.argv[1], ' '.join(sys.argv[2:])\n"
        "if host not in prefixes:\n"
        "    sys.exit(f'netns-rsh: unknown host {host!r} (known: {sorted(prefixes)})')\n"
        "argv = prefixes[host] + ['sh', '-c', line]\n"
        "os.execvp(argv[0], argv)\n", encoding="utf-8")
    agent.chmod(0o755)
    extra = {"GLOO_SOCKET_IFNAME": IFNAME, "SUPERKERNEL_SOCKET_IFNAME": IFNAME, **(env or {})}
    cmd = ["mpirun", "--allow-run-as-root", "--host",
           ",".join(f"{h.hostname}:{nproc_per_host}" for h in hosts.hosts), "-np", str(2 * nproc_per_host),
           "--mca", "plm_rsh_agent", str(agent), "--mca", "plm_rsh_no_tree_spawn", "1",
           "--mca", "oob_tcp_if_include", IFNAME, "--mca", "btl_tcp_if_include", IFNAME,
           "--mca", "btl", "self,vader,tcp"]
    for k in extra:
        cmd += ["-x", k]
    cmd += [*mpirun_args, *argv]
    return hosts.run_parallel([(hosts.a, cmd, job_env(hosts.a, extra))], timeout)[0]


@atexit.register
def _close_all() -> None:
    with _live_lock:
        live = list(_live)
    for hosts in live:
        try:
            hosts.close()
        except Exception as e:  # noqa: BLE001 - report, keep cleaning the others
            print(f"netns cleanup: {e}", file=sys.stderr)


def rank_reports(results: Sequence[ProcResult], per_host: int) -> list[dict]:
    """The JSON objects of the 'REPORT ' lines of a two-host job (one per rank); fails with the host's output
    when a host did not print ``per_host`` of them."""
    reps: list[dict] = []
    for res in results:
        found = [json.loads(line[len("REPORT "):]) for line in res.stdout.splitlines() if line.startswith("REPORT ")]
        assert len(found) == per_host, (f"host {res.host} exit {res.returncode} timed_out={res.timed_out}\n"
                                        f"{res.stdout[-2000:]}\n{res.stderr[-4000:]}")
        reps.extend(found)
    return reps


def route_problems(rep: dict, per_host: int) -> list[str]:
    """Where a rank's reported ``transports`` differ from the two-host layout: shm to the ranks of its own
    host, tcp to the other host's."""
    r = rep["rank"]
    problems = []
    for peer, t in enumerate(rep["transports"]):
        want = "self" if peer == r else ("shm" if peer // per_host == r // per_host else "tcp")
        if t != want:
            problems.append(f"rank {r} reaches rank {peer} over {t}, expected {want}")
    return problems
