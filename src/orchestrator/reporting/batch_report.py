"""What the orchestrator says about each batch it hands over: one record in metrics.jsonl (the
counters since the previous batch, staleness, waits, idle servers, rewards) and one log line, and
the forwarding of metrics.jsonl to the trackers (orchestrator/reporting/tracking.py) when wandb or TensorBoard is on.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from orchestrator import prometheus
from orchestrator.reporting.tracking import Tracker
from rl.batch import Batch
from rl.config import RunConfig
from rl.rundir import RunDir

if TYPE_CHECKING:
    from orchestrator.rollout import Group
    from orchestrator.servers import ServerPool

log = logging.getLogger("orchestrator")


@dataclass
class Counters:
    """Since the previous batch."""
    model_tokens: int = 0
    cancelled: int = 0
    failed: int = 0
    """Episodes failed in every group scored (the record's episodes_failed_scored)."""
    failed_requests: int = 0
    filtered: int = 0
    sampled_rewards: list[float] = field(default_factory=list)
    """Every scored sample's reward, its group batched or filtered: the policy's own mean reward,
    where the batch's is only that of the groups kept (higher or lower with filter_zero_variance)."""
    dropped_stale: int = 0
    requeued: int = 0
    """Groups taken off a server that stopped answering, prompts requeued."""
    skipped_rows: int = 0
    """Rows that cannot make a prompt (no prompt, a template that fails on them, too long)."""
    skipped_image_rows: int = 0
    """Of those, rows skipped for an image (missing, unreadable, outside the roots, a decompression
    bomb, too many: orchestrator/prompts/images.py)."""
    first_skip: str = ""
    """Why the first of them was skipped (logged with the count, once per batch)."""
    started: float = field(default_factory=time.monotonic)


class Reporting:
    def __init__(self, cfg: RunConfig, run_dir: RunDir, pool: ServerPool, per_dataset: bool):
        self.cfg, self.run_dir, self.pool = cfg, run_dir, pool
        self.per_dataset = per_dataset  # several datasets: each one's mean reward too
        t = cfg.tracking
        self.tracker = Tracker(cfg) if t.wandb or t.tensorboard else None
        prometheus.start(cfg, lambda: len(pool.servers), lambda: len(pool.in_rotation))  # with metrics_port

    def report(self, batch: Batch, groups: list[Group], c: Counters, trainer_wait: float, group_wait: float,
               in_flight: int, buffered: int, extra: dict | None = None, handover_s: float = 0.0) -> None:
        """`c`: the counters since the previous batch; `in_flight`, `buffered`: groups
        generating, and finished but not in a batch yet; `extra`: more of the step's metrics
        (the curriculum's); `handover_s`: how long the batch took to hand over."""
        elapsed = max(time.monotonic() - c.started, 1e-9)
        step = batch.step
        servers = max(len(self.pool.in_rotation), 1)
        record = {
            **batch_record(batch),
            "tokens_per_s": c.model_tokens / elapsed,
            "wait_s": trainer_wait + group_wait, "trainer_wait_frac": trainer_wait / elapsed,
            "group_wait_s": group_wait, "handover_s": handover_s,
            "inference_idle_frac": self.pool.take_idle_s() / (elapsed * servers),
            "cancelled": c.cancelled, "episodes_failed_scored": c.failed, "failed_requests": c.failed_requests,
            "filtered": c.filtered, "dropped_stale": c.dropped_stale, "requeued": c.requeued,
            "in_flight": in_flight, "buffered": buffered,
            "serving_version": self.pool.serving_version, "servers_in_rotation": len(self.pool.in_rotation),
            "truncated": sum(g.truncated for g in groups), "skipped_rows": c.skipped_rows,
            "skipped_image_rows": c.skipped_image_rows,
            # Two counts of failed episodes, named apart: those of every group scored since the last batch
            # (filtered, retried and carried-over groups included), and those of this batch's own groups.
            "episodes_failed_batched": sum(g.failed for g in groups), "groups_short": sum(g.short for g in groups),
            "samples_scored": len(c.sampled_rewards),
            **({"reward_sampled_mean": sum(c.sampled_rewards) / len(c.sampled_rewards)} if c.sampled_rewards else {}),
            **({} if (update_s := self.pool.delivery.take_update_s()) is None else {"weight_update_s": update_s}),
            **reward_details(groups, self.per_dataset),
            **(extra or {}),
        }
        self.run_dir.append_metrics(record)
        prometheus.batch_reported(record, c.model_tokens, handover_s)
        log.info("batch %d reward %.3f staleness %.2f (max %d) %.0f tok/s | waited trainer %.2fs groups %.2fs "
                 "| in-flight %d idle %.0f%% | cancelled %d failed %d filtered %d stale %d truncated %d",
                 step, record["reward_mean"], record["staleness_mean"], record["staleness_max"],
                 record["tokens_per_s"], trainer_wait, group_wait, record["in_flight"],
                 100 * record["inference_idle_frac"], c.cancelled, c.failed + c.failed_requests,
                 c.filtered, c.dropped_stale, record["truncated"])

    def recover(self, step: int, read_batch: Callable[[], Batch]) -> None:
        """The record of checkpointed batch `step` if its orchestrator was killed before writing
        it (between the checkpoint and the end of its hand-over): what the batch itself tells,
        marked "recovered"; the counters and waits of that interval died with the process."""
        if step in self.run_dir.recorded_steps("orchestrator"):
            return
        batch = read_batch()
        record = {**batch_record(batch), "recovered": True}
        self.run_dir.append_metrics(record)
        log.info("batch %d reward %.3f staleness %.2f (max %d) | recorded after the restart (its orchestrator "
                 "was killed before writing it)", batch.step, record["reward_mean"], record["staleness_mean"],
                 record["staleness_max"])

    # --- trackers ------------------------------------------------------------------------------

    async def track(self) -> None:
        """Forward metrics.jsonl to the trackers (orchestrator/reporting/tracking.py), off the event loop."""
        while True:
            await asyncio.to_thread(self.tracker.forward)
            await asyncio.sleep(2.0)

    async def close_tracker(self) -> None:
        """Last records: the trainer writes its final step's after publishing the version this
        orchestrator waited for, so give it a moment."""
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not self._trainer_logged(self.cfg.max_steps):
            await asyncio.sleep(0.5)
        await asyncio.to_thread(self.tracker.close)

    def _trainer_logged(self, step: int) -> bool:
        try:
            lines = self.run_dir.metrics.read_bytes()[-65536:].splitlines()[1:]  # the first may be cut
        except OSError:
            return True
        for line in reversed(lines):
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if record.get("program") == "trainer" and record.get("step") == step:
                return True
        return False


def batch_record(batch: Batch) -> dict:
    """The part of a batch's record that the batch itself holds: rewards and staleness."""
    staleness = [batch.step - 1 - int(v) for v in batch.versions]
    rewards = [float(r) for r in batch.rewards]
    return {
        "program": "orchestrator", "step": batch.step,
        "reward_mean": sum(rewards) / len(rewards),
        "staleness_mean": sum(staleness) / len(staleness), "staleness_max": max(staleness),
        "staleness_hist": {str(s): n for s, n in sorted(collections.Counter(staleness).items())},
    }


def reward_details(groups: list[Group], per_dataset: bool) -> dict[str, float]:
    """Mean of each named reward component ("reward/<name>"), of tool episodes' counts
    ("episode/turns", "episode/tool_calls", ...) and, with several datasets, each dataset's mean
    reward ("reward_mean/<dataset>")."""
    parts: dict[str, list[float]] = collections.defaultdict(list)
    for g in groups:
        if per_dataset:
            parts[f"reward_mean/{g.prompt.source}"] += g.rewards
        for components in g.components:
            for name, value in components.items():
                parts[f"reward/{name}"].append(value)
        for episode in g.episodes:
            for name, value in episode.items():
                parts[f"episode/{name}"].append(value)
    return {key: sum(values) / len(values) for key, values in sorted(parts.items())}
