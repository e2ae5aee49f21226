"""What becomes of a group that does not go into a batch as it is: filtered for zero reward
variance, failed (its prompt retried, then dropped), or its row skipped. Each is also a futile
event for the run's streaks (orchestrator/streaks.py), said with why and the fix, so a run that
can only spin stops with one line instead of drawing rows forever.

The orchestrator (orchestrator/orchestrator.py) calls it when a group ends; it keeps the counts.
"""

from __future__ import annotations

import logging

from orchestrator.prompts import Prompt, PromptQueue, RowError
from orchestrator.quiet_warning import Quiet
from orchestrator.rollout import Group, RolloutKind
from orchestrator.streaks import Streaks
from rl.config.orchestrator import OrchestratorConfig

log = logging.getLogger("orchestrator")

MAX_ATTEMPTS = 3  # a prompt whose group fails (rewards, teacher) this often is dropped


def futile_spans(settings: OrchestratorConfig) -> dict[str, float]:
    """How long a streak of failed groups must last before it stops the run (orchestrator/streaks.py):
    as long as this run waits on a slow reward (each of a prompt's MAX_ATTEMPTS) or teacher before
    calling it down, so a reward endpoint or teacher restarting does not end the run."""
    span = MAX_ATTEMPTS * settings.timeouts.reward_s
    if settings.teacher.url:
        span = max(span, settings.timeouts.request_s)
    return {"failed": span}


class GroupOutcomes:
    def __init__(self, settings: OrchestratorConfig, kind: RolloutKind, queue: PromptQueue, has_teacher: bool):
        self.kind, self.queue = kind, queue
        # What would make the run spin ends it (the scheduling loop asks streaks.verdict).
        self.streaks = Streaks(settings.scheduling.max_futile_streak, futile_spans(settings))
        # Without a teacher a group whose rewards are all equal has no learning signal.
        self.filter_equal = settings.scheduling.filter_zero_variance and not has_teacher
        self.attempts: dict[int, int] = {}  # prompt index -> failed groups so far
        self.requeue_quiet = Quiet(log)  # a teacher that is down fails every group: not a line per group
        self.best_reward = float("-inf")  # the highest reward any group got: is a filtered one mastered?
        self.filtered_rewards: dict[float, None] = {}  # each reward of the groups filtered since one was batched

    def keep(self, prompt: Prompt, group: Group) -> bool:
        """A scored group: whether it goes into a batch (False: filtered for zero variance)."""
        who = self.kind.culprit(prompt)
        self.streaks.scored(who)
        self.best_reward = max(self.best_reward, *group.rewards)
        if self.filter_equal and len(set(group.rewards)) == 1:
            self.filtered(prompt, group.rewards[0])
            return False
        self.filtered_rewards.clear()
        self.streaks.good(who)
        return True

    def filtered(self, prompt: Prompt, reward: float) -> None:
        """A group filtered for zero reward variance: a futile event, said as either the task looking
        mastered (every group since the last batched one got the highest reward seen, above 0: the
        shipped scorers give 1 for a right answer) or unlearnable (one low reward for all)."""
        self.filtered_rewards[reward] = None
        who, rewards = self.kind.culprit(prompt), list(self.filtered_rewards)
        if rewards == [self.best_reward] and reward > 0:
            why = f"every group got reward {reward:g}, the highest seen in this run: the task looks mastered"
            fix = "harder rows, or end the run here; or set orchestrator.scheduling.filter_zero_variance = false"
        elif len(rewards) == 1:
            sampling = self.kind.sampling(prompt)
            why = (f"every group got the same low reward {reward:g} (the highest seen: {self.best_reward:g}): "
                   f"unlearnable at temperature {sampling.temperature:g}")
            fix = ("make the task learnable at the model's level (easier rows, partial credit, a higher "
                   "temperature), or set orchestrator.scheduling.filter_zero_variance = false")
        else:
            seen = ", ".join(f"{r:g}" for r in rewards)
            why = f"each group got one reward for all its rollouts (last: {reward:g}; seen: {seen})"
            fix = "set orchestrator.scheduling.filter_zero_variance = false, or make rewards differ within a group"
        self.streaks.hit("filtered", who, why, f"{fix} (or orchestrator.scheduling.max_futile_streak = 0)")

    def skipped(self, prompt: Prompt, e: RowError) -> None:
        """A row that cannot be rendered (too long, a template error): skipped, not retried."""
        self.streaks.hit("skipped", self.kind.culprit(prompt), str(e), e.fix)

    def retry_or_drop(self, gid: str, prompt: Prompt, why: str) -> None:
        """Requeue a prompt whose group failed for a reason that may pass (a reward endpoint
        down); after MAX_ATTEMPTS the prompt is dropped, loudly, rather than retried forever."""
        n = self.attempts[prompt.index] = self.attempts.get(prompt.index, 0) + 1
        self.streaks.hit("failed", self.kind.culprit(prompt), why, self.kind.failure_fix(prompt))
        if n < MAX_ATTEMPTS:
            self.requeue_quiet.warn(why.split(":", 1)[0], f"group {gid} failed ({why}); prompt {prompt.index} requeued")
            self.queue.give_back(prompt)
        else:
            log.error("group %s failed (%s); prompt %d dropped after %d attempts", gid, why, prompt.index, n)
            self.attempts.pop(prompt.index)
