"""A real SLURM cluster of its own on this machine: munged, slurmctld and several slurmd.

Debian's slurm-wlm (22.05) is built with MULTIPLE_SLURMD, so `slurmd -N NAME` runs one node per
daemon on one host. Each node gets a loopback address of its own (NodeAddr 127.0.0.2x): a
program bound to one node's address is not reachable at another's, as on separate hosts.
Everything (munge key and socket, config, state, spool, logs) lives in one directory; nothing
of the machine's own munge or slurm is used. The cluster name is unique, so the processes of
its jobs are found by their SLURM_CLUSTER_NAME and nothing else is touched.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from conftest import free_port

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "squeue", "scancel")


def missing() -> str | None:
    """Why no cluster can start here, or None."""
    for name in DAEMONS:
        if shutil.which(name) is None and not Path(f"/usr/sbin/{name}").exists():
            return f"{name} not found: `make install` installs slurm-wlm (Debian, as root)"
    if os.geteuid() != 0:
        return "the test cluster's daemons run as root (SlurmUser=root); not root here"
    return None


def _which(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


class SlurmCluster:
    """`nodes` slurmd daemons n1..nN, one partition; `env` is what sbatch/srun/squeue need."""

    def __init__(self, root: Path, nodes: int, cpus: int = 2, memory_mb: int = 4096,
                 kill_wait_s: int = 10, cred_expire_s: int = 30):
        self.root, self.cpus, self.memory_mb, self.kill_wait_s = root, cpus, memory_mb, kill_wait_s
        self.cred_expire_s = cred_expire_s
        self.name = f"asyncrl{os.getpid() % 100000}x{time.monotonic_ns() % 100000}"
        self.nodes = [f"n{i + 1}" for i in range(nodes)]
        self.addrs = {n: f"127.0.0.{21 + i}" for i, n in enumerate(self.nodes)}
        self.conf = root / "slurm.conf"
        self.procs: list[subprocess.Popen] = []
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        for key in [k for k in self.env if k.startswith(("SLURM_", "SBATCH_", "SRUN_"))]:
            if key != "SLURM_CONF":
                del self.env[key]

    # --- start -----------------------------------------------------------------------------------

    def start(self, timeout_s: float = 60) -> None:
        (self.root / "state").mkdir(parents=True)
        for n in self.nodes:
            (self.root / "spool" / n).mkdir(parents=True)
        self._munge()
        self._write_conf()
        self._daemon([_which("slurmctld"), "-D", "-f", str(self.conf)], "slurmctld")
        for n in self.nodes:
            self._daemon([_which("slurmd"), "-D", "-N", n, "-f", str(self.conf)], f"slurmd-{n}")
        deadline = time.monotonic() + timeout_s
        while (idle := self.idle_nodes()) != set(self.nodes):
            if time.monotonic() > deadline:
                raise RuntimeError(f"slurm nodes not idle after {timeout_s:.0f} s (idle: {sorted(idle)}); "
                                   f"logs in {self.root}:\n{self.log('slurmctld')[-3000:]}")
            for p in self.procs:
                if p.poll() is not None:
                    raise RuntimeError(f"{p.args[0]} exited with code {p.returncode}; logs in {self.root}")
            time.sleep(0.5)

    def _munge(self) -> None:
        key = self.root / "munge.key"
        key.write_bytes(os.urandom(128))
        key.chmod(0o400)
        self.socket = self.root / "munge.socket"
        self._daemon([_which("munged"), "-F", "--force", f"--socket={self.socket}", f"--key-file={key}",
                      f"--pid-file={self.root / 'munged.pid'}", f"--log-file={self.root / 'munged.log'}",
                      f"--seed-file={self.root / 'munged.seed'}"], "munged")
        deadline = time.monotonic() + 30
        while not self.socket.exists():
            if time.monotonic() > deadline or self.procs[-1].poll() is not None:
                raise RuntimeError(f"munged did not start: {(self.root / 'munged.log').read_text()[-2000:]}")
            time.sleep(0.1)

    def _write_conf(self) -> None:
        r = self.root
        lines = [
            f"ClusterName={self.name}",
            f"SlurmctldHost={socket.gethostname()}(127.0.0.1)",
            f"SlurmctldPort={free_port()}",
            "SlurmUser=root", "SlurmdUser=root",
            # cred_expire (120 s by default) is also how long SLURM holds a requeued job back:
            # until then slurmd refuses its new credential ("Job credential revoked").
            "AuthType=auth/munge", "CredType=cred/munge",
            f"AuthInfo=socket={self.socket},cred_expire={self.cred_expire_s}",
            f"StateSaveLocation={r / 'state'}", f"SlurmdSpoolDir={r / 'spool'}/%n",
            f"SlurmctldPidFile={r / 'slurmctld.pid'}", f"SlurmdPidFile={r / 'slurmd-%n.pid'}",
            f"SlurmctldLogFile={r / 'slurmctld.log'}", f"SlurmdLogFile={r / 'slurmd-%n.log'}",
            "SlurmctldDebug=info", "SlurmdDebug=info",
            # The machine's processes are not confined (no cgroup plugin): tasks are found by
            # their parent process, as on a cluster without cgroups.
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
            # Memory is a consumable, as on most clusters: a step asking for none gets all of it.
            "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core_Memory",
            "SlurmdParameters=config_overrides",
            "SchedulerType=sched/backfill", "MpiDefault=none", "ReturnToService=2",
            "JobAcctGatherType=jobacct_gather/linux", "JobAcctGatherFrequency=30",
            "AccountingStorageType=accounting_storage/none",
            f"JobCompType=jobcomp/filetxt", f"JobCompLoc={r / 'jobcomp.txt'}",
            f"KillWait={self.kill_wait_s}", "InactiveLimit=0", "MinJobAge=300",
            "SlurmdTimeout=60", "MessageTimeout=30",
        ]
        for i, n in enumerate(self.nodes):
            lines.append(f"NodeName={n} NodeAddr={self.addrs[n]} NodeHostname={socket.gethostname()} "
                         f"Port={free_port()} CPUs={self.cpus} RealMemory={self.memory_mb} State=UNKNOWN")
        lines.append(f"PartitionName=main Nodes={','.join(self.nodes)} Default=YES MaxTime=INFINITE State=UP")
        self.conf.write_text("\n".join(lines) + "\n")

    def _daemon(self, argv: list[str], name: str) -> None:
        out = open(self.root / f"{name}.stdout", "w")
        self.procs.append(subprocess.Popen(argv, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                           stdin=subprocess.DEVNULL, start_new_session=True))

    # --- use -------------------------------------------------------------------------------------

    def run(self, *argv: str, timeout: float = 60, check: bool = True, **kw) -> subprocess.CompletedProcess:
        out = subprocess.run(list(argv), env={**self.env, **kw.pop("env", {})}, capture_output=True,
                             text=True, timeout=timeout, **kw)
        if check and out.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)}: exit {out.returncode}: {out.stderr.strip()}")
        return out

    def idle_nodes(self) -> set[str]:
        out = self.run("sinfo", "-h", "-N", "-o", "%N %t", check=False)
        return {n for n, state in (line.split() for line in out.stdout.splitlines()) if state == "idle"}

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job` as key=value pairs ({} once the controller forgot it)."""
        out = self.run("scontrol", "show", "job", "-o", job_id, check=False)
        return dict(f.split("=", 1) for f in out.stdout.split() if "=" in f) if out.returncode == 0 else {}

    def steps(self, job_id: str) -> dict[str, list[str]]:
        """The job's running steps but its batch script: step name -> [step id, nodes]."""
        out = self.run("squeue", "-h", "-s", "-j", job_id, "-o", "%i %j %N", check=False)
        return {name: [sid, nodes] for sid, name, nodes in
                (line.split() for line in out.stdout.splitlines() if len(line.split()) == 3)
                if not sid.endswith(".batch")}

    def wait_state(self, job_id: str, states: set[str], timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while (state := self.job(job_id).get("JobState", "GONE")) not in states:
            if time.monotonic() > deadline:
                raise AssertionError(f"job {job_id} still {state} after {timeout_s:.0f} s, not {states}")
            time.sleep(1)
        return state

    def job_processes(self) -> list[int]:
        """Pids of processes started for this cluster's jobs (their environment names it)."""
        mark = f"SLURM_CLUSTER_NAME={self.name}".encode()
        pids = []
        for d in Path("/proc").iterdir():
            if not d.name.isdigit():
                continue
            try:
                if mark in (d / "environ").read_bytes().split(b"\0"):
                    pids.append(int(d.name))
            except OSError:
                continue
        return pids

    def job_processes_after(self, wait_s: float) -> list[int]:
        """job_processes() once none is left, or after wait_s (SLURM reaps a step's processes
        asynchronously, up to KillWait after its end)."""
        deadline = time.monotonic() + wait_s
        while (pids := self.job_processes()) and time.monotonic() < deadline:
            time.sleep(0.5)
        return pids

    def log(self, name: str) -> str:
        path = self.root / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    # --- stop ------------------------------------------------------------------------------------

    def stop(self) -> None:
        self.run("scancel", "--full", "-u", "root", check=False)
        deadline = time.monotonic() + self.kill_wait_s + 30
        while self.job_processes() and time.monotonic() < deadline:
            time.sleep(0.5)
        for pid in self.job_processes():  # this cluster's job processes only
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for p in reversed(self.procs):  # slurmd, slurmctld, then munged
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
