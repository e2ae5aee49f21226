"""LoRA adapters on the trainer's model, in slots: one adapter per run trained at once.

Each target linear layer (`[trainer.lora] target_modules`, inside the decoder layers) gets a
child module `lora` holding, per slot, A [rank, in] and B [out, rank], and a forward hook that
adds (alpha / rank) * B A dropout(x) of the active slot to its output. No slot active: the base
model, which is also the KL reference of every run.

Why slots fixed at start-up rather than peft's add_adapter per run: FSDP2 shards the parameters
that exist when `fully_shard` runs. Runs join and leave a live trainer, so every adapter a run
could use is created (and sharded) up front, and a joining run re-initialises a free slot. Why
hooks rather than wrapping the linear layers: the base weights keep their HF names, so loading,
the reference model and full-weight code paths see the model they expect.

What leaves the trainer is plain peft format (adapter_model.safetensors + adapter_config.json):
peft's PeftModel.from_pretrained and vLLM's LoRA loader read it as they read any adapter.
"""

from __future__ import annotations

import math
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from rl.config import LoRAConfig
from trainer.vision import tower_prefix


class Adapters(nn.Module):
    """The slots of one linear layer: A[s] [rank, in], B[s] [out, rank]."""

    def __init__(self, in_features: int, out_features: int, rank: int, slots: int):
        super().__init__()
        self.A = nn.ParameterList([nn.Parameter(torch.zeros(rank, in_features)) for _ in range(slots)])
        self.B = nn.ParameterList([nn.Parameter(torch.zeros(out_features, rank)) for _ in range(slots)])


class LoRA:
    def __init__(self, model: nn.Module, cfg: LoRAConfig, slots: int):
        self.cfg, self.slots = cfg, slots
        self.scaling = cfg.alpha / cfg.rank
        self.active: int | None = None
        # Module path (HF name, e.g. model.layers.0.self_attn.q_proj) -> its Adapters.
        self.layers: dict[str, Adapters] = {}
        model.requires_grad_(False)
        targets = set(cfg.target_modules)
        tower = tower_prefix(model)
        for name, module in model.named_modules():
            # Only inside the decoder layers: vLLM serves no adapter on lm_head or embeddings, nor
            # on a vision-language model's vision tower (its encoder layers look alike by name).
            if tower is not None and name.startswith(tower):
                continue
            if isinstance(module, nn.Linear) and ".layers." in name and name.rsplit(".", 1)[-1] in targets:
                adapters = Adapters(module.in_features, module.out_features, cfg.rank, slots)
                module.add_module("lora", adapters)
                module.register_forward_hook(self._hook)
                self.layers[name] = adapters
        if not self.layers:
            raise ValueError(f"trainer.lora.target_modules: none of {sorted(targets)} is a linear layer of the "
                             "model's decoder layers")
        found = {n.rsplit(".", 1)[-1] for n in self.layers}
        self.target_modules = sorted(found)

    def _hook(self, module: nn.Module, args, output: torch.Tensor) -> torch.Tensor:
        s = self.active
        if s is None:
            return output
        x = F.dropout(args[0], self.cfg.dropout, module.training) if self.cfg.dropout else args[0]
        lora = module.lora
        return output + F.linear(F.linear(x, lora.A[s]), lora.B[s]) * self.scaling

    @contextmanager
    def use(self, slot: int | None):
        """Forward passes inside use the adapter in `slot` (None: the base model)."""
        previous, self.active = self.active, slot
        try:
            yield
        finally:
            self.active = previous

    def params(self, slot: int) -> dict[str, nn.Parameter]:
        """The slot's parameters under slot-independent names (module.lora_A / module.lora_B):
        checkpoints and optimizer state use these, so a run may come back in another slot."""
        out = {}
        for name, adapters in self.layers.items():
            out[f"{name}.lora_A"] = adapters.A[slot]
            out[f"{name}.lora_B"] = adapters.B[slot]
        return out

    @torch.no_grad()
    def reset(self, slot: int, seed: int) -> None:
        """A fresh adapter: A as nn.Linear initialises weights (as peft does), B zero, so the
        adapted model starts exactly as the base model (version 0 is the base). Every rank draws
        the same full matrices from `seed` and keeps its own shard."""
        g = torch.Generator().manual_seed(seed)
        for name, p in self.params(slot).items():
            full = torch.zeros(p.shape)
            if name.endswith("lora_A"):
                bound = 1 / math.sqrt(p.shape[1])  # kaiming_uniform(a=sqrt(5)) of a [rank, in] weight
                full.uniform_(-bound, bound, generator=g)
            _copy_full(p, full)

    def gather(self, slot: int) -> dict[str, torch.Tensor]:
        """Collective (every rank): the slot's full tensors in peft's names, on CPU."""
        return {f"base_model.model.{name}.weight": _full(p).float().cpu() for name, p in self.params(slot).items()}

    def peft_config(self, base_model: str) -> dict:
        return {
            "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
            "r": self.cfg.rank, "lora_alpha": self.cfg.alpha, "lora_dropout": self.cfg.dropout,
            "target_modules": self.target_modules, "bias": "none", "fan_in_fan_out": False,
            "use_rslora": False, "use_dora": False, "modules_to_save": None, "inference_mode": True,
        }


def _full(p: torch.Tensor) -> torch.Tensor:
    return p.full_tensor() if hasattr(p, "full_tensor") else p


def _copy_full(p: torch.Tensor, full: torch.Tensor) -> None:
    """Copy a full tensor (the same on every rank) into a possibly sharded parameter."""
    if hasattr(p, "device_mesh"):
        from torch.distributed.tensor import distribute_tensor

        full = distribute_tensor(full.to(p.dtype), p.device_mesh, p.placements)
        p.to_local().copy_(full.to_local())
    else:
        p.copy_(full)
