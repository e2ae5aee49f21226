"""trainer.model.compile: each decoder layer's forward through torch.compile, before FSDP2 shards it
(torchtitan's per-block compile). A layer's elementwise work (RMSNorm, RoPE, SiLU-gate, residuals)
fuses into a few kernels instead of one launch per op; the layers share one compiled graph
(identical code, their parameters as inputs), and micro-batches of a new width cost one more
compile, after which the width is symbolic.

The forward method is compiled, not the module: FSDP2's hooks (all-gather before the forward,
reshard after) and transformers' activation checkpointing (GradientCheckpointingLayer.__call__)
stay outside the compiled region and work as in eager mode, and the state dict keeps its names
(torch.compile(module) would add "_orig_mod." to every key the publisher and checkpoints write).
"""

from __future__ import annotations

import torch


def compile_wanted(choice: bool | str, device_type: str, lora: bool, moe: bool) -> bool:
    """trainer.model.compile resolved. auto: on CUDA, for full fine-tuning of a dense model; LoRA's
    adapter hooks and routing replay's router hooks keep Python state that a compiled graph would
    have to guard on, so those stay eager (as does the CPU, where compiling costs minutes of
    start-up for a demo that steps in a fraction of a second)."""
    if choice != "auto":
        return bool(choice)
    return device_type == "cuda" and not lora and not moe


def compile_layers(model: torch.nn.Module) -> None:
    for layer in model.model.layers:
        layer.forward = torch.compile(layer.forward)
