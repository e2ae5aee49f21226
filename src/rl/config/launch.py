"""`[slurm]` (`rl slurm`'s sbatch script) and `[tracking]` (experiment trackers): how a run is
launched and watched, read by no training program."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field

from rl.config.section import Section


class SlurmConfig(Section):
    """`rl slurm @ cfg.toml` only: how the sbatch script it prints places the programs."""

    inference_nodes: int = Field(1, ge=1)
    """Nodes running inference servers."""

    servers_per_node: int = Field(1, ge=1)
    """Inference servers per inference node, on ports inference.port, +1, ...; the node's GPUs
    are split evenly between them (tensor parallelism goes in inference.extra_args)."""

    trainer_nodes: int = Field(1, ge=1)
    """Nodes of the trainer (one torchrun per node, a static rendezvous on the first: rank 0
    must be there, where the orchestrator connects).
    The orchestrator runs on the first trainer node too: it needs CPU only."""

    gpus_per_node: int = Field(8, ge=0)
    """GPUs per node; the trainer runs one rank per GPU (0: a CPU cluster, [trainer.parallel]'s
    ranks split evenly over the trainer nodes: one context x expert group per node when
    trainer.parallel.data = 0)."""

    partition: str = ""
    """#SBATCH --partition; empty: the cluster's default."""

    account: str = ""
    """#SBATCH --account; empty: none."""

    time_limit: str = "24:00:00"
    """#SBATCH --time."""

    job_name: str = "asyncrl"
    """#SBATCH --job-name."""

    sbatch_args: list[str] = []
    """Further #SBATCH lines, verbatim (e.g. ["--exclusive", "--mem=0"])."""

    setup: list[str] = []
    """Shell lines the job runs first (module loads, `source .venv/bin/activate`); every step
    inherits the environment they leave."""

    rendezvous_port: int = Field(29500, ge=1, le=65535)
    """Port of the trainer's torchrun rendezvous on the first trainer node."""

    template: Path | None = None
    """A Jinja2 template to render instead of the built-in one (src/asyncrl/slurm.sbatch.j2,
    documented in docs/slurm.md)."""


class TrackingConfig(Section):
    """Experiment trackers fed from metrics.jsonl by the orchestrator (orchestrator/reporting/tracking.py)."""

    wandb: bool = False
    """Log to Weights & Biases (`pip install wandb`); files under output_dir/tracking/."""

    wandb_mode: Literal["auto", "online", "offline"] = "auto"
    """auto: online when WANDB_API_KEY is set, else offline (`wandb sync` uploads it later)."""

    wandb_project: str = "asyncrl"
    """The Weights & Biases project the run logs to."""

    wandb_entity: str | None = None
    """The Weights & Biases team or user owning the project; unset: the API key's default entity."""

    run_name: str = ""
    """The run's name in the trackers; empty: the run directory's name."""

    tensorboard: bool = False
    """Write TensorBoard event files to output_dir/tracking/tensorboard (`pip install tensorboard`)."""

