"""What the optimizer trains, one kind per run chosen once at start-up (trainer/tunings.py): the
whole model (trainer/full_tuning.py) or LoRA adapters on a frozen base (trainer/adapter_tuning.py,
one adapter per run when several runs share the trainer). The trainer's step, checkpoints and
reference pass ask the kind, never which it is."""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod

import torch

from rl.config import RunConfig
from trainer.lora import LoRA
from trainer.policy import Policy


class Tuning(ABC):
    """`model`: the trained model, FSDP2-sharded (with its adapter slots for LoRA)."""

    def __init__(self, model: torch.nn.Module, lora: LoRA | None):
        self.model = model

    @staticmethod
    def slots(cfg: RunConfig) -> int:
        """Adapter slots the model is loaded with (trainer/model.py): none for the whole model."""
        return 0

    @property
    def first_slot(self) -> int | None:
        """The slot a single run's policy trains (None: the whole model)."""
        return None

    def reset(self, slot: int | None, seed: int) -> None:
        """Fresh trainable weights in `slot` for a run starting there (full: the model as loaded)."""

    @abstractmethod
    def params(self, slot: int | None) -> list[torch.nn.Parameter]:
        """What a policy in `slot` optimizes."""

    def active(self, slot: int | None) -> contextlib.AbstractContextManager:
        """The model computes with `slot`'s weights inside (forward and backward)."""
        return contextlib.nullcontext()

    @abstractmethod
    def reference_logprobs(self, forward, reference: torch.nn.Module | None):
        """The KL reference's (logprobs, entropy) by `forward(model)`: a model of its own, or
        the base model under the adapters."""

    @property
    def own_reference(self) -> bool:
        """Whether the KL reference is a second model (loaded frozen beside this one)."""
        return True

    @abstractmethod
    def checkpoint_state(self, policy: Policy) -> dict:
        """What a checkpoint holds, as tensors of this rank's sharding."""

    def restored(self, policy: Policy, state: dict) -> None:
        """After a checkpoint was loaded into checkpoint_state's tensors."""
