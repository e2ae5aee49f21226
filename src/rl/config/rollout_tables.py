"""The tables of `[orchestrator]` that shape one rollout beyond its sampling: the multi-turn
`[orchestrator.environment]`, its `[orchestrator.tools]` and `[orchestrator.sandbox]`,
`[orchestrator.overlong]` (completions cut at max_tokens) and `[orchestrator.curriculum]` (which
drawn rows are generated)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from rl.config.datasets import is_module_attr
from rl.config.section import Section


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
    python tool: orchestrator/sandbox/sandbox.py). "bwrap": by bubblewrap's namespaces; a run refuses to
    start where it is missing or cannot work, saying how to fix it. "none": start there anyway,
    the code running with limits only (unsafe, said once at start-up); where bubblewrap works,
    runs are isolated all the same."""

    memory_mb: int = Field(4096, ge=64)
    """The memory all of the orchestrator's sandboxed runs at once may hold (coding rewards scored
    a group at a time, python tool calls): a run waits until its worst case fits beside the others
    (orchestrator/sandbox/sandbox_budget.py). Its worst case is its own total where the host gives
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


class EnvironmentConfig(Section):
    """A multi-turn environment rolled out instead of datasets (orchestrator/rollout/environment.py):
    it supplies its own rows and rewards."""

    class_: str = Field("", alias="class")
    """`module:Class` of a multi-turn environment (a tool, text or agent environment: see
    orchestrator/rollout/environment.py); it supplies its own rows and rewards, so
    orchestrator.datasets are then unused. Empty: single-turn datasets."""

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


