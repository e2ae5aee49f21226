"""The registry of tuning kinds (trainer/tuning.py): a new kind is a file with its class and one
line here. The run's kind follows from its config: LoRA adapters when trainer.lora.rank > 0, else
the whole model."""

from __future__ import annotations

from rl.config import RunConfig
from trainer.adapter_tuning import AdapterTuning
from trainer.full_tuning import FullTuning
from trainer.tuning import Tuning

TUNINGS: dict[str, type[Tuning]] = {
    "full": FullTuning,
    "adapters": AdapterTuning,
}


def tuning_kind(cfg: RunConfig) -> str:
    return "adapters" if cfg.trainer.lora.rank > 0 else "full"
