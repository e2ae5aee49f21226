"""One run, one config: shared keys at the top, one table per program.

Every program parses the same files (`@ a.toml @ b.toml`, composed left to right, then
`--table.key value` overrides: rl/config/load.py) into `RunConfig`, so a run started by `rl run`
and one started by hand in three terminals resolve to exactly the same settings. Each key's
docstring is its documentation (`rl <program> --help` and `--dry-run` show them). The tables live
one file each beside this one; here are the shared keys and the checks that span tables (which
need the whole config in one place).
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, model_validator

from rl.config.delivery import FilesTransport, FilesWeightSync, TransportConfig, WeightSyncConfig
from rl.config.inference import InferenceConfig
from rl.config.launch import SlurmConfig, TrackingConfig
from rl.config.orchestrator import OrchestratorConfig
from rl.config.section import Section
from rl.config.shared_tables import CheckpointsConfig, SharedTimeoutsConfig
from rl.config.sft import SftConfig
from rl.config.trainer import TrainerConfig


class RunConfig(Section):
    model: Path
    """Path of the starting model, a local HF-format directory (config, tokenizer, safetensors)."""

    output_dir: Path = Path("runs/default")
    """The run directory shared by the three programs (rollouts, weights, logs, metrics)."""

    max_steps: int = Field(20, ge=1)
    """Optimizer steps to train; also the number of batches the orchestrator hands over."""

    seq_len: int = Field(256, ge=8)
    """Longest prompt + completion, tokens; the server's max_model_len."""

    max_async_level: int = Field(2, ge=0)
    """k: batch n is handed over only once version >= n-1-k serves on every server. 0 is
    synchronous on-policy RL. Default 2, from two recipes that agree (docs/performance.md,
    "Learning speed"): on the CPU demo's 2 reached a reward in ~25% less wall time than 1 (the
    same reward per step, the trainer waiting less for batches; 3 no better), on the reversal ~6%
    less (8% shorter steps), and on a train-bound reversal raced against TRL's GRPOTrainer, 2 with
    in-flight updates reached trailing-10 reward 0.5 in 0.85x TRL's time where 1 without took
    1.15x. The staleness it adds is corrected per token (the sampler's logprobs in the PPO ratio);
    a real-sized model has not been measured at 2 on a GPU yet."""

    seed: int = 0
    """Seed of the data stream and of the trainer."""

    resume: bool = False
    """Trainer: continue from the latest complete checkpoint in output_dir (`--resume`). Without
    it the trainer refuses a run directory that already holds weights. The orchestrator always
    resumes from its own state."""

    run_name: str = Field("", pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$|^$")
    """Multi-run LoRA: this run's name; its directory is output_dir/runs/<run_name>/ and its
    adapter is served as "<run_name>-v<version>". Empty: a run of its own in output_dir."""

    checkpoints: CheckpointsConfig = CheckpointsConfig()
    timeouts: SharedTimeoutsConfig = SharedTimeoutsConfig()
    inference: InferenceConfig = InferenceConfig()
    transport: TransportConfig = FilesTransport()
    weight_sync: WeightSyncConfig = FilesWeightSync()
    orchestrator: OrchestratorConfig = OrchestratorConfig()
    trainer: TrainerConfig = TrainerConfig()
    slurm: SlurmConfig = SlurmConfig()
    tracking: TrackingConfig = TrackingConfig()
    sft: SftConfig = SftConfig()

    @model_validator(mode="after")
    def _check(self) -> RunConfig:
        o = self.orchestrator
        if o.scheduling.max_in_flight_groups < o.scheduling.prompts_per_step:
            raise ValueError(
                f"orchestrator.scheduling.max_in_flight_groups ({o.scheduling.max_in_flight_groups}) must be >= "
                f"orchestrator.scheduling.prompts_per_step ({o.scheduling.prompts_per_step}), or no batch could fill"
            )
        for d in o.resolved_datasets() + o.resolved_datasets(evaluation=True):
            if d.sampling.max_tokens >= self.seq_len:
                key = ("orchestrator.sampling.max_tokens" if d.spec.sampling.max_tokens is None
                       else f"dataset {d.name}: sampling.max_tokens")
                raise ValueError(
                    f"{key} ({d.sampling.max_tokens}) must be below seq_len ({self.seq_len}): "
                    "seq_len bounds prompt + completion, so no prompt would fit"
                )
        t = self.trainer
        context = t.parallel.context  # a row is split across the context ranks: each holds 1/context
        if t.batching.pack and t.batching.micro_batch_tokens * context < self.seq_len:
            split = f" x trainer.parallel.context ({context})" if context > 1 else ""
            raise ValueError(
                f"trainer.batching.micro_batch_tokens ({t.batching.micro_batch_tokens}){split} must be >= seq_len "
                f"({self.seq_len}): a sample of seq_len tokens must fit in one micro-batch"
            )
        if t.model.attention == "flash_attention_2" and t.model.dtype == "float32":
            raise ValueError('trainer.model.attention = "flash_attention_2" needs trainer.model.dtype = "bfloat16" or "auto" '
                             "(flash attention has no float32 kernel)")
        lo, hi = t.loss.mask_low, t.loss.mask_high
        if lo is not None and hi is not None and lo >= hi:
            raise ValueError(f"trainer.loss.mask_low ({lo}) must be below trainer.loss.mask_high ({hi})")
        lora = t.lora
        if (lora.multi_run or self.run_name) and lora.rank == 0:
            raise ValueError("trainer.lora.multi_run and run_name need LoRA: set trainer.lora.rank > 0")
        if (lora.multi_run or self.run_name) and self.transport.kind != "files":
            raise ValueError('multi-run LoRA needs transport.kind = "files" (one rollouts/ per run)')
        if lora.rank and self.weight_sync.delta:
            raise ValueError("weight_sync.delta applies to full weights: trainer.lora.rank > 0 publishes adapters")
        if lora.rank and self.weight_sync.kind != "files":
            raise ValueError('trainer.lora.rank > 0 syncs adapters through files: weight_sync.kind must be "files"')
        m = o.scheduling.max_off_policy_steps
        if m is not None and m < self.max_async_level:
            raise ValueError(
                f"orchestrator.scheduling.max_off_policy_steps ({m}) must be >= max_async_level "
                f"({self.max_async_level})"
            )
        return self

    @property
    def off_policy_steps(self) -> int:
        m = self.orchestrator.scheduling.max_off_policy_steps
        return self.max_async_level if m is None else m

    @property
    def run_dir(self) -> Path:
        """This run's directory: output_dir, or output_dir/runs/<run_name> in a multi-run."""
        return self.output_dir / "runs" / self.run_name if self.run_name else self.output_dir

    @property
    def weight_delivery(self) -> str:
        """How each version reaches the servers, the one choice every program follows: "adapters"
        (trainer.lora.rank > 0: peft adapters through files), "broadcast" (weight_sync.kind: full
        weights streamed to the servers' workers) or "files" (full weights through files).
        Each program maps it to its own class: orchestrator/servers/delivery.py, trainer/publish.py,
        inference/adapters.py."""
        if self.trainer.lora.rank > 0:
            return "adapters"
        return "broadcast" if self.weight_sync.kind == "broadcast" else "files"

    @property
    def adapter_prefix(self) -> str:
        """Servers hold this run's adapter versions as "<prefix>-v<version>"."""
        return self.run_name or "policy"

    @property
    def urls(self) -> list[str]:
        return self.orchestrator.servers.urls or [self.inference.url]
