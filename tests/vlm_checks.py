"""The float64 reference the VLM tests compare the engine and the trainer with: models/tiny-vlm
in float64 through the trainer's own vision path (trainer/vision.py), its logits and logprobs
for ids with pictures, and float32 rounding's bound on a logit with the vision path chained in
front (tests/float32_rounding.py's analysis); the metrics records of a run. Shared by the VLM
run, weight-sync, FSDP, inference and agent-picture tests."""

from __future__ import annotations

import json

import numpy as np
import torch

from conftest import ROOT
from float32_rounding import LAYERS, U, WIDEST
from rl.rundir import RunDir

MODEL = ROOT / "models" / "tiny-vlm"
VISION_LAYERS = 2  # models/tiny-vlm/config.json vision_config.num_hidden_layers (widths 64, 128 < WIDEST)


def vlm_logit_error() -> float:
    """tests/float32_rounding.py's logit_error(6) with the vision path chained in front: each
    image token's hidden state is the patch embedding (192 terms), 2 encoder layers (6 chained
    products each, as a decoder layer), the connector's projection (256 terms), then the
    language model's 4 layers and the head; every width at most WIDEST."""
    chained = LAYERS * 6 + VISION_LAYERS * 6 + 2 + 1
    return chained * WIDEST * U / (1 - chained * WIDEST * U)


def records(run: RunDir, program: str) -> list[dict]:
    return [r for r in map(json.loads, run.metrics.read_text().splitlines()) if r["program"] == program]


def float64_model():
    from transformers import Idefics3ForConditionalGeneration

    from trainer.vision import vision_for

    model = Idefics3ForConditionalGeneration.from_pretrained(MODEL, dtype=torch.float64, attn_implementation="eager")
    return vision_for(model.eval(), MODEL)


def exact_logits(vision, ids: list[int], images: list[bytes], sampled) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 logits [T-1, V] of ids with these images (temperature 1, the run's), and each
    position's logit scale max_v sum_j |E_vj h_j| (the float32 bound's factor). `sampled`:
    where the engine sampled the token (a sampled <image> is text to it)."""
    head = vision.model.get_output_embeddings()
    seen = []
    hook = head.register_forward_hook(lambda m, i, o: seen.append((i[0][0].abs() @ m.weight.abs().T).amax(-1)))
    pixels = vision.pixels
    vision.pixels = lambda png: {k: v.double() if v.is_floating_point() else v for k, v in pixels(png).items()}
    try:
        with torch.no_grad():
            logits = vision.logits(torch.tensor([ids]), torch.arange(len(ids))[None], images,
                                   torch.as_tensor(np.asarray(sampled) >= 0)[None])[0]
    finally:
        hook.remove()
        vision.pixels = pixels
    return logits[:-1], seen[-1][:-1]


def exact_logprobs(vision, ids: list[int], images: list[bytes], sampled) -> tuple[torch.Tensor, torch.Tensor]:
    """exact_logits' log_softmax (temperature 1) and scales."""
    logits, scale = exact_logits(vision, ids, images, sampled)
    return logits.log_softmax(-1), scale
