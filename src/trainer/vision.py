"""The trainer's side of images: a sample's images arrive as the PNG bytes the server sampled
with (orchestrator/rendering/images.py), and the trainer re-processes them with the model's own
image processor, so the pixels are the server's exactly (PNG is lossless; the processor is the
same code on the same bytes). Why bytes and not processed pixels: for models/tiny-vlm a 100x60
picture is 293 bytes of PNG against 48 KB of float32 pixel_values plus a 32 KB pixel mask (the
processor resizes to 64x64 and pads); at Qwen2-VL-like sizes the gap grows with the pixels
(docs/vlm.md), and re-processing costs the trainer milliseconds per image.

Packing: the images of a packed row are encoded one by one (each image's vision forward is then
the same computation whether its sample is packed or alone), their features concatenated in the
order of the row's placeholders, and the language model runs on the packed ids with each
sample's positions restarting at 0 (the model's own 1-D positions: Idefics3's Llama) and the
packed attention (trainer/packed_attention.py) keeping samples apart. tests/trainer/test_vlm_trainer.py
shows packed logprobs equal to unpacked ones within float32 rounding's bound.

One class per processor kind (VISION); Idefics3 (SmolVLM) only so far. Qwen2-VL's 3-D rotary
positions would need its get_rope_index per sample: not done (it cannot run here: docs/vlm.md).
"""

from __future__ import annotations

import io
from pathlib import Path

import torch
from torch import Tensor


class Idefics3Vision:
    def __init__(self, model, model_dir: Path):
        from transformers import AutoProcessor

        self.model = model
        self.image_processor = AutoProcessor.from_pretrained(model_dir).image_processor
        self.image_token_id = model.config.image_token_id

    def pixels(self, png: bytes) -> dict[str, Tensor]:
        from PIL import Image

        image = Image.open(io.BytesIO(png)).convert("RGB")
        return dict(self.image_processor(images=[[image]], return_tensors="pt"))

    def features(self, images: list[bytes]) -> Tensor:
        """[sum of image tokens, hidden]: each image's tokens, in order, each encoded alone."""
        if not images:
            return torch.empty(0, self.model.config.text_config.hidden_size)
        out = []
        for png in images:
            p = self.pixels(png)
            out.append(self.model.get_image_features(
                pixel_values=p["pixel_values"], pixel_attention_mask=p.get("pixel_attention_mask")).pooler_output)
        return torch.cat([f.reshape(-1, f.shape[-1]) for f in out])

    def logits(self, input_ids: Tensor, position_ids: Tensor, images: list[bytes], **kwargs) -> Tensor:
        """The language model's logits on [1, T] ids whose image placeholders are filled, in
        order, by `images` (all the row's images, sample after sample)."""
        found = int((input_ids == self.image_token_id).sum())
        features = self.features(images)
        if found != features.shape[0]:
            raise ValueError(f"{found} image placeholders in the ids, {features.shape[0]} image tokens "
                             f"from {len(images)} images")
        return self.model(input_ids=input_ids, position_ids=position_ids,
                          image_hidden_states=features if found else None, **kwargs).logits


VISION = {"idefics3": Idefics3Vision}


def vision_for(model, model_dir: Path):
    """The model's image handling, or None for a text-only model."""
    kind = VISION.get(model.config.model_type)
    return kind(model, model_dir) if kind else None
