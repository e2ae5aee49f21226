"""`[orchestrator]`: what to roll out, how to score it, how to schedule it, and where the servers
are, in tables that mirror the orchestrator's stations (docs/architecture.md): `[orchestrator.prompts]`
(chat template, system prompt), `[orchestrator.sampling]`, `[orchestrator.scheduling]` (batch
composition, in-flight bounds, no-spin stops), `[orchestrator.timeouts]` (every bound the
orchestrator waits under), `[orchestrator.checkpoints]`, `[orchestrator.servers]`,
`[orchestrator.teacher]`, `[orchestrator.tools]`, `[orchestrator.sandbox]`, `[orchestrator.overlong]`,
`[orchestrator.curriculum]`, `[orchestrator.environment]` (class, args, max_turns), beside
`[[orchestrator.datasets]]` and `[orchestrator.eval]` (rl/dataset_config.py). What is rolled out
stays at the top (dataset + reward, or datasets; or [orchestrator.environment]), with cpus. A
dataset may set the sampling keys, flat, for its own rows.

A config written before the tables existed is refused with one line that names the new place
of the key (`moved_key`), not with a bare "unknown key".
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, NonNegativeInt, field_validator, model_validator

from rl.addresses import HttpUrl
from rl.config_section import Section
from rl.dataset_config import Dataset, DatasetConfig, EvalConfig, Sampling, check_reward_spec, is_module_attr

if TYPE_CHECKING:
    from rl.dataset_config import EvalEnvironment


class ServersConfig(Section):
    urls: list[HttpUrl] = []
    """Base URLs of the inference servers (http://host:port). Empty: the one `[inference]`
    describes (unless discover finds others). A listed server that is down is waited for and
    joins when it answers; each group goes to the server with the fewest groups."""

    discover: bool = True
    """Also use every server that announces itself in the run directory (heartbeats/inference-*,
    written by `rl inference` with the same output_dir): a server started on another host
    joins the run once healthy, loaded with the current weights, and leaves when it stops or its
    heartbeat falls silent. Not with weight_sync.kind = "broadcast" (its group is fixed at
    start)."""

    retry_max_s: float = Field(30, gt=0)
    """A server that fails is taken out of rotation and health-checked with exponential backoff
    (1 s, 2 s, ...) up to this interval."""


class TeacherConfig(Section):
    url: HttpUrl | None = None
    """Inference server holding a teacher model. Set: every model token's advantage gains
    coef * (teacher logprob - sampled logprob), a per-token reverse-KL signal (on-policy
    distillation)."""

    coef: float = Field(1.0, gt=0)
    """Weight of the teacher's per-token signal against the reward advantage."""


class ToolsConfig(Section):
    parser: str = "hermes"
    """How a tool environment's calls are read from the model's text: "hermes" (<tool_call>{json}
    </tool_call>, as Qwen and Hermes models write them) or `module:Class` of your own parser
    (orchestrator/rollout/tool_parsers.py)."""

    @field_validator("parser")
    @classmethod
    def _parser_form(cls, spec: str) -> str:
        if spec != "hermes" and not is_module_attr(spec):
            raise ValueError("expected \"hermes\" or 'package.module:Class'")
        return spec


class SandboxConfig(Section):
    isolation: Literal["bwrap", "none"] = "bwrap"
    """How model-written code is isolated where a run executes it (the coding task's reward, the
    python tool: orchestrator/rollout/sandbox.py). "bwrap": by bubblewrap's namespaces; a run refuses to
    start where it is missing or cannot work, saying how to fix it. "none": start there anyway,
    the code running with limits only (unsafe, said once at start-up); where bubblewrap works,
    runs are isolated all the same."""

    memory_mb: int = Field(4096, ge=64)
    """The memory all of the orchestrator's sandboxed runs at once may hold (coding rewards scored
    a group at a time, python tool calls): a run waits until its worst case fits beside the others
    (orchestrator/rollout/sandbox_budget.py). Its worst case is its own total where the host gives
    cgroups (1024 MB for tasks.coding), else its address space times its processes (16 x 512 MB):
    the start-up line says which."""


class OverlongConfig(Section):
    mode: Literal["keep", "mask", "penalty"] = "keep"
    """Completions cut at max_tokens: "keep" them as they are; "mask" them out of the loss (they
    still count in their group's mean reward); or "penalty": DAPO's soft overlong punishment, a
    reward penalty growing linearly from 0 to `penalty` over the last `buffer` tokens before
    max_tokens. Counted per step as `truncated`."""

    buffer: int = Field(0, ge=0)
    """mode = "penalty": the length of the ramp, tokens (DAPO: L_cache)."""

    penalty: float = Field(1.0, ge=0)
    """mode = "penalty": the penalty at max_tokens."""


class CurriculumConfig(Section):
    enabled: bool = False
    """Generate only rows whose recorded pass rate is informative (orchestrator/prompts/curriculum.py):
    a row drawn again is skipped when its latest group's pass rate lies outside `band`, unless
    drawn for a revisit (revisit_easy, revisit_hard). Saves the generation zero-variance filtering would throw away, on
    datasets whose rows come round again (several passes, or a function that repeats rows)."""

    band: tuple[float, float] = (0.0, 1.0)
    """(low, high): a pass rate strictly between them is informative; at or below low a row is
    hard, at or above high easy. The default keeps every row some rollouts pass and some fail."""

    revisit_easy: float = Field(0.1, gt=0, le=1)
    """Chance that an easy row is generated anyway when drawn: its record stays current."""

    revisit_hard: float = Field(0.1, gt=0, le=1)
    """The same for a hard row (1: hard rows are never skipped, only easy ones). With
    exact-match rewards a row none of a group passed is often one the policy is about to
    learn: skipping it saves generation but can slow learning (benchmarks/curriculum.py)."""

    hard_after: int = Field(3, ge=1)
    """Groups in a row at or below band's low before a row counts as hard (is skipped but for
    revisits). One group of 8 shows no pass for a row the policy passes 1 time in 10 in 43% of
    draws, 2 in a row 18%, 3 in a row 8% (the default): rows the policy is about to learn keep
    being generated while rows beyond its reach are still skipped after a few tries. A row any
    group of which was ever above low never counts as hard: the policy has done it, its failures
    are where it learns it again. With both (and revisit_hard 0.3), on a mix with unsolvable rows
    the curriculum reached pool accuracy 0.50 sooner in wall time than uniform sampling on seven
    seeds of nine (median 0.84x the time), 0.55 no sooner (four of nine): ~1.6x the steps a
    second, a little less learnt per step (docs/datasets.md)."""

    pass_threshold: float = 1.0
    """A rollout passes when its reward is at least this (1.0: an exact answer under the shipped
    scorers; lower for partial-credit rewards)."""

    max_rows: int = Field(100_000, ge=1)
    """Rows the record keeps (the least recently scored go first); it is saved in each
    orchestrator checkpoint."""

    @model_validator(mode="after")
    def _band_order(self) -> CurriculumConfig:
        if not 0 <= self.band[0] < self.band[1] <= 1:
            raise ValueError(f"band {list(self.band)}: expected 0 <= low < high <= 1")
        return self


class PromptsConfig(Section):
    """How a row becomes a prompt (the prompts station, orchestrator/prompts/)."""

    chat: Literal["auto", "on", "off"] = "auto"
    """Render prompts with the tokenizer's chat template (generation prompt added): "on", "off"
    (raw completion: the prompt text as is, for base models), or "auto": on when the model has a
    template (or chat_template is set)."""

    chat_template: Path | None = None
    """A Jinja chat template file used instead of the tokenizer's."""

    chat_template_kwargs: dict[str, Any] = {}
    """Extra variables for the template, e.g. {enable_thinking = false} for Qwen3."""

    system_prompt: str = ""
    """System message put before every chat prompt that has none (a dataset may set its own)."""


class SamplingConfig(Section):
    """How the servers sample (each `[[orchestrator.datasets]]` entry may set the same keys, flat,
    for its own rows: one name per key in both places)."""

    max_tokens: int = Field(16, ge=1)
    """Longest completion (per model turn), tokens."""

    temperature: float = Field(1.0, gt=0)
    """Sampling temperature; the trainer scales its logits by the same value."""

    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling: the smallest set of tokens holding this much probability (1: off);
    recorded with each sample (the trainer renormalises over the kept set: trainer.sampling_mask)."""

    top_k: int = Field(-1, ge=-1)
    """Sample among the k most likely tokens only (-1: off); recorded with each sample."""

    min_p: float = Field(0.0, ge=0, le=1)
    """Drop tokens less likely than min_p times the most likely one (0: off); recorded with each
    sample."""

    stop: list[str] = []
    """Strings that end a completion (besides eos and the chat template's end-of-turn tokens)."""

    record_kept_sets: bool = False
    """Record each sampled token's kept set as the engine had it (the ids min_p, top_k and top_p
    left, read off its processed logprobs: inference/kept_sets.py) in the batch: the trainer then
    renormalises over exactly the sampler's set, not one rebuilt from its own, possibly newer,
    logits (trainer/sampling_mask.py). Needs top_k below inference.max_logprobs, or a vocabulary
    within it; costs that many logprobs per token on the server."""


class SchedulingConfig(Section):
    """What goes into a batch and how far generation runs ahead (orchestrator/orchestrator.py; the
    bound itself is the run's max_async_level)."""

    prompts_per_step: int = Field(16, ge=1)
    """Groups (prompts) in each batch."""

    group_size: int = Field(8, ge=2)
    """Completions per prompt; advantages are relative to the group's mean reward."""

    min_group_episodes: int = Field(2, ge=2)
    """A group trains on the rollouts (episodes) that finished when at least this many of its
    group_size did, advantages computed over those: a reward, an environment's step or an agent
    that raises costs its own rollout. Fewer: the group fails (retried, then dropped)."""

    @field_validator("min_group_episodes")
    @classmethod
    def _at_most_group_size(cls, n: int, info) -> int:
        size = info.data.get("group_size", n)
        if n > size:
            raise ValueError(f"{n} is more than group_size ({size}): every group would fail")
        return n

    normalize_advantages: bool = False
    """Divide group-relative advantages by the group's reward std (GRPO) instead of only
    centring them (Dr. GRPO)."""

    filter_zero_variance: bool = False
    """Drop groups whose rewards are all equal (no learning signal without a teacher); counted
    as `filtered` in the metrics."""

    max_in_flight_groups: int = Field(32, ge=1)
    """Most groups generating or waiting to be batched at once. Above prompts_per_step it
    oversamples: a batch takes the first groups to finish, so one long rollout never holds a batch
    back, and the rest carry over to the next batch while they are fresh enough."""

    max_off_policy_steps: int | None = Field(None, ge=0)
    """m: batch n holds no token sampled by a version older than n-1-m. A group that can no longer
    meet that is cancelled (aborted on its server, prompt requeued). Unset: max_async_level."""

    in_flight_updates: bool = True
    """Load new weights between two decode steps of running requests (samples then mix versions,
    recorded per token and corrected for by the trainer's importance ratio). False: vLLM's pause
    mode "wait", running requests finish on the old weights first (every sample from one version)
    while the engine admits nothing new. On by default: on the reversal recipe the drain cost
    0.25 s of each 0.6 s step and loading in flight cut steps by 3-10% at the same reward; on the
    demo's recipe it moved nothing beyond the seeds' spread (docs/performance.md)."""

    poll_interval_s: float = Field(0.01, gt=0)
    """How often the run directory is checked for new weights while a version is due (a batch
    handed over, its weights not yet served), backing off to five times that while none comes;
    otherwise every ten times that, or at once when a batch is handed over."""

    max_futile_streak: int = Field(200, ge=0)
    """Stop the run (one line naming the dataset, what was counted, the last reason and the fix;
    exit 1) once this many in a row came to nothing for one cause: rows of a dataset that could
    not be rendered within seq_len (ended by a row of it that makes a request), groups of a dataset
    that all failed, its reward raising or timing out (ended by a group of it scored; the streak
    must also have lasted 3 x timeouts.reward_s, or timeouts.request_s with a teacher, so a restart
    passes), or groups all filtered for zero reward variance (filter_zero_variance: a run whose
    groups all look mastered or unlearnable stops by design; ended by a group in a batch).
    0: never stop (docs/reliability.md)."""


class TimeoutsConfig(Section):
    """Every bound the orchestrator waits under, in one place (seconds)."""

    reward_s: float = Field(60, gt=0)
    """Longest one reward may take; a reward that raises or times out fails that rollout only."""

    request_s: float = Field(300, gt=0)
    """Longest a single generation request may take before it is failed and its prompt requeued."""

    server_wait_s: float = Field(600, gt=0)
    """Longest to wait at start-up for a first server to become healthy (with weight_sync
    broadcast: for every listed server) before giving up; and, mid-run, longest with no server in
    rotation before the run stops (one line naming each server and its error, exit 1). Raise it if
    your servers take longer than this to restart."""

    trainer_s: float = Field(3600, gt=0)
    """Longest to wait on the trainer for a new weights version (the async bound, the final
    version) before giving up."""

    tool_s: float = Field(10, gt=0)
    """Longest one tool call may take; past it the model is told the call timed out."""


class EnvironmentConfig(Section):
    """A multi-turn environment rolled out instead of datasets (orchestrator/rollout/environment.py):
    it supplies its own rows and rewards."""

    class_: str = Field("", alias="class")
    """`module:Class` of a multi-turn environment (a tool, text or agent environment: see
    orchestrator/rollout/environment.py); it supplies its own rows and rewards, so
    orchestrator.dataset, reward and datasets are then unused. Empty: single-turn datasets."""

    args: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments the environment class is built with, e.g. {id = "my-taskset"} for
    orchestrator.rollout.verifiers_taskset:VerifiersTaskset."""

    max_turns: int = Field(8, ge=1)
    """Most model calls in one multi-turn episode."""

    @field_validator("class_")
    @classmethod
    def _class_form(cls, spec: str) -> str:
        if spec and not is_module_attr(spec):
            raise ValueError("expected 'package.module:Class'")
        return spec


class CheckpointsConfig(Section):
    keep: int = Field(2, ge=1)
    """Orchestrator checkpoints (step, data cursor, pending prompts) kept under checkpoints/."""



# Keys that moved, by their path under [orchestrator]: the old path and where it lives now
# (moved_key). The first group became table keys (2026-11); the second grouped [orchestrator] by
# the stations of the orchestrator (issue 53); the last, the environment's keys.
MOVED = {
    "server_urls": "servers.urls", "discover_servers": "servers.discover",
    "server_retry_max_s": "servers.retry_max_s", "teacher_url": "teacher.url", "teacher_coef": "teacher.coef",
    "tool_parser": "tools.parser", "overlong_buffer": "overlong.buffer", "overlong_penalty": "overlong.penalty",

    **{key: f"prompts.{key}" for key in ("chat", "chat_template", "chat_template_kwargs", "system_prompt")},
    **{key: f"sampling.{key}" for key in ("max_tokens", "temperature", "top_p", "top_k", "min_p", "stop",
                                          "record_kept_sets")},
    **{key: f"scheduling.{key}" for key in ("prompts_per_step", "group_size", "min_group_episodes",
                                            "normalize_advantages", "filter_zero_variance", "max_in_flight_groups",
                                            "max_off_policy_steps", "in_flight_updates", "poll_interval_s",
                                            "max_futile_streak")},
    "reward_timeout_s": "timeouts.reward_s", "trainer_timeout_s": "timeouts.trainer_s",
    "request_timeout_s": "timeouts.request_s", "servers.request_timeout_s": "timeouts.request_s",
    "server_wait_timeout_s": "timeouts.server_wait_s", "servers.wait_timeout_s": "timeouts.server_wait_s",
    "tool_timeout_s": "timeouts.tool_s", "tools.timeout_s": "timeouts.tool_s",
    "keep_checkpoints": "checkpoints.keep",
    "environment_args": "environment.args", "max_turns": "environment.max_turns",
}

# Keys that were a string and are a table now: the key the string became (moved_key; tests'
# flat keywords, tests/orchestrator_tables.py).
STRING_FORMS = {"environment": "class", "overlong": "mode"}

# The keys of an [[orchestrator.eval.environments]] entry that were renamed with [orchestrator.environment]'s.
EVAL_ENVIRONMENT_MOVED = {"environment": "class", "environment_args": "args"}


def moved_key(orchestrator: Any) -> str | None:
    """One line for the first key of an `[orchestrator]` table written before it was grouped
    (None when there is none)."""
    if not isinstance(orchestrator, dict):
        return None
    for table, key in STRING_FORMS.items():
        if isinstance(orchestrator.get(table), str):
            return (f"orchestrator.{table} is a table now: write `{key} = {json.dumps(orchestrator[table])}` under "
                    f"[orchestrator.{table}] (or --orchestrator.{table}.{key})")
    for old, new in MOVED.items():
        table, _, key = old.rpartition(".")
        holder = orchestrator.get(table) if table else orchestrator
        if isinstance(holder, dict) and key in holder:
            new_table, _, new_key = new.rpartition(".")
            return (f"orchestrator.{old} is now orchestrator.{new}: write it as `{new_key} = ...` under "
                    f"[orchestrator.{new_table}] (or --orchestrator.{new})")
    evaluation = orchestrator.get("eval")
    entries = evaluation.get("environments") if isinstance(evaluation, dict) else None
    for entry in entries if isinstance(entries, list) else []:
        for old, new in EVAL_ENVIRONMENT_MOVED.items():
            if isinstance(entry, dict) and old in entry:
                return (f"orchestrator.eval.environments: `{old}` is now `{new}` in each "
                        f"[[orchestrator.eval.environments]] entry, as under [orchestrator.environment]: "
                        f"write `{new} = ...`")
    return None


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

    dataset: str | None = None
    """`module:function` taking the seed and returning an iterator of rows (JSON-able dicts with
    "prompt"). It must yield the same rows for the same seed: resuming skips the rows used.
    Not with `datasets`. Unset: the reversal task (tasks.reverse:dataset)."""

    reward: str | None = None
    """`module:function(prompt, completion, row)` (sync or async) returning a float or a dict of
    named floats (components, weighted by a dataset's reward_weights); an http(s):// URL answering
    POST {"prompt", "completion", "row"} with {"reward": float or {name: float}}; "math_verify"
    or "reasoning_gym" (tasks/); or "" for none (a teacher alone drives learning).
    The default of every dataset that names no reward of its own."""

    datasets: list[DatasetConfig] = []
    """Datasets mixed by weight (`[[orchestrator.datasets]]`, rl/dataset_config.py): jsonl,
    parquet, HF datasets, reasoning-gym tasks or functions, each with its own fields, reward and
    sampling. Empty: one dataset, orchestrator.dataset scored by orchestrator.reward."""

    eval: EvalConfig = EvalConfig()
    """Held-out evaluation (`[orchestrator.eval]`, rl/dataset_config.py)."""

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

    checkpoints: CheckpointsConfig = CheckpointsConfig()
    """The orchestrator's own checkpoints (`[orchestrator.checkpoints]`)."""

    @field_validator("dataset")
    @classmethod
    def _module_attr(cls, spec: str) -> str:
        if spec and not is_module_attr(spec):
            raise ValueError("expected 'package.module:name'")
        return spec

    @field_validator("reward")
    @classmethod
    def _reward_form(cls, spec: str | None) -> str | None:
        return spec if spec is None else check_reward_spec(spec)

    @model_validator(mode="after")
    def _check_scoring(self) -> OrchestratorConfig:
        if self.environment.class_:
            for key in ("dataset", "reward", "datasets"):
                if getattr(self, key):
                    raise ValueError(f"orchestrator.{key} is unused when orchestrator.environment.class is set "
                                     "(the environment supplies rows and rewards); remove one of them")
            return self
        if self.datasets and self.dataset is not None:
            raise ValueError("orchestrator.dataset is unused when orchestrator.datasets is given: "
                             "list that dataset in orchestrator.datasets (function = ...) instead")
        for evaluation in (False, True):
            names = [d.name for d in self.resolved_datasets(evaluation)]
            if len(set(names)) != len(names):
                key = "orchestrator.eval.datasets" if evaluation else "orchestrator.datasets"
                raise ValueError(f"{key}: names must differ (got {names}); set name = ...")
        for d in self.resolved_datasets(evaluation=True):
            if not d.reward:
                raise ValueError(f"eval dataset {d.name}: no reward to score it (set its reward)")
        for d in self.resolved_datasets():
            if not d.reward and not self.teacher.url and not self.datasets:
                raise ValueError("orchestrator.reward is empty and no orchestrator.teacher.url is set: "
                                 "nothing would score the rollouts")
            if not d.reward and not self.teacher.url:
                raise ValueError(f"dataset {d.name}: no reward (orchestrator.reward or the dataset's reward) and "
                                 "no orchestrator.teacher.url: nothing would score its rollouts")
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
        """Every dataset with the orchestrator-level defaults applied (one from dataset/reward
        when no `datasets` are listed); with `evaluation`, the eval datasets."""
        if evaluation:
            specs = self.eval.datasets
        else:
            specs = self.datasets or [DatasetConfig(name="data", function=self.dataset or REVERSE_DATASET)]
        out = []
        for spec in specs:
            reward = spec.reward or self._default_reward(spec, listed=bool(evaluation or self.datasets))
            system_prompt = self.prompts.system_prompt if spec.system_prompt is None else spec.system_prompt
            out.append(Dataset(spec.label, spec, reward, dict(spec.reward_weights), system_prompt, self.sampling_for(spec)))
        return out

    def sampling_for(self, spec: DatasetConfig | None = None) -> Sampling:
        """The orchestrator's sampling settings, with those a dataset sets instead."""
        def pick(key: str):
            value = None if spec is None else getattr(spec, key)
            return getattr(self.sampling, key) if value is None else value

        return Sampling(temperature=pick("temperature"), top_p=pick("top_p"), top_k=pick("top_k"),
                        min_p=pick("min_p"), max_tokens=pick("max_tokens"), stop=tuple(pick("stop")))

    def _default_reward(self, spec: DatasetConfig, listed: bool) -> str:
        """A listed dataset naming no reward: orchestrator.reward if given explicitly (its default
        scores the reversal task only), else a reasoning-gym task's own scorer, else none."""
        if self.reward is not None:
            return self.reward
        if not listed:
            return REVERSE_REWARD
        return "reasoning_gym" if spec.reasoning_gym else ""


