"""What one optimizer step updates: the parameters, their optimizer and schedule, and the run
(config and directory) whose batches train them."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from rl.config import RunConfig
from rl.rundir import RunDir


@dataclass
class Policy:
    """What one optimizer step updates and by which rules: the whole model (full fine-tuning),
    or one run's adapter in one LoRA slot (trainer/runs.py)."""

    cfg: RunConfig
    """The run's config: its loss, optimizer, max_steps, checkpointing."""
    run: RunDir
    params: list[torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    slot: int | None = None
    last_checkpoint: int = 0
    recorded: set[int] = field(default_factory=set)
    """Steps metrics.jsonl already has a record of (rank 0, when resuming): a replayed step
    writes none again."""
