"""LoRA: the base model frozen, adapters trained, one slot per run (trainer/lora.py,
trainer/tuning.py). The KL reference is the base model itself: the forward pass without an
adapter."""

from __future__ import annotations

import contextlib

import torch

from rl.config import RunConfig
from trainer.lora import LoRA
from trainer.policy import Policy
from trainer.tuning import Tuning


class AdapterTuning(Tuning):
    def __init__(self, model: torch.nn.Module, lora: LoRA | None):
        super().__init__(model, lora)
        self.lora = lora

    @staticmethod
    def slots(cfg: RunConfig) -> int:
        """One adapter per run: a slot for each run the trainer may hold at once (multi-run), else one."""
        lora = cfg.trainer.lora
        return lora.slots if lora.multi_run else 1

    @property
    def first_slot(self) -> int | None:
        return 0

    def reset(self, slot: int | None, seed: int) -> None:
        self.lora.reset(slot, seed)

    @property
    def own_reference(self) -> bool:
        return False

    def params(self, slot: int | None) -> list[torch.nn.Parameter]:
        return list(self.lora.params(slot).values())

    def active(self, slot: int | None) -> contextlib.AbstractContextManager:
        return self.lora.use(slot)

    def reference_logprobs(self, forward, reference: torch.nn.Module | None):
        with self.lora.use(None):
            return forward(self.model)

    def checkpoint_state(self, policy: Policy) -> dict:
        """The run's adapter and its optimizer state, under slot-independent names (DCP loads
        them in place: nothing to restore after)."""
        adapter = self.lora.params(policy.slot)
        optim = {}
        for name, param in adapter.items():
            state = policy.optimizer.state[param]
            if not state:  # AdamW's own initial state, so a load has tensors to fill
                state.update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(param),
                             exp_avg_sq=torch.zeros_like(param))
            optim.update({f"{name}.{k}": v for k, v in state.items()})
        return {"adapter": adapter, "optim": optim}
