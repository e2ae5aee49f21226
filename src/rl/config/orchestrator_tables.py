"""The tables of `[orchestrator]` that say where the servers are and how a batch is made:
`[orchestrator.servers]`, `[orchestrator.teacher]`, `[orchestrator.prompts]`,
`[orchestrator.sampling]`, `[orchestrator.scheduling]`, `[orchestrator.timeouts]`."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator

from rl.addresses import HttpUrl
from rl.config.section import Section


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
    recorded with each sample (the trainer renormalises over the kept set: trainer.mismatch.sampling_mask)."""

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

    weights_s: float = Field(3600, gt=0)
    """Longest to wait on the trainer for its next weights version (the async bound, the final
    version) before giving up. Its mirror is trainer.timeouts.batch_s, the trainer's wait for the
    orchestrator's next batch."""

    tool_s: float = Field(10, gt=0)
    """Longest one tool call may take; past it the model is told the call timed out."""

    eval_s: float = Field(600, gt=0)
    """Longest one held-out evaluation ([orchestrator.eval]) may take before it is given up
    (logged) and the run goes on."""
