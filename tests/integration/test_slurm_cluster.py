"""`rl slurm` on a real SLURM cluster of its own (tests/slurm_cluster.py): real sbatch, srun,
scontrol, squeue and scancel; three slurmd nodes on this host, each at its own loopback address.

One cluster for the module; one job whose steps are cancelled, and one that trains the tiny model
across the nodes, loses a node's step, is requeued and finishes."""

from __future__ import annotations

import json
import os
import shutil
import sys
import subprocess
import time
from pathlib import Path

import pytest

from conftest import TINY_MODEL, free_port, rl_command
from slurm_cluster import SlurmCluster, missing

pytestmark = pytest.mark.slow

NODES = 3  # n1: the server; n2: trainer rank 0 and the orchestrator; n3: trainer rank 1
POLL_S = 2  # the job script checks its steps this often (slurm.sbatch.j2)
STOP_GRACE_S = 30  # asyncrl.slurm: stop_grace_s
KILL_WAIT_S = 10  # the cluster's KillWait
# A job's run: vLLM's start and a few steps of the tiny model on a loaded 2-core machine.
RUN_TIMEOUT_S = 600


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    why = missing()
    if why is not None:
        if os.geteuid() == 0 and shutil.which("apt-get"):
            pytest.fail(f"{why} (root on Debian: `make install` installs it)")
        pytest.skip(why)
    c = SlurmCluster(tmp_path_factory.mktemp("slurm"), NODES, kill_wait_s=KILL_WAIT_S)
    try:
        c.start()
        yield c
    finally:
        c.stop()
        assert c.job_processes() == []


def config(write_toml, run: Path, max_steps: int) -> tuple[Path, str]:
    """The config, and the name of its server's step on n1."""
    port = free_port()
    return (write_toml(
        f'model = "{TINY_MODEL}"\noutput_dir = "{run}"\nmax_steps = {max_steps}\nseq_len = 64\n'
        f'[inference]\nport = {port}\ndtype = "float32"\n'
        f'[transport]\nkind = "zmq"\naddress = "tcp://127.0.0.1:{free_port()}"\n'
        "[orchestrator.scheduling]\nprompts_per_step = 4\ngroup_size = 4\nmax_in_flight_groups = 8\n"
        "[orchestrator.sampling]\nmax_tokens = 12\n"
        "[checkpoints]\nevery = 2\n[trainer]\ntorch_threads = 1\n"
        "[slurm]\ninference_nodes = 1\ntrainer_nodes = 2\ngpus_per_node = 0\njob_name = \"rl-test\"\n"
        f'rendezvous_port = {free_port()}\ntime_limit = "30:00"\nsetup = ["touch setup-ran"]\n'),
            f"inference-n1-{port}")


def submit(cluster: SlurmCluster, cfg: Path, submit_dir: Path) -> str:
    """`rl slurm --submit` from submit_dir: the real sbatch takes the job (its output lands there)."""
    # The steps run `python`: the job's PATH (sbatch passes the environment on) has this venv first.
    env = {**cluster.env, "PATH": f"{Path(sys.executable).parent}:{cluster.env.get('PATH', os.environ['PATH'])}"}
    out = subprocess.run(rl_command("slurm", "@", str(cfg), "--submit"), capture_output=True, text=True,
                         timeout=180, cwd=submit_dir, env=env)
    assert out.returncode == 0, out.stderr
    job = out.stdout.strip()
    assert job.isdigit() and f"submitted job {job}" in out.stderr, (out.stdout, out.stderr)
    return job


def watch_steps(cluster: SlurmCluster, job: str, names: set[str], timeout_s: float) -> dict[str, list[str]]:
    """squeue's view of the job's steps once every name runs: name -> [step id, node]."""
    deadline = time.monotonic() + timeout_s
    while not names <= set(steps := cluster.steps(job)):
        state = cluster.job(job).get("JobState")
        assert time.monotonic() < deadline and state in ("PENDING", "RUNNING", "CONFIGURING"), \
            f"job {job} {state}; steps {steps}"
        time.sleep(0.5)
    return steps


def records(run: Path, program: str) -> list[int]:
    path = run / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [r["step"] for r in map(json.loads, lines) if r.get("program") == program]


def job_output(submit_dir: Path, run: Path, job: str) -> str:
    text = "".join(p.read_text(errors="replace") for p in submit_dir.glob(f"*-{job}.out"))
    logs = run / "logs"
    for p in sorted(logs.iterdir()) if logs.exists() else []:
        text += f"\n--- {p.name}\n{p.read_text(errors='replace')[-2500:]}"
    return text


def test_scancel_of_a_step_stops_the_rest(cluster, write_toml, tmp_path):
    """A step cancelled by scancel fails the job: every other step is stopped within the
    documented time (the script's check, its stop grace, SLURM's KillWait)."""
    run = tmp_path / "run"
    cfg, server = config(write_toml, run, max_steps=50)
    job = submit(cluster, cfg, tmp_path)
    watch_steps(cluster, job, {server, "orchestrator", "trainer-0", "trainer-1"}, RUN_TIMEOUT_S)
    steps = cluster.steps(job)
    cancelled = time.monotonic()
    cluster.run("scancel", steps["orchestrator"][0])
    bound = POLL_S + STOP_GRACE_S + KILL_WAIT_S + 30  # 30: slurmctld's own rounds on a loaded machine
    state = cluster.wait_state(job, {"FAILED", "COMPLETED", "CANCELLED", "TIMEOUT"}, bound)
    took = time.monotonic() - cancelled
    out = job_output(tmp_path, run, job)
    assert state == "FAILED", out
    assert cluster.job(job)["ExitCode"] == "1:0", out
    assert "step orchestrator exited with code" in out, out
    assert cluster.steps(job) == {}
    # The others were told to stop (SIGTERM), not killed: srun itself, signalled, would SIGKILL
    # its program at once.
    for name in (server, "trainer-0", "trainer-1"):
        log = (run / "logs" / f"{name}.log").read_text()
        assert "task 0: Killed" not in log and "forcing job termination" not in log, f"{name}:\n{log}"
    assert cluster.job_processes_after(KILL_WAIT_S) == [], f"left running {took:.0f} s after scancel"


# pytest-timeout's backstop (600 s) would cut the test's own waits short: two runs, a failure between.
@pytest.mark.timeout(3 * RUN_TIMEOUT_S + 300)
def test_job_trains_across_nodes_and_a_requeued_job_resumes_exactly(cluster, write_toml, tmp_path):
    run = tmp_path / "run"
    max_steps = 8
    cfg, server = config(write_toml, run, max_steps=max_steps)
    job = submit(cluster, cfg, tmp_path)
    steps = watch_steps(cluster, job, {server, "orchestrator", "trainer-0", "trainer-1"}, RUN_TIMEOUT_S)
    # SLURM's view of where each step runs: the layout rl slurm planned.
    assert {n: s[1] for n, s in steps.items()} == {server: "n1", "trainer-0": "n2", "trainer-1": "n3",
                                                    "orchestrator": "n2"}
    # A node's step dies mid-run (the server, SIGKILL): the job fails; requeued, it resumes.
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while len(records(run, "trainer")) < 2:
        assert time.monotonic() < deadline and cluster.job(job).get("JobState") == "RUNNING", \
            job_output(tmp_path, run, job)
        time.sleep(0.5)
    cluster.run("scancel", "--signal=KILL", steps[server][0])
    assert cluster.wait_state(job, {"FAILED", "COMPLETED"}, POLL_S + STOP_GRACE_S + KILL_WAIT_S + 30) == "FAILED"
    first = records(run, "trainer")
    assert len(first) < max_steps, "the run ended before its server was killed"
    cluster.run("scontrol", "requeue", job)
    # SLURM holds a requeued job back for the credentials' lifetime (cred_expire).
    cluster.wait_state(job, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"},
                       RUN_TIMEOUT_S + 2 * cluster.cred_expire_s + 60)
    out = job_output(tmp_path, run, job)
    info = cluster.job(job)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", out
    assert info["Restarts"] == "1", info
    assert (tmp_path / "setup-ran").exists()  # slurm.setup ran, in the submit directory
    # Both attempts' messages are in the job's output file (appended, not truncated by the requeue).
    assert f"step {server} exited with code 137 before the run ended" in out, out
    assert "requeued (restart 1): the trainer resumes" in out
    # Every step's records once: nothing lost, nothing repeated across the two attempts.
    assert records(run, "trainer") == list(range(1, max_steps + 1)), out
    assert sorted(records(run, "orchestrator")) == list(range(1, max_steps + 1)), out
    orchestrator_log = (run / "logs" / "orchestrator.log").read_text()
    assert f"http://{cluster.addrs['n1']}:" in orchestrator_log
    assert cluster.job_processes_after(KILL_WAIT_S) == []

