"""`rl slurm`: the sbatch script it renders, run by bash on a fake cluster.

`scontrol`, `srun` and `scancel` are shims first in PATH, for what a real cluster on one 2-core
machine cannot be made to do: a layout of 4 nodes with 4 GPUs and 2 servers each, a step failing
on cue. The fake srun runs its command locally in a session of its own (killed whole when the step
ends, as slurmstepd would), or, in record mode, only records what it was asked to run and stands
in for the program (a server waits to be stopped, the others exit 0). The real thing, a job
training on a real slurmctld, is tests/integration/test_slurm_cluster.py."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

from conftest import ROOT, TINY_MODEL, rl_command
from rl.config import load_config
from rl.resolved_config import render_toml

pytestmark = pytest.mark.slow

JOB_ID = "4242"

SRUN = r'''#!{python}
import json, os, signal, subprocess, sys, threading

args = sys.argv[1:]
node = None
while args and args[0].startswith("-"):
    a = args.pop(0)
    if a in ("-w", "--nodelist"):
        node = args.pop(0)
    elif a.startswith("--nodelist="):
        node = a.split("=", 1)[1]
    elif a != "--overlap" and not a.startswith(("--nodes=1", "--ntasks=1", "--export=ALL", "--job-name=")):
        sys.exit(f"fake srun: unexpected option {{a}}")
if not node or "," in node or not args:
    sys.exit(f"fake srun: one node and a command expected: {{sys.argv}}")
proc, stopped = None, []

def kill(sig):
    try:
        if proc is not None:
            os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass

def stop(signum, _):
    stopped.append(signum)
    kill(signum)  # then SIGKILL after a grace, like srun's KillWait
    threading.Timer(20, kill, (signal.SIGKILL,)).start()

# Before the step starts: a stop that comes while it starts still reaches it (below).
signal.signal(signal.SIGTERM, stop)
signal.signal(signal.SIGINT, stop)
with open(os.environ["FAKE_SRUN_LOG"], "a") as f:
    f.write(json.dumps({{"node": node, "argv": args, "token": os.environ.get("ASYNCRL_API_TOKEN")}}) + "\n")
ready = os.environ["FAKE_SRUN_LOG"] + ".ready"
if os.environ.get("FAKE_SRUN_RECORD"):
    fail = os.environ.get("FAKE_FAIL")
    if "inference" in args:
        # The failing step fails once every step of the job runs (FAKE_STEPS of them), so that
        # all are there to be stopped, however slowly a loaded machine starts them.
        wait = f'while [ "$(wc -l < {{ready}} 2>/dev/null || echo 0)" -lt {{os.environ.get("FAKE_STEPS", 0)}} ]; do sleep 0.05; done'
        args = ["sh", "-c", f"{{wait}}; exit 3"] if fail and fail in args else ["sleep", "1000"]
    else:
        args = ["sleep", "1000"] if os.environ.get("FAKE_HANG") else ["true"]
proc = subprocess.Popen(args, env={{**os.environ, "SLURMD_NODENAME": node}}, start_new_session=True)
with open(os.environ["FAKE_SRUN_LOG"] + ".pgids", "a") as f:
    f.write(f"{{proc.pid}}\n")
if stopped:
    kill(stopped[0])
with open(ready, "a") as f:  # started, and stops reach it
    f.write(f"{{proc.pid}}\n")
rc = proc.wait()
kill(signal.SIGKILL)  # nothing of a step outlives it (vLLM's engine processes)
os._exit(rc if rc >= 0 else 128 - rc)
'''

SCONTROL = """#!/bin/sh
case "$1 $2 $3" in
  "show hostnames "*) for n in $FAKE_NODES; do echo "$n"; done ;;
  "show node -o") for n in $FAKE_NODES; do echo "NodeName=$n Arch=x86_64 NodeAddr=$n NodeHostName=$n"; done ;;
  *) echo "fake scontrol: $*" >&2; exit 1 ;;
esac
"""

# The job stops its steps with `scancel --signal=TERM <job id>`: SIGTERM to every step's program.
SCANCEL = """#!/bin/sh
[ "$1" = "--signal=TERM" ] && [ "$2" = "$SLURM_JOB_ID" ] || { echo "fake scancel: $*" >&2; exit 1; }
for g in $(cat "$FAKE_SRUN_LOG.pgids" 2>/dev/null); do kill -TERM "-$g" 2>/dev/null; done
exit 0
"""


@pytest.fixture
def cluster(tmp_path):
    """Shims in PATH, a job environment, and a run() that renders a config and runs the job."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(SRUN.format(python=sys.executable))
    (bin_dir / "scontrol").write_text(SCONTROL)
    (bin_dir / "scancel").write_text(SCANCEL)
    for shim in bin_dir.iterdir():
        shim.chmod(0o755)
    submit = tmp_path / "submit"
    submit.mkdir()
    log = tmp_path / "srun.jsonl"
    env = {**os.environ, "PATH": f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}",
           "SLURM_JOB_ID": JOB_ID, "SLURM_JOB_NODELIST": "fake[1-4]", "SLURM_SUBMIT_DIR": str(submit),
           "FAKE_SRUN_LOG": str(log)}
    env.pop("ASYNCRL_API_TOKEN", None)

    class Cluster:
        def __init__(self):
            self.env, self.submit, self.started = env, submit, []

        def script(self, cfg: Path, *extra: str) -> Path:
            out = render(cfg, *extra)
            assert out.returncode == 0, out.stderr
            path = tmp_path / "job.sbatch"
            path.write_text(out.stdout)
            return path

        def start(self, script: Path, **more: str) -> subprocess.Popen:
            proc = subprocess.Popen(["bash", str(script)], env={**env, **more}, cwd=tmp_path,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                    start_new_session=True)
            self.started.append(proc)
            return proc

        def steps(self) -> list[dict]:
            return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []

        def leftovers(self, wait_s: float = 10) -> list[int]:
            """Process groups of steps still alive; killed ones get wait_s to be reaped."""
            pgids = Path(f"{log}.pgids")
            groups = [int(p) for p in pgids.read_text().split()] if pgids.exists() else []
            deadline = time.monotonic() + wait_s
            while (left := [g for g in groups if alive(g)]) and time.monotonic() < deadline:
                time.sleep(0.2)
            return left

    c = Cluster()
    yield c
    for proc in c.started:  # a failed test must not leave a job (or vLLM) running
        for pgid in [proc.pid, *c.leftovers(wait_s=0)]:
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def render(cfg: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(rl_command("slurm", "@", str(cfg), *extra), capture_output=True, text=True,
                          timeout=60)


def big_config(write_toml, output_dir: Path, port: int = 8000, extra: str = "", files: bool = False) -> Path:
    """2 inference nodes x 2 servers, 2 trainer nodes, 4 GPUs each, ZMQ and weight broadcast
    (`files`: batches and weights through the run directory instead)."""
    kinds = ('[transport]\nkind = "files"\n[weight_sync]\nkind = "files"\n' if files else
             '[transport]\nkind = "zmq"\naddress = "tcp://127.0.0.1:5557"\n'
             '[weight_sync]\nkind = "broadcast"\naddress = "127.0.0.1:29710"\n')
    return write_toml(
        f'model = "{TINY_MODEL}"\noutput_dir = "{output_dir}"\n'
        f'[inference]\nport = {port}\napi_token = "do-not-embed-me"\n' + kinds +
        '[slurm]\ninference_nodes = 2\nservers_per_node = 2\ntrainer_nodes = 2\ngpus_per_node = 4\n'
        'partition = "gpu"\naccount = "rl"\ntime_limit = "2:00:00"\njob_name = "rev"\n'
        'sbatch_args = ["--exclusive", "--mem=0"]\nsetup = ["export FROM_SETUP=1"]\n'
        'rendezvous_port = 29555\n' + extra)


# --- rendering ---------------------------------------------------------------------------------


def test_script_has_the_sbatch_lines_and_is_valid_bash(write_toml, tmp_path):
    out = render(big_config(write_toml, tmp_path / "run"))
    assert out.returncode == 0, out.stderr
    script = out.stdout
    sbatch = re.findall(r"^#SBATCH (.*)$", script, re.M)
    assert sbatch == ["--job-name=rev", "--nodes=4", "--ntasks-per-node=1", "--time=2:00:00",
                      "--output=%x-%j.out", "--open-mode=append", "--partition=gpu", "--account=rl", "--gpus-per-node=4",
                      "--exclusive", "--mem=0"]
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0
    assert "do-not-embed-me" not in script
    # The embedded config is the resolved one, token left out.
    embedded = re.search(r"<<'ASYNCRL_CONFIG'\n(.*?)\nASYNCRL_CONFIG\n", script, re.S).group(1)
    cfg, _ = load_config(["@", str(tmp_path / "cfg.toml")])
    assert embedded + "\n" == render_toml(cfg, omit_secrets=True)
    assert "api_token" not in tomllib.loads(embedded)["inference"]
    assert "inference.api_token is not written into the script" in out.stderr


def test_job_places_servers_trainer_and_orchestrator_on_their_nodes(cluster, write_toml, tmp_path):
    run = tmp_path / "run"
    script = cluster.script(big_config(write_toml, run, port=8100))
    job = cluster.start(script, FAKE_NODES="n1 n2 n3 n4", FAKE_SRUN_RECORD="1")
    _, err = job.communicate(timeout=60)
    assert job.returncode == 0, err
    steps = cluster.steps()
    by_node = {}
    for s in steps:
        by_node.setdefault(s["node"], []).append(s["argv"])
    assert sorted(by_node) == ["n1", "n2", "n3", "n4"]
    config_file = str(run / "config" / f"slurm-{JOB_ID}.toml")
    for node in ("n1", "n2"):
        servers = sorted(by_node[node], key=lambda a: a[a.index("--inference.port") + 1])
        assert [a[:2] for a in servers] == [["env", "CUDA_VISIBLE_DEVICES=0,1"], ["env", "CUDA_VISIBLE_DEVICES=2,3"]]
        for argv, port in zip(servers, ("8100", "8101")):
            assert argv[2:] == ["python", "-m", "asyncrl", "inference", "@", config_file, "--inference.host", node,
                                "--inference.port", port, "--weight_sync.address", "n3:29710"]
    trainers = [a for n in ("n3", "n4") for a in by_node[n] if "trainer" in a]
    for rank, (node, argv) in enumerate(zip(("n3", "n4"), trainers)):
        assert argv in by_node[node]
        assert argv == ["python", "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "4",
                        "--rdzv-backend", "static", "--node-rank", str(rank), "--master-addr", "n3",
                        "--master-port", "29555", "-m", "trainer", "@", config_file, "--transport.bind", "tcp://*:5557",
                        "--transport.address", "tcp://n3:5557", "--weight_sync.address", "n3:29710"]
    (orchestrator,) = [a for a in by_node["n3"] if "orchestrator" in a]
    i = orchestrator.index("--orchestrator.servers.urls")
    assert orchestrator[:i] == ["python", "-m", "asyncrl", "orchestrator", "@", config_file]
    assert orchestrator[i + 2:] == ["--transport.address", "tcp://n3:5557", "--weight_sync.address", "n3:29710"]
    urls = tomllib.loads(f"v = {orchestrator[i + 1]}")["v"]
    assert sorted(urls) == [f"http://n{n}:{p}" for n in (1, 2) for p in (8100, 8101)]
    # One fresh token for every step, never the config's.
    tokens = {s["token"] for s in steps}
    assert len(tokens) == 1 and re.fullmatch(r"[0-9a-f]{64}", tokens.pop())
    # Every program reads the embedded config, which resolves as the submitted one did.
    submitted, _ = load_config(["@", str(tmp_path / "cfg.toml")])
    written, _ = load_config(["@", config_file])
    assert written == submitted.model_copy(update={"inference": submitted.inference.model_copy(
        update={"api_token": None})})
    assert cluster.leftovers() == []


def test_a_step_that_fails_fails_the_job_and_stops_the_rest(cluster, write_toml, tmp_path):
    script = cluster.script(big_config(write_toml, tmp_path / "run", port=8100))
    job = cluster.start(script, FAKE_NODES="n1 n2 n3 n4", FAKE_SRUN_RECORD="1", FAKE_FAIL="8101",
                        FAKE_HANG="1", FAKE_STEPS="7")
    _, err = job.communicate(timeout=90)
    assert job.returncode == 1
    assert re.search(r"step inference-n[12]-8101 exited with code 3 before the run ended", err), err
    assert len(cluster.steps()) == 7 and cluster.leftovers() == []


def test_sigterm_stops_every_step(cluster, write_toml, tmp_path):
    script = cluster.script(big_config(write_toml, tmp_path / "run"))
    job = cluster.start(script, FAKE_NODES="n1 n2 n3 n4", FAKE_SRUN_RECORD="1", FAKE_HANG="1")
    # Every step started, and its srun ready to pass a stop on (the fake srun says so last).
    ready = Path(f"{cluster.env['FAKE_SRUN_LOG']}.ready")
    deadline = time.monotonic() + 120
    while len(ready.read_text().split() if ready.exists() else []) < 7:
        assert time.monotonic() < deadline and job.poll() is None, cluster.steps()
        time.sleep(0.05)
    job.send_signal(signal.SIGTERM)
    _, err = job.communicate(timeout=60)
    assert job.returncode == 143, err
    assert "terminated; stopping all steps" in err
    assert cluster.leftovers() == []


def test_too_few_nodes_is_an_error(cluster, write_toml, tmp_path):
    job = cluster.start(cluster.script(big_config(write_toml, tmp_path / "run")), FAKE_NODES="n1 n2 n3")
    _, err = job.communicate(timeout=30)
    assert job.returncode == 2
    assert "the job has 3 node(s), the layout needs 4" in err
    assert cluster.steps() == []


def documented_variables() -> list[str]:
    text = (ROOT / "docs" / "slurm.md").read_text()
    section = text.split("## Template variables", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\| `(\w+)` \|", section, re.M)


def test_a_custom_template_gets_every_documented_variable(write_toml, tmp_path):
    names = documented_variables()
    assert {"cfg", "sbatch", "servers", "config_toml", "nproc_per_node", "transport_port"} <= set(names)
    template = tmp_path / "mine.j2"
    # StrictUndefined: naming a variable the renderer does not pass fails the render.
    template.write_text("".join(f"{n}={{{{ {n} is defined }}}}\n" for n in names) +
                        "ports={{ servers|map(attribute='port')|join(',') }} "
                        "gpus={{ servers|map(attribute='gpus')|join(' ') }} "
                        "dir={{ run_dir|q }} name={{ slurm.job_name }} ranks={{ nproc_per_node }}\n")
    cfg = big_config(write_toml, tmp_path / "my run", extra=f'template = "{template}"\n')
    out = render(cfg)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[:len(names)] == [f"{n}=True" for n in names]
    assert lines[-1] == f"ports=8000,8001 gpus=0,1 2,3 dir='{tmp_path / 'my run'}' name=rev ranks=4"


def test_missing_template_is_a_one_line_error(write_toml, tmp_path):
    out = render(big_config(write_toml, tmp_path / "run"), "--slurm.template", str(tmp_path / "nope.j2"))
    assert out.returncode == 2
    assert out.stdout == ""
    assert len(out.stderr.strip().splitlines()) == 1
    assert out.stderr.startswith("rl slurm: slurm.template") and "nope.j2" in out.stderr


@pytest.mark.parametrize("extra, message", [
    (["--trainer.lora.rank", "8", "--trainer.lora.multi_run", "true", "files"], "trainer.lora.multi_run"),
    (["--slurm.servers_per_node", "3"], "slurm.gpus_per_node (4) must be a multiple of slurm.servers_per_node (3)"),
    (["--inference.advertise_url", "http://lb:80"], "inference.advertise_url"),
    (["--orchestrator.teacher.url", "http://127.0.0.1:9000"], "orchestrator.teacher.url"),
    (["--slurm.rendezvous_port", "5557"], "both use port 5557"),
    (["--transport.address", "tcp://host"], "transport.address"),
])
def test_configs_that_cannot_work_on_a_cluster_are_refused(write_toml, tmp_path, extra, message):
    files = extra[-1:] == ["files"]  # batches and weights through files (kind-specific keys are refused elsewhere)
    out = render(big_config(write_toml, tmp_path / "run", files=files), *extra[:len(extra) - files])
    assert out.returncode == 2
    assert len(out.stderr.strip().splitlines()) == 1 and message in out.stderr, out.stderr


def test_submit_without_sbatch_is_a_one_line_error(write_toml, tmp_path):
    """`rl slurm --submit` where no sbatch is on PATH: one line naming --submit, exit 2, nothing
    printed as a script (the real submission: tests/integration/test_slurm_cluster.py)."""
    bare = tmp_path / "bin"
    bare.mkdir()
    env = {**os.environ, "PATH": str(bare)}
    out = subprocess.run(rl_command("slurm", "@", str(big_config(write_toml, tmp_path / "run")), "--submit"),
                         capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path)
    assert out.returncode == 2, out.stderr
    assert out.stdout == ""
    assert out.stderr.strip().splitlines() == [out.stderr.strip()] and "--submit: sbatch is not on PATH" in out.stderr
