"""`rl slurm @ cfg.toml`: the sbatch script that runs a config on a SLURM cluster.

Python decides what can be decided before the job starts (ports, GPU slices, the #SBATCH lines,
whether the config can work on several hosts at all); the template (slurm.sbatch.j2, or the
user's slurm.template) turns that into shell, and the job itself learns its node names. Every
variable the template gets is documented in docs/slurm.md.
"""

from __future__ import annotations

import ipaddress
import shlex
import shutil
import subprocess
from importlib import resources
from pathlib import Path
from urllib.parse import urlsplit

import jinja2

from rl.resolved_config import render_toml
from rl.config import ConfigError, RunConfig
from rl.config.parallel_layout import mesh_sizes
from rl.rundir import RunDir
from rl.transport.registry import receiver_endpoint


class SlurmError(Exception):
    """The config cannot run as a SLURM job; a one-line message naming the key."""


def _port(key: str, address: str) -> int:
    port = address.rpartition(":")[2]
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise SlurmError(f"{key} = {address!r}: no port to reuse on the cluster (expected ...:port)")
    return int(port)


def _is_loopback(url: str) -> bool:
    host = urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _check(cfg: RunConfig) -> tuple[int | None, int | None, list[str]]:
    """Refuse what cannot work across nodes; the head node's transport and broadcast ports
    (None when unused), and notes for the user."""
    s, notes = cfg.slurm, []
    if cfg.trainer.lora.multi_run:
        # One job = one run whose end (orchestrator and trainer exit 0) ends the job; a multi-run
        # trainer outlives its runs and takes runs submitted separately, a different shape.
        raise SlurmError("trainer.lora.multi_run: rl slurm renders the job of one run; start a "
                         "multi-run trainer and its servers yourself (docs/lora.md, docs/slurm.md)")
    if cfg.inference.advertise_url:
        raise SlurmError("inference.advertise_url is set, but every server of the job announces its "
                         "own http://<node>:<port>; remove it")
    if s.gpus_per_node % s.servers_per_node:
        raise SlurmError(f"slurm.gpus_per_node ({s.gpus_per_node}) must be a multiple of "
                         f"slurm.servers_per_node ({s.servers_per_node}): each server gets an even slice")
    if cfg.inference.port + s.servers_per_node - 1 > 65535:
        raise SlurmError(f"inference.port {cfg.inference.port} + slurm.servers_per_node "
                         f"{s.servers_per_node} runs past port 65535")
    rewards = [(f"dataset {d.name}: reward", d.reward) for d in
               cfg.orchestrator.resolved_datasets() + cfg.orchestrator.resolved_datasets(evaluation=True)]
    for key, url in (("orchestrator.teacher.url", cfg.orchestrator.teacher.url or ""), *rewards):
        if url.startswith(("http://", "https://")) and _is_loopback(url):
            raise SlurmError(f"{key} = {url!r} is loopback, i.e. the orchestrator's own node in the "
                             "job, where nothing serves it; give its host name")
    transport_port = None
    if receiver_endpoint(cfg.transport) is not None:  # a kind that binds: the job gives it a port
        if cfg.transport.address.startswith("tcp://"):
            transport_port = _port("transport.address", cfg.transport.address)
        elif not cfg.transport.address.startswith("ipc://"):
            raise SlurmError(f"transport.address = {cfg.transport.address!r}: expected tcp://host:port "
                             "or ipc:///path")
        # ipc:// stays as it is: the orchestrator and trainer rank 0 share the head node.
    broadcast_port = None
    if cfg.weight_delivery == "broadcast":
        broadcast_port = _port("weight_sync.address", cfg.weight_sync.address)
    head = {"slurm.rendezvous_port": s.rendezvous_port, "transport.address": transport_port,
            "weight_sync.address": broadcast_port}
    used = [(k, p) for k, p in head.items() if p is not None]
    for i, (key, port) in enumerate(used):
        for other, other_port in used[i + 1:]:
            if port == other_port:
                raise SlurmError(f"{key} and {other} both use port {port} on the first trainer node")
    if cfg.orchestrator.servers.urls:
        notes.append("orchestrator.servers.urls is replaced by the job's own servers")
    if cfg.inference.api_token:
        notes.append("inference.api_token is not written into the script: the job takes "
                     "ASYNCRL_API_TOKEN from the submitting shell, or makes a fresh one")
    return transport_port, broadcast_port, notes


def _servers(cfg: RunConfig) -> list[dict]:
    s = cfg.slurm
    per = s.gpus_per_node // s.servers_per_node
    return [{"index": j, "port": cfg.inference.port + j,
             "gpus": ",".join(str(g) for g in range(j * per, (j + 1) * per))}
            for j in range(s.servers_per_node)]


def trainer_ranks_per_node(cfg: RunConfig) -> tuple[int, list[str]]:
    """Trainer ranks per trainer node, refused unless [trainer.parallel] fills the trainer's world,
    and notes. With GPUs, one rank per GPU (the world: slurm.trainer_nodes x slurm.gpus_per_node);
    on a CPU cluster (gpus_per_node = 0), the layout's ranks split evenly over the nodes
    (trainer.parallel.data = 0: one context x expert group per node)."""
    s, p, notes = cfg.slurm, cfg.trainer.parallel, []
    inner = p.context * p.expert
    if s.gpus_per_node:
        per = s.gpus_per_node
    elif not p.data:
        per = inner
    elif p.data * inner % s.trainer_nodes:
        raise SlurmError(f"trainer.parallel: data x context x expert = {p.data * inner} rank(s) do not split "
                         f"evenly over slurm.trainer_nodes ({s.trainer_nodes}) of a CPU cluster "
                         "(slurm.gpus_per_node = 0)")
    else:
        per = p.data * inner // s.trainer_nodes
    try:
        mesh_sizes(p, s.trainer_nodes * per)
    except ConfigError as e:
        world = (p.data or 1) * inner
        fit = f"; slurm.trainer_nodes = {world // per} would" if world % per == 0 else ""
        raise SlurmError(f"{e} (slurm.trainer_nodes {s.trainer_nodes} x {per} rank(s) per node{fit})") from None
    if inner > 1 and per % inner:
        notes.append(f"trainer.parallel: context x expert groups of {inner} ranks span nodes ({per} rank(s) per "
                     "node): their per-layer collectives cross the network")
    return per, notes


def _sbatch_lines(cfg: RunConfig) -> list[str]:
    s = cfg.slurm
    lines = [f"--job-name={s.job_name}", f"--nodes={s.inference_nodes + s.trainer_nodes}",
             "--ntasks-per-node=1", f"--time={s.time_limit}",
             # The run directory is only known to the job; this file gets the job's own messages,
             # appended: a requeued job (same id) would otherwise truncate why the last try failed.
             "--output=%x-%j.out", "--open-mode=append"]
    if s.partition:
        lines.append(f"--partition={s.partition}")
    if s.account:
        lines.append(f"--account={s.account}")
    if s.gpus_per_node:
        lines.append(f"--gpus-per-node={s.gpus_per_node}")
    return lines + list(s.sbatch_args)


def _template(cfg: RunConfig) -> tuple[str, str]:
    path = cfg.slurm.template
    if path is None:
        return "slurm.sbatch.j2", (resources.files("asyncrl") / "slurm.sbatch.j2").read_text()
    try:
        return str(path), Path(path).read_text()
    except OSError as e:
        raise SlurmError(f"slurm.template = {str(path)!r}: cannot read it ({e.strerror})") from None


def variables(cfg: RunConfig) -> tuple[dict, list[str]]:
    """What the template gets (docs/slurm.md lists each), and notes for stderr."""
    transport_port, broadcast_port, notes = _check(cfg)
    per_node, layout_notes = trainer_ranks_per_node(cfg)
    notes += layout_notes
    s = cfg.slurm
    run = RunDir(cfg.run_dir)
    return {
        "cfg": cfg,
        "slurm": s,
        "sbatch": _sbatch_lines(cfg),
        "setup": list(s.setup),
        "config_toml": render_toml(cfg, omit_secrets=True),
        "run_dir": str(run.root),
        "config_dir": str(run.root / "config"),
        "logs_dir": str(run.logs),
        "nodes": s.inference_nodes + s.trainer_nodes,
        "inference_nodes": s.inference_nodes,
        "trainer_nodes": s.trainer_nodes,
        "servers": _servers(cfg),
        "gpus_per_node": s.gpus_per_node,
        "nproc_per_node": per_node,
        "rendezvous_port": s.rendezvous_port,
        "transport_port": transport_port,
        "broadcast_port": broadcast_port,
        "stop_grace_s": 30,
    }, notes


def render(cfg: RunConfig) -> tuple[str, list[str]]:
    """The sbatch script, and notes for the user (stderr). Raises SlurmError."""
    name, source = _template(cfg)
    values, notes = variables(cfg)
    # Jinja comments are {## ##}: the default {# would swallow bash's ${#array[@]}.
    env = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True,
                             trim_blocks=True, lstrip_blocks=True, autoescape=False,
                             comment_start_string="{##", comment_end_string="##}")
    env.filters["q"] = lambda v: shlex.quote(str(v))
    try:
        script = env.from_string(source).render(template=name, **values)
    except jinja2.TemplateSyntaxError as e:
        raise SlurmError(f"slurm.template {name}, line {e.lineno}: {e.message}") from None
    except jinja2.UndefinedError as e:
        raise SlurmError(f"slurm.template {name}: {e.message}") from None
    s = cfg.slurm
    notes.append(f"{values['nodes']} nodes: {s.inference_nodes} for inference ({s.servers_per_node} "
                 f"server(s) each), {s.trainer_nodes} for the trainer ({values['nproc_per_node']} "
                 "rank(s) each) and the orchestrator; submit with: sbatch <this script>")
    return script, notes


def submit(script: str) -> str:
    """Hands the job to the real sbatch (`rl slurm --submit`) and returns its id. The script goes
    on stdin, so the job starts in the current directory and writes its output there, as
    `sbatch job.sbatch` from here would; SLURM_CONF and the rest of the environment pass on."""
    sbatch = shutil.which("sbatch")
    if sbatch is None:
        raise SlurmError("--submit: sbatch is not on PATH (run it on a login node of the cluster, or leave "
                         "--submit out and hand the printed script to sbatch yourself)")
    try:
        done = subprocess.run([sbatch, "--parsable"], input=script, capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        raise SlurmError("--submit: sbatch did not answer within 120 s (is slurmctld up? `sinfo` says)") from None
    if done.returncode != 0:
        why = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
        raise SlurmError(f"--submit: sbatch refused the job: {why}")
    return done.stdout.strip().split(";")[0]  # --parsable: "id" or "id;cluster"
