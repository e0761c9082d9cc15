"""A real one-node Slurm cluster for the tests: munged, slurmctld and slurmd from Debian's packages, run in
the foreground as children of the test with a private configuration, key, socket and ports under a
temporary directory (nothing in /etc is touched, nothing survives the test). ``run.sh`` installs the
packages when it runs as root; elsewhere the tests that need it skip with the reason."""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

DAEMONS = ("munged", "mungekey", "slurmctld", "slurmd", "srun", "sinfo", "scontrol")


def _which(name: str) -> str | None:
    return shutil.which(name) or next((p for p in (f"/usr/sbin/{name}", f"/usr/bin/{name}") if os.path.exists(p)),
                                      None)


def unavailable_reason() -> str | None:
    missing = [d for d in DAEMONS if _which(d) is None]
    if missing:
        return f"Slurm/munge not installed ({', '.join(missing)} missing; Debian: slurmd slurmctld slurm-client munge)"
    if os.geteuid() != 0:
        return "running a private Slurm cluster needs root (slurmd)"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SlurmCluster:
    """Context manager; ``env`` holds what a client (srun, the kernel) needs: SLURM_CONF."""

    def __init__(self, cpus: int = 8) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="sk-slurm-"))
        self.cpus = cpus
        self.procs: list[subprocess.Popen] = []
        self.env: dict[str, str] = {}

    def __enter__(self) -> "SlurmCluster":
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _spawn(self, argv: list[str]) -> None:
        log = open(self.dir / f"{Path(argv[0]).name}.out", "w")
        self.procs.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                           start_new_session=True))

    def _start(self) -> None:
        d = self.dir
        host = socket.gethostname()
        for sub in ("state", "spool"):
            (d / sub).mkdir()
        key = d / "munge.key"
        subprocess.run([_which("mungekey"), "--create", f"--keyfile={key}"], check=True, capture_output=True)
        key.chmod(0o600)
        sock = d / "munge.sock"
        self._spawn([_which("munged"), "--foreground", "--force", f"--socket={sock}", f"--key-file={key}",
                     f"--pid-file={d / 'munged.pid'}", f"--log-file={d / 'munged.log'}",
                     f"--seed-file={d / 'munged.seed'}"])
        conf = d / "slurm.conf"
        conf.write_text("\n".join([
            "ClusterName=sktest", f"SlurmctldHost={host}", f"SlurmctldPort={_free_port()}",
            f"SlurmdPort={_free_port()}", "AuthType=auth/munge", f"AuthInfo=socket={sock}", "SlurmUser=root",
            "SlurmdUser=root", f"StateSaveLocation={d / 'state'}", f"SlurmdSpoolDir={d / 'spool'}",
            f"SlurmctldPidFile={d / 'slurmctld.pid'}", f"SlurmdPidFile={d / 'slurmd.pid'}",
            f"SlurmctldLogFile={d / 'slurmctld.log'}", f"SlurmdLogFile={d / 'slurmd.log'}",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core", "MpiDefault=none", "ReturnToService=2",
            "SlurmdParameters=config_overrides",  # declare more CPUs than the VM has: 4 ranks on 2 cores
            f"NodeName={host} CPUs={self.cpus} Sockets=1 CoresPerSocket={self.cpus} ThreadsPerCore=1 "
            "RealMemory=4000 State=UNKNOWN",
            f"PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE",
        ]) + "\n")
        self.env = {"SLURM_CONF": str(conf)}
        deadline = time.monotonic() + 10
        while not sock.exists():
            if time.monotonic() > deadline:
                raise RuntimeError(f"munged did not start: {self.logs()}")
            time.sleep(0.05)
        self._spawn([_which("slurmctld"), "-D", "-f", str(conf)])
        self._spawn([_which("slurmd"), "-D", "-f", str(conf)])
        env = dict(os.environ, **self.env)
        deadline = time.monotonic() + 30
        while True:
            out = subprocess.run([_which("sinfo"), "-h", "-o", "%t"], env=env, capture_output=True, text=True)
            state = out.stdout.strip()
            if out.returncode == 0 and state.startswith(("idle", "mix", "alloc")):
                return
            if out.returncode == 0 and state.rstrip("*") in ("down", "drain", "inval"):
                subprocess.run([_which("scontrol"), "update", f"nodename={host}", "state=resume"], env=env,
                               capture_output=True)
            if time.monotonic() > deadline:
                raise RuntimeError(f"the Slurm node is not up after 30 s (sinfo: {state!r}): {self.logs()}")
            time.sleep(0.3)

    def logs(self) -> str:
        parts = []
        for f in sorted(self.dir.glob("*.log")) + sorted(self.dir.glob("*.out")):
            parts.append(f"--- {f.name}\n{f.read_text(errors='replace')[-2000:]}")
        return "\n".join(parts)

    def close(self) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                p.terminate()
        for p in reversed(self.procs):
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=5)
        shutil.rmtree(self.dir, ignore_errors=True)
