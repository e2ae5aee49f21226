"""Scoring is an interface: a reward (one kind per dataset, chosen once when the run starts:
orchestrator/rewards/registry.py) scores a group's completions, and a teacher model adds a per-token signal
(on-policy distillation). The rest of the pipeline only sees numbers: a reward gives a float, or
named components (a dict of floats) that `combine` weighs into one, each logged.

A reward that raises or times out fails that one rollout (None here); the caller counts it and
the run goes on.
"""

from __future__ import annotations

import functools
import inspect
import logging
import math
from abc import ABC, abstractmethod

from orchestrator.quiet_warning import Quiet
from rl.inference_api import GenerateRequest, InferenceClient, InferenceError

log = logging.getLogger("orchestrator")

Score = float | dict[str, float]


def as_score(value) -> Score:
    """A reward's answer checked: a finite number, or a dict of them (raises ValueError)."""
    if isinstance(value, dict):
        if not value:
            raise ValueError("returned an empty dict of components")
        return {str(k): as_score(v) for k, v in value.items()}  # type: ignore[misc]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"returned {value!r}, not a finite number or a dict of them")
    return float(value)


def bounded(fn):
    """`fn`, refusing (ValueError) a number outside the range it declares, `fn.bounds = (lo, hi)`
    (tasks/coding.py): a reward out of its range is broken or forged, and fails that
    rollout like one that raises, instead of being trained on. Components of a dict are not checked."""
    if getattr(fn, "bounds", None) is None:
        return fn
    lo, hi = fn.bounds

    def check(value):
        if isinstance(value, (int, float)) and not isinstance(value, bool) and not lo <= value <= hi:
            raise ValueError(f"returned a score outside its range [{lo:g}, {hi:g}]")  # no value: one kind
        return value

    if inspect.iscoroutinefunction(fn):
        @functools.wraps(fn)
        async def checked_async(*args):
            return check(await fn(*args))
        return checked_async

    @functools.wraps(fn)
    def checked(*args):
        return check(fn(*args))
    return checked


def combine(score: Score, weights: dict[str, float]) -> tuple[float, dict[str, float]]:
    """(the reward, its components): a dict's components weighted (unlisted: 1.0) and summed."""
    if isinstance(score, float):
        return score, {}
    return sum(weights.get(k, 1.0) * v for k, v in score.items()), score


def weights_over(reward: Reward | None, dataset_weights: dict[str, float]) -> dict[str, float]:
    """The reward function's own component weights, with its dataset's (reward_weights) over them."""
    return {**(reward.weights if reward else {}), **dataset_weights}


class Reward(ABC):
    """Scores a group's completions; returns one Score or None (failed) per completion.
    `spec`: what the config names (a URL, a built-in name, "module:function")."""

    def __init__(self, spec: str, timeout_s: float):
        self.spec, self.timeout_s = spec, timeout_s
        self.weights: dict[str, float] = {}
        """The components' default weights (a reward function may carry them: tasks/math_answer.py)."""
        self.last_error = ""
        self.quiet = Quiet(log)

    @abstractmethod
    async def score(self, prompt: str, completions: list[str], row: dict) -> list[Score | None]: ...

    def failed(self, what: str) -> None:
        """One rollout's reward failed: kept as the reward's last error (the line that stops a run
        whose every group fails names it: orchestrator/streaks.py) and said, but a failure like the
        last one only every QUIET_S (orchestrator/quiet_warning.py): a reward that always raises would write
        a line per rollout."""
        self.last_error = what
        self.quiet.warn(what, f"reward {self.spec} {what}; that rollout fails")

    def timed_out(self) -> None:
        self.failed(f"timed out after {self.timeout_s:g} s (orchestrator.timeouts.reward_s)")


class FunctionReward(Reward):
    """A Python function reward(prompt, completion, row), loaded once (orchestrator/rewards/registry.py)."""

    def __init__(self, spec: str, timeout_s: float, fn):
        super().__init__(spec, timeout_s)
        self.fn = bounded(fn)
        self.weights = dict(getattr(fn, "weights", None) or {})

    def call(self, prompt: str, completion: str, row: dict) -> Score | None:
        """One sync call, checked; None (and said) if it raised or answered no score."""
        try:
            return as_score(self.fn(prompt, completion, row))
        except Exception as e:
            self.failed(f"raised {type(e).__name__}: {e}")
            return None


class TeacherError(Exception):
    """The teacher server failed; the group is requeued, the policy server stays in rotation."""


class Teacher:
    """A teacher model on its own inference server. For on-policy distillation the student's
    own tokens are scored: the teacher's logprob of each sampled token minus the student's is a
    per-token estimate of -KL(student || teacher), maximised by the policy gradient."""

    def __init__(self, client: InferenceClient, coef: float, timeout_s: float):
        self.client, self.coef, self.timeout_s = client, coef, timeout_s

    async def logprobs(self, request_id: str, tokens: list[int]) -> list[float | None]:
        try:
            response = await self.client.generate(GenerateRequest(
                request_id=request_id, prompt_token_ids=tokens, max_tokens=1, temperature=1.0,
                prompt_logprobs=True), self.timeout_s)
        except InferenceError as e:  # not the policy server's fault: must not take it out of rotation
            raise TeacherError(str(e)) from None
        if response.prompt_logprobs is None or len(response.prompt_logprobs) != len(tokens):
            raise ValueError(f"teacher {self.client.url} returned no prompt logprobs for {len(tokens)} tokens")
        return response.prompt_logprobs

    def advantages(self, teacher_lp: list[float | None], logprobs: list[float], loss_mask: list[int]) -> list[float]:
        return [self.coef * (t - s) if m and t is not None else 0.0
                for t, s, m in zip(teacher_lp, logprobs, loss_mask)]
