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

Under `rl trainer` (trainer/model.py): `install` lets the model's own forward take a row's
images (`model(input_ids=..., images=[png, ...])`): a forward pre-hook turns them into
image_hidden_states inside the root's forward, where FSDP2 has unsharded the root's parameters
(the connector lives there) and the vision tower's own FSDP unit unshards itself as a submodule
of it (calling get_image_features outside the root's forward would find sharded parameters,
and would make the vision tower FSDP's root). The vision tower is frozen unless
trainer.vision.train_tower (`freeze`).

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
        self.blank = _blank_png()

    def pixels(self, png: bytes) -> dict[str, Tensor]:
        from PIL import Image

        image = Image.open(io.BytesIO(png)).convert("RGB")
        return dict(self.image_processor(images=[[image]], return_tensors="pt"))

    def features(self, images: list[bytes]) -> Tensor:
        """[sum of image tokens, hidden]: each image's tokens, in order. One vision forward for
        all of them: under FSDP2 each call of the vision tower is a collective, so every rank
        must make the same number of calls whatever its number of images (trainer/vision.py
        install). Each image is processed alone (its own resize and pad) and padded to the
        largest with zeros, which the vision model's patch mask leaves out."""
        if not images:
            return torch.empty(0, self.model.config.text_config.hidden_size)
        processed = [self.pixels(png) for png in images]
        h = max(p["pixel_values"].shape[-2] for p in processed)
        w = max(p["pixel_values"].shape[-1] for p in processed)

        def padded(x: Tensor) -> Tensor:
            return torch.nn.functional.pad(x, (0, w - x.shape[-1], 0, h - x.shape[-2]))
        pixels = torch.cat([padded(p["pixel_values"]) for p in processed], 1)
        masks = ([padded(p["pixel_attention_mask"]) for p in processed]
                 if all("pixel_attention_mask" in p for p in processed) else None)
        out = self.model.get_image_features(pixel_values=pixels.to(self.model.dtype),
                                            pixel_attention_mask=None if masks is None else torch.cat(masks, 1))
        f = out.pooler_output
        return f.reshape(-1, f.shape[-1])

    def embeds(self, ids: Tensor, images: list[bytes], sampled: Tensor | None) -> Tensor:
        """The input embeddings of ids whose image placeholders are filled, in order, by
        `images`. Placeholders are the image tokens where `sampled` is false: one the model
        sampled is text to the engine (vLLM marks placeholders by the processor's ranges, not
        by id), so it stays text here."""
        placeholder = ids == self.image_token_id
        if sampled is not None:
            placeholder &= ~sampled.reshape(ids.shape)
        features = self.features(images)
        if int(placeholder.sum()) != features.shape[0]:
            raise ValueError(f"{int(placeholder.sum())} image placeholders in the ids, {features.shape[0]} image "
                             f"tokens from {len(images)} images")
        embeds = self.model.get_input_embeddings()(ids)
        if features.shape[0]:
            return embeds.masked_scatter(placeholder[..., None], features.to(embeds.dtype))
        # Every rank runs the vision tower in every forward, images or not: under FSDP2 its
        # all-gather (and, trained, its reduce-scatter) is a collective that a rank whose
        # micro-batch has no picture would otherwise skip, hanging its peers. A blank picture,
        # its features added times 0.
        return embeds + 0.0 * self.features([self.blank]).sum().to(embeds.dtype)

    def logits(self, input_ids: Tensor, position_ids: Tensor, images: list[bytes], sampled: Tensor | None = None,
               **kwargs) -> Tensor:
        """The language model's logits on [1, T] ids whose image placeholders are filled, in
        order, by `images` (all the row's images, sample after sample); `sampled`: where the
        engine sampled the token (embeds)."""
        return self.model(inputs_embeds=self.embeds(input_ids, images, sampled), position_ids=position_ids,
                          **kwargs).logits


def _blank_png() -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (8, 8)).save(buf, format="PNG")
    return buf.getvalue()


VISION = {"idefics3": Idefics3Vision}


def is_vision_language(config) -> bool:
    """Whether an HF config is a vision-language model this trainer handles."""
    return config.model_type in VISION


def towers(model) -> tuple[torch.nn.Module, list[torch.nn.Module], list[torch.nn.Module]]:
    """(the vision tower, its encoder layers, the language model's decoder layers) of a VLM."""
    inner = model.model
    return inner.vision_model, list(inner.vision_model.encoder.layers), list(inner.text_model.layers)


def tower_prefix(model) -> str | None:
    """The module path prefix of a VLM's vision tower ("model.vision_model."), None for a text
    model: LoRA adapts the language model only (trainer/lora.py), as vLLM serves a VLM's
    adapters on its language model only."""
    if not is_vision_language(model.config):
        return None
    tower = towers(model)[0]
    return next(name for name, m in model.named_modules() if m is tower) + "."


def bidirectional(model) -> None:
    """The vision tower attends over all of an image's patches (as vLLM's encoder does): the
    trainer's packed attention ("varlen", trainer/packed_attention.py) is causal, for the
    language model only. Measured before this: the trainer's logprobs off the engine's by ~3e-3
    a token (mismatch_kl 3e-6 to 8e-6 where float32 rounding gives ~1e-12)."""
    model.config.vision_config._attn_implementation = "sdpa"


def freeze(model, train_tower: bool) -> None:
    """trainer.vision.train_tower = false: the vision tower (patch embedding, encoder, its norm)
    takes no gradient and no optimizer state; the connector and the language model train."""
    if not train_tower:
        towers(model)[0].requires_grad_(False)


def install(model, model_dir: Path) -> Idefics3Vision:
    """Let model(..., images=[png, ...]) fill the ids' placeholders with those images' features
    (module docstring). Returns the model's image handling."""
    vision = vision_for(model, model_dir)

    def hook(module, args, kwargs):
        given = kwargs.pop("images", None)
        if given is None:
            return args, kwargs
        images, sampled = given
        kwargs["inputs_embeds"] = vision.embeds(kwargs["input_ids"], images, sampled)
        kwargs["input_ids"] = None
        return args, kwargs

    model.register_forward_pre_hook(hook, with_kwargs=True)
    model.asyncrl_vision = vision  # trainer/model.py forward_logits: every forward passes images
    return vision


def vision_for(model, model_dir: Path):
    """The model's image handling, or None for a text-only model."""
    kind = VISION.get(model.config.model_type)
    return kind(model, model_dir) if kind else None
