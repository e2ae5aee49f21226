"""The trainer's side of weight delivery: after step n, version n goes to the inference servers.

One interface, one implementation per way of delivering (RunConfig.weight_delivery, the choice
the orchestrator and the servers follow too), chosen once when the trainer starts (PUBLISHERS):
    AdapterPublisher    "adapters" (trainer.lora.rank > 0): the run's adapter as a peft directory weights/step_n
    BroadcastPublisher  "broadcast" (weight_sync.kind): the full weights streamed from rank 0 to
                        every inference worker (trainer/broadcast.py), weights/step_n holding the manifest
    FilePublisher       "files": the full weights as an HF directory weights/step_n (trainer/weights.py)

With weight_sync.delta both full-weight kinds publish most versions as the values changed since
the last full version (trainer/deltas.py decides which; rl/weights/delta.py is the format).

publish() is a collective (gathering the FSDP2 shards needs every rank); only rank 0 delivers,
and its seconds are the step's write_s in metrics.jsonl.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

import torch

from rl.config import RunConfig
from rl.rundir import STABLE, RunDir
from trainer.deltas import FullVersions, make_versions
from trainer.lora import LoRA
from trainer.policy import Policy
from trainer.weights import (
    gather_full_state_dict,
    prune_weights,
    served_dtype,
    untied,
    write_adapter,
    write_delta,
    write_weights,
)

log = logging.getLogger("trainer")


class Publisher:
    """Delivers a policy's version `step`; rank 0 returns the seconds delivery took, other ranks 0."""

    def __init__(self, rank: int):
        self.rank = rank

    def publish(self, policy: Policy, step: int) -> float:
        # A resumed trainer trains again the steps after its checkpoint (from step 1 before the
        # first one). A version already published stays as it is: servers serving it are never
        # handed other bytes under the same number (a GPU replay need not be bit-exact), nor
        # rolled back while it is rewritten. Every rank sees the same file: all skip or none.
        if (policy.run.weights_dir(step) / STABLE).exists():
            if self.rank == 0:
                log.info("version %d was published before this trainer started: kept as it is", step)
            return 0.0
        tensors = self.gather(policy)  # collective: all ranks
        if self.rank != 0:
            return 0.0
        return self.deliver(policy, step, tensors)

    def gather(self, policy: Policy) -> dict[str, torch.Tensor]:
        """Collective: the full tensors to deliver (on rank 0; other ranks may get nothing)."""
        raise NotImplementedError

    def deliver(self, policy: Policy, step: int, tensors: dict[str, torch.Tensor]) -> float:
        """Rank 0: make version `step` available to the servers; returns seconds taken."""
        raise NotImplementedError

    def close(self) -> None:
        """Release what delivery holds (a broadcast group); the trainer calls it once at the end."""


class FilePublisher(Publisher):
    def __init__(self, rank: int, model: torch.nn.Module, cfg: RunConfig, run: RunDir, tied: bool):
        super().__init__(rank)
        self.model, self.source, self.tied = model, cfg.model, tied
        self.dtype = served_dtype(cfg)  # the servers' own: the bytes they hold, no more
        # Whole versions or deltas against the last whole one (weight_sync.delta).
        self.versions = make_versions(cfg, run) if rank == 0 else FullVersions()

    def gather(self, policy: Policy) -> dict[str, torch.Tensor]:
        return gather_full_state_dict(self.model, self.dtype)

    def deliver(self, policy: Policy, step: int, tensors: dict[str, torch.Tensor]) -> float:
        t = policy.cfg.trainer.files
        start = time.perf_counter()
        tensors = untied(tensors, self.tied)
        delta = self.versions.delta(step, tensors)
        if delta is None:
            digest = self.versions.digest(step, tensors)
            write_weights(policy.run, step, tensors, self.source, self.tied, t.weights_shard_mb << 20, digest)
            self.versions.published_full(step, tensors, digest)
        else:
            write_delta(policy.run, step, delta.manifest, delta.changes)
            log.info("version %d as a delta against version %d: %d values changed, %.1f MB (%.2f s to encode)",
                     step, delta.manifest.base_version, delta.manifest.changed, delta.nbytes / 2**20, delta.encode_s)
        prune_weights(policy.run, t.keep_weights)
        return time.perf_counter() - start


class BroadcastPublisher(FilePublisher):
    def __init__(self, rank: int, model: torch.nn.Module, cfg: RunConfig, run: RunDir, tied: bool):
        super().__init__(rank, model, cfg, run, tied)
        self.broadcaster = None
        if rank == 0:
            from trainer.broadcast import WeightBroadcaster

            self.broadcaster = WeightBroadcaster(cfg, run, tied)  # waits for the servers to join

    def deliver(self, policy: Policy, step: int, tensors: dict[str, torch.Tensor]) -> float:
        # weights/step_n then holds the bucket manifest + STABLE; the tensors (or a delta's
        # changed values) go over the wire.
        tensors = untied(tensors, self.tied)
        delta = self.versions.delta(step, tensors)
        if delta is not None:
            return self.broadcaster.publish_delta(step, delta.manifest, delta.changes)
        digest = self.versions.digest(step, tensors)
        seconds = self.broadcaster.publish(step, tensors, digest)
        self.versions.published_full(step, tensors, digest)
        return seconds

    def close(self) -> None:
        if self.broadcaster is not None:
            self.broadcaster.close()


class AdapterPublisher(Publisher):
    def __init__(self, rank: int, lora: LoRA, base_model: Path):
        super().__init__(rank)
        self.lora, self.base_model = lora, base_model

    def gather(self, policy: Policy) -> dict[str, torch.Tensor]:
        return self.lora.gather(policy.slot)

    def deliver(self, policy: Policy, step: int, tensors: dict[str, torch.Tensor]) -> float:
        seconds = write_adapter(policy.run, step, tensors, self.lora.peft_config(str(self.base_model)))
        prune_weights(policy.run, policy.cfg.trainer.files.keep_weights)
        return seconds


def make_publisher(cfg: RunConfig, run: RunDir, rank: int, model: torch.nn.Module, lora: LoRA | None,
                   tied: bool) -> Publisher:
    """The trainer's one publisher, for the run's RunConfig.weight_delivery; with broadcast, rank 0
    returns once every server joined."""
    return PUBLISHERS[cfg.weight_delivery](cfg, run, rank, model, lora, tied)


PUBLISHERS: dict[str, Callable[..., Publisher]] = {
    "files": lambda cfg, run, rank, model, lora, tied: FilePublisher(rank, model, cfg, run, tied),
    "broadcast": lambda cfg, run, rank, model, lora, tied: BroadcastPublisher(rank, model, cfg, run, tied),
    "adapters": lambda cfg, run, rank, model, lora, tied: AdapterPublisher(rank, lora, cfg.model),
}
"""(cfg, run, rank, model, lora, tied) -> the publisher, one line per kind of delivery."""
