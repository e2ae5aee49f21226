"""AdamW and its learning-rate schedule ([trainer.optim])."""

from __future__ import annotations

import math

import torch

from rl.config import OptimConfig


def lr_factor(index: int, cfg: OptimConfig, max_steps: int) -> float:
    """Multiplier of cfg.lr for optimizer step index+1 (index counts the steps already taken):
    linear warm-up over warmup_steps, then constant, or linear / cosine decay that reaches
    min_lr_ratio exactly at the last step."""
    if index < cfg.warmup_steps:
        return (index + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return 1.0
    progress = min(1.0, (index - cfg.warmup_steps) / max(1, max_steps - cfg.warmup_steps - 1))
    shape = 1.0 - progress if cfg.schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * shape


def build_optimizer(params: list[torch.nn.Parameter], cfg: OptimConfig, max_steps: int
                    ) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: lr_factor(i, cfg, max_steps))
    return optimizer, scheduler
