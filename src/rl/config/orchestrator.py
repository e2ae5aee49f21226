"""`[orchestrator]`: what to roll out, how to score it, how to schedule it, and where the servers
are, in tables that mirror the orchestrator's stations (docs/architecture.md): `[orchestrator.prompts]`
(chat template, system prompt), `[orchestrator.sampling]`, `[orchestrator.scheduling]` (batch
composition, in-flight bounds, no-spin stops), `[orchestrator.timeouts]` (every bound the
orchestrator waits under), `[orchestrator.servers]`, `[orchestrator.teacher]` (these in
rl/config/orchestrator_tables.py), `[orchestrator.tools]`, `[orchestrator.sandbox]`,
`[orchestrator.overlong]`, `[orchestrator.curriculum]`, `[orchestrator.environment]` (in
rl/config/rollout_tables.py), beside `[[orchestrator.datasets]]` and `[orchestrator.eval]`
(rl/config/datasets.py). What is rolled out, datasets or an environment, stays at the top, with
cpus and the metrics port. A dataset that samples or prompts differently says so in its own
`sampling` and `prompts` tables, under the same key names.

A config written before the tables existed is refused with one line that names the new place
of the key (rl/config/moved.py), not with a bare "unknown key".
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import Field, NonNegativeInt, model_validator

from rl.config.datasets import Dataset, DatasetConfig, EvalConfig, Sampling
from rl.config.orchestrator_tables import (
    PromptsConfig, SamplingConfig, SchedulingConfig, ServersConfig, TeacherConfig, TimeoutsConfig)
from rl.config.rollout_tables import (
    CurriculumConfig, EnvironmentConfig, OverlongConfig, SandboxConfig, ToolsConfig)
from rl.config.section import Section

if TYPE_CHECKING:
    from rl.config.datasets import EvalEnvironment


# What a config that names no dataset trains on: the tiny model's string reversal.
REVERSE_DATASET, REVERSE_REWARD = "tasks.reverse:dataset", "tasks.reverse:reward"


class OrchestratorConfig(Section):
    cpus: list[NonNegativeInt] = []
    """Cores this program and everything it starts may run on; empty: all (see inference.cpus)."""

    metrics_port: int = Field(0, ge=0, le=65535)
    """Serve Prometheus metrics at http://metrics_host:metrics_port/metrics and write
    output_dir/prometheus/orchestrator-<host>-<port>.json for Prometheus' file_sd
    (docs/observability.md); 0: off."""

    metrics_host: str = "127.0.0.1"
    """Address the metrics port binds; 0.0.0.0 for a Prometheus on another host (the metrics
    reveal rewards and timings, nothing that acts on the run)."""

    servers: ServersConfig = ServersConfig()
    """The inference servers: where they are, and how long to wait on them
    (`[orchestrator.servers]`)."""

    datasets: list[DatasetConfig] = []
    """Datasets mixed by weight (`[[orchestrator.datasets]]`, rl/config/datasets.py): jsonl,
    parquet, HF datasets, reasoning-gym tasks or functions, each with its own fields, reward and,
    where they differ from the orchestrator's, sampling and prompts. Empty: the tiny model's
    string reversal (tasks.reverse:dataset scored by tasks.reverse:reward)."""

    eval: EvalConfig = EvalConfig()
    """Held-out evaluation (`[orchestrator.eval]`, rl/config/datasets.py)."""

    reward_inline: bool = False
    """Call a sync reward function on the event loop instead of a worker thread: ~35% more groups
    per second when rewards are cheap (benchmarks/orchestrator_throughput.py), but a slow call
    stalls all scheduling and timeouts.reward_s can no longer cut it short."""

    teacher: TeacherConfig = TeacherConfig()
    """An optional teacher model for on-policy distillation (`[orchestrator.teacher]`)."""

    environment: EnvironmentConfig = EnvironmentConfig()
    """A multi-turn environment instead of datasets: its class, the arguments it is built with, and
    the most model turns of an episode (`[orchestrator.environment]`)."""

    tools: ToolsConfig = ToolsConfig()
    """How a tool environment's calls are read and run (`[orchestrator.tools]`)."""

    sandbox: SandboxConfig = SandboxConfig()
    """Where model-written code runs (`[orchestrator.sandbox]`)."""

    overlong: OverlongConfig = OverlongConfig()
    """What becomes of completions cut at max_tokens (`[orchestrator.overlong]`)."""

    curriculum: CurriculumConfig = CurriculumConfig()
    """Which drawn rows are generated, by their recorded pass rate (`[orchestrator.curriculum]`)."""

    prompts: PromptsConfig = PromptsConfig()
    """How a row becomes a prompt: chat template, system prompt (`[orchestrator.prompts]`)."""

    sampling: SamplingConfig = SamplingConfig()
    """How the servers sample (`[orchestrator.sampling]`)."""

    scheduling: SchedulingConfig = SchedulingConfig()
    """What goes into a batch and how far generation runs ahead (`[orchestrator.scheduling]`)."""

    timeouts: TimeoutsConfig = TimeoutsConfig()
    """Every bound the orchestrator waits under (`[orchestrator.timeouts]`)."""

    @model_validator(mode="after")
    def _check_scoring(self) -> OrchestratorConfig:
        if self.environment.class_:
            if self.datasets:
                raise ValueError("orchestrator.datasets is unused when orchestrator.environment.class is set "
                                 "(the environment supplies rows and rewards); remove one of them")
            return self
        for evaluation in (False, True):
            names = [d.name for d in self.resolved_datasets(evaluation)]
            if len(set(names)) != len(names):
                key = "orchestrator.eval.datasets" if evaluation else "orchestrator.datasets"
                raise ValueError(f"{key}: names must differ (got {names}); set name = ...")
        for d in self.resolved_datasets(evaluation=True):
            if not d.reward:
                raise ValueError(f"eval dataset {d.name}: no reward to score it (set its reward)")
        for d in self.resolved_datasets():
            if not d.reward and not self.teacher.url:
                raise ValueError(f"dataset {d.name}: no reward and no orchestrator.teacher.url: nothing would score "
                                 "its rollouts (set its reward = ...)")
            if self.overlong.mode == "penalty" and not 0 < self.overlong.buffer <= d.sampling.max_tokens:
                raise ValueError(f"orchestrator.overlong.mode = \"penalty\" needs 0 < overlong.buffer <= max_tokens "
                                 f"(dataset {d.name}: max_tokens {d.sampling.max_tokens}, overlong.buffer "
                                 f"{self.overlong.buffer})")
        return self

    def for_eval_environment(self, spec: EvalEnvironment) -> OrchestratorConfig:
        """These settings with an eval environment in [orchestrator.environment]'s place: its class
        and args, its max_turns (unset: the run's). Not validated again: the run's datasets stay."""
        environment = self.environment.model_copy(update={
            "class_": spec.class_, "args": spec.args,
            "max_turns": self.environment.max_turns if spec.max_turns is None else spec.max_turns})
        return self.model_copy(update={"environment": environment})

    def resolved_datasets(self, evaluation: bool = False) -> list[Dataset]:
        """Every dataset with the orchestrator's sampling and prompts applied where it sets none of
        its own (the reversal task when none are listed); with `evaluation`, the eval datasets."""
        if evaluation:
            specs = self.eval.datasets
        else:
            specs = self.datasets or [DatasetConfig(name="data", function=REVERSE_DATASET, reward=REVERSE_REWARD)]
        out = []
        for spec in specs:
            reward = spec.reward or ("reasoning_gym" if spec.reasoning_gym else "")
            system_prompt = spec.prompts.system_prompt
            system_prompt = self.prompts.system_prompt if system_prompt is None else system_prompt
            out.append(Dataset(spec.label, spec, reward, dict(spec.reward_weights), system_prompt, self.sampling_for(spec)))
        return out

    def sampling_for(self, spec: DatasetConfig | None = None) -> Sampling:
        """The orchestrator's sampling settings, with those a dataset sets instead."""
        def pick(key: str):
            value = None if spec is None else getattr(spec.sampling, key)
            return getattr(self.sampling, key) if value is None else value

        return Sampling(temperature=pick("temperature"), top_p=pick("top_p"), top_k=pick("top_k"),
                        min_p=pick("min_p"), max_tokens=pick("max_tokens"), stop=tuple(pick("stop")))
