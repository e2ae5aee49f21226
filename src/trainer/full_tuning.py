"""Full fine-tuning: every parameter of the model is trained (trainer/tuning.py)."""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from trainer.policy import Policy
from trainer.tuning import Tuning


class FullTuning(Tuning):
    def params(self, slot: int | None) -> list[torch.nn.Parameter]:
        # A frozen part (a VLM's vision tower: trainer.vision.train_tower) never gets a gradient,
        # and AdamW skips (no state, no weight decay) a parameter without one.
        return list(self.model.parameters())

    def reference_logprobs(self, forward, reference: torch.nn.Module | None):
        return forward(reference)

    def checkpoint_state(self, policy: Policy) -> dict:
        # get_state_dict materialises the optimizer's (empty) state first, so DCP has tensors
        # of the right sharding to load into.
        model_sd, optim_sd = get_state_dict(self.model, policy.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def restored(self, policy: Policy, state: dict) -> None:
        set_state_dict(self.model, policy.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
