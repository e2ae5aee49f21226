"""What a dataset is, in the config: where its rows come from, which fields hold the prompt and
the answer, what scores it, and how its completions are sampled. `[[orchestrator.datasets]]`
lists them; several are mixed by weight. A run without that list trains on the tiny model's string
reversal (tasks.reverse).

    [[orchestrator.datasets]]
    name = "arithmetic"
    reasoning_gym = "basic_arithmetic"          # or path = "data/train.jsonl", or function = "m:f"
    task_config = { min_terms = 2, max_terms = 3 }
    weight = 2.0
    reward = "reasoning_gym"                    # the default for reasoning_gym rows
    sampling = { temperature = 0.8 }            # unset keys take [orchestrator.sampling]'s
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from rl.addresses import check_http_url
from rl.config.section import Section

# reward = "<name>" shorthands for the scorers shipped in tasks/.
BUILTIN_REWARDS = {
    "reasoning_gym": "tasks.gym_tasks:reward",
    "math_verify": "tasks.math_answer:reward",
}


def is_module_attr(spec: str) -> bool:
    module, colon, attr = spec.partition(":")
    return bool(colon and module.strip() and attr.strip() and " " not in spec)


def check_reward_spec(spec: str) -> str:
    if "://" in spec:
        return check_http_url(spec)
    if spec and spec not in BUILTIN_REWARDS and not is_module_attr(spec):
        raise ValueError(f"expected 'package.module:function', an http(s):// URL, or one of {sorted(BUILTIN_REWARDS)}")
    return spec


class Sampling(BaseModel):
    """How one dataset's completions are drawn; recorded with every sample (rl/batch.py)."""

    model_config = ConfigDict(frozen=True)
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    max_tokens: int
    stop: tuple[str, ...]


class DatasetSampling(Section):
    """A dataset's own sampling (`sampling = {...}` in its [[orchestrator.datasets]] entry): each
    key set here replaces orchestrator.sampling's for this dataset's rows; unset keys take it."""

    temperature: float | None = Field(None, gt=0)
    """This dataset's sampling temperature; unset: orchestrator.sampling.temperature."""

    top_p: float | None = Field(None, gt=0, le=1)
    """This dataset's nucleus sampling; unset: orchestrator.sampling.top_p."""

    top_k: int | None = Field(None, ge=-1)
    """This dataset's top-k (-1: off); unset: orchestrator.sampling.top_k."""

    min_p: float | None = Field(None, ge=0, le=1)
    """This dataset's min-p; unset: orchestrator.sampling.min_p."""

    max_tokens: int | None = Field(None, ge=1)
    """This dataset's longest completion, tokens; unset: orchestrator.sampling.max_tokens."""

    stop: list[str] | None = None
    """This dataset's stop strings; unset: orchestrator.sampling.stop."""


class DatasetPrompts(Section):
    """A dataset's own prompt settings (`prompts = {...}` in its entry), replacing
    orchestrator.prompts' for its rows."""

    system_prompt: str | None = None
    """System message put before each prompt that has none. Unset: orchestrator.prompts.system_prompt."""


class DatasetConfig(Section):
    name: str = Field("", pattern=r"^[A-Za-z0-9_.-]{0,64}$")
    """Names the dataset in logs and metrics (reward_mean/<name>). Empty: the task name or file stem."""

    weight: float = Field(1.0, gt=0)
    """Share of prompts drawn from this dataset, relative to the others' weights."""

    path: str = ""
    """A .jsonl or .parquet file; a directory saved by datasets' save_to_disk; or a directory or
    glob of .jsonl/.parquet data files (read with the `datasets` package)."""

    split: str = "train"
    """Split to use where `path` holds several (save_to_disk of a DatasetDict)."""

    reasoning_gym: str = ""
    """A procedural task of the reasoning-gym package by name (e.g. "basic_arithmetic"): rows are
    generated from the run's seed, and its own scorer is the default reward."""

    size: int = Field(10_000, ge=1)
    """reasoning_gym: rows generated per pass (then reshuffled and reused)."""

    seed: int | None = None
    """Seed of this dataset's rows and order instead of the run's: e.g. a held-out evaluation set
    of the task the run trains on (reasoning_gym rows differ by seed)."""

    task_config: dict[str, Any] = {}
    """reasoning_gym: the task's own settings (its config class's fields), e.g. {min_terms = 2}."""

    function: str = ""
    """`module:function` taking the seed and returning an iterator of rows (JSON-able dicts), the
    same rows for the same seed. Its order is its own: not shuffled, one pass."""

    prompt_key: str = "prompt"
    """Field holding the prompt text (reasoning_gym rows: their question)."""

    messages_key: str = "messages"
    """Field holding the prompt as chat messages ([{role, content}, ...]); used when present."""

    completion_key: str = "completion"
    """rl sft: field holding the assistant's answer to the prompt, for rows without messages
    (reasoning_gym rows: set it to "answer")."""

    answer_key: str = "answer"
    """Field holding the reference answer, which rewards read as row["answer"]."""

    shuffle: bool = True
    """Shuffle rows with the run's seed, again for every pass (function datasets: never)."""

    passes: int | None = Field(None, ge=1)
    """Passes over the rows before the dataset is used up (it then leaves the mix). Unset: as many
    as the run needs."""

    reward: str = ""
    """`module:function(prompt, completion, row)` returning a float or a dict of named floats; an
    http(s):// URL; "math_verify" (final answer against row["answer"]); or "reasoning_gym" (the
    task's scorer; the default for reasoning_gym datasets). Empty: none, where a teacher
    (orchestrator.teacher.url) alone drives learning."""

    reward_weights: dict[str, float] = {}
    """A reward returning named components: the weight of each in the reward (missing: 1.0). Each
    component's mean is logged."""

    sampling: DatasetSampling = DatasetSampling()
    """This dataset's sampling where it differs from [orchestrator.sampling] (the same keys, under
    the same name: `sampling = { temperature = 0.8, max_tokens = 512 }`)."""

    prompts: DatasetPrompts = DatasetPrompts()
    """This dataset's prompt settings where they differ from [orchestrator.prompts]
    (`prompts = { system_prompt = "..." }`)."""

    @field_validator("function")
    @classmethod
    def _function_form(cls, spec: str) -> str:
        if spec and not is_module_attr(spec):
            raise ValueError("expected 'package.module:function'")
        return spec

    @field_validator("reward")
    @classmethod
    def _reward_form(cls, spec: str) -> str:
        return check_reward_spec(spec)

    @model_validator(mode="after")
    def _one_source(self) -> DatasetConfig:
        given = [k for k in ("path", "reasoning_gym", "function") if getattr(self, k)]
        if len(given) != 1:
            raise ValueError(f"a dataset needs exactly one of path, reasoning_gym, function (got {given or 'none'})")
        if self.reward == "reasoning_gym" and not self.reasoning_gym:
            raise ValueError('reward = "reasoning_gym" scores reasoning_gym datasets only')
        return self

    @property
    def label(self) -> str:
        if self.name:
            return self.name
        if self.reasoning_gym:
            return self.reasoning_gym
        if self.path:
            stem = self.path.rstrip("/").rsplit("/", 1)[-1].split(".", 1)[0]
            return stem.replace("*", "") or "data"
        return self.function.rpartition(":")[0].rpartition(".")[2] or "data"


class EvalEnvironment(Section):
    """An environment evaluated on held-out rows: `rows` episodes (x `samples`) of the rows its
    dataset(seed) yields, scored by its reward; per episode also its turns, tool calls and errors."""

    name: str = Field(min_length=1)
    """eval/<name>/... in metrics.jsonl."""
    class_: str = Field(min_length=1, alias="class")
    """"module:Class", as orchestrator.environment.class (a tool, text or agent environment)."""
    args: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments it is built with."""
    max_turns: int | None = Field(None, ge=1)
    """Most model calls in one of its episodes; unset: orchestrator.environment.max_turns."""
    seed: int = 10000
    """The seed of its held-out rows (dataset(seed)): keep it clear of the training run's."""

    @field_validator("class_")
    @classmethod
    def _class_form(cls, spec: str) -> str:
        if not is_module_attr(spec):
            raise ValueError("expected 'package.module:Class'")
        return spec


class EvalConfig(Section):
    """Held-out evaluation: `samples` completions (greedy by default) of the first `rows` rows of
    each dataset, scored by its reward, of the starting weights (version 0, once the first batch
    is handed over, the servers keeping version 0 until it ends), every `every` steps, and the
    final one. It runs beside training on the same servers (at most `concurrency` requests at
    once), not in its way. Logged as program "eval" in metrics.jsonl (eval/<dataset>/reward,
    .../accuracy, .../pass@k)."""

    datasets: list[DatasetConfig] = []
    """Evaluation datasets, as in orchestrator.datasets (their max_tokens, stop and, when sampled,
    top_p/top_k/min_p apply; the temperature is eval.temperature). Empty, with no environments
    either: no evaluation."""

    environments: list[EvalEnvironment] = []
    """Environments evaluated too ([[orchestrator.eval.environments]]): episodes of their held-out
    rows, greedy or sampled as below, with the run's tools and parser (and its
    orchestrator.environment.max_turns unless an entry sets its own)."""

    samples: int = Field(1, ge=1, le=1024)
    """Completions per row: pass@k is reported for k = 1 and k = samples (unbiased estimator)."""

    temperature: float = Field(0.0, ge=0)
    """0: greedy (then samples must be 1); above 0: sampled at this temperature."""

    concurrency: int = Field(64, ge=1)
    """Most evaluation requests in flight at once: the share of the servers evaluation may take."""

    rows: int = Field(100, ge=1)
    """Rows evaluated per dataset."""

    every: int = Field(0, ge=0)
    """Evaluate every this many steps too; 0: only the starting weights and the last version."""

    @model_validator(mode="after")
    def _greedy_once(self) -> EvalConfig:
        if self.temperature == 0 and self.samples > 1:
            raise ValueError("eval.samples > 1 needs eval.temperature > 0: greedy completions of a row are all alike")
        return self


@dataclass(frozen=True)
class Dataset:
    """A dataset with every orchestrator-level default applied: what the orchestrator uses."""

    name: str
    spec: DatasetConfig
    reward: str
    reward_weights: dict[str, float]
    system_prompt: str
    sampling: Sampling
