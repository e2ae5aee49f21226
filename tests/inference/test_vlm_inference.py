"""`rl inference` serving the tiny VLM (models/tiny-vlm, Idefics3) on real vLLM (CPU): /generate
with the orchestrator's rendered ids and PNG images, the OpenAI chat route with an image_url part
through the official openai client, and bad images refused by field. One server for the module."""

from __future__ import annotations

import base64
import io

import shutil

import httpx
import openai
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

from conftest import ROOT
from orchestrator.rendering.chat import ChatTemplate
from orchestrator.rendering.images import image_support, render_image_prompt, template_messages
from orchestrator.rendering.tokenizer import load_tokenizer
from rl.rundir import RunDir
from programs import launch_server, wait_healthy
from test_vlm_prompts import data_url, picture

pytestmark = pytest.mark.slow

MODEL = ROOT / "models" / "tiny-vlm"
SEQ_LEN = 128


NEW_WEIGHTS: dict = {}  # the reload test's: the path of step 1's weights


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vlm")
    run = RunDir(tmp / "run")
    # Step 1: every tensor moved (the vision tower, the connector, the tied embeddings/head).
    step = run.weights_dir(1)
    shutil.copytree(MODEL, step)
    tensors = load_file(step / "model.safetensors")
    gen = torch.Generator().manual_seed(0)
    save_file({k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in tensors.items()},
              step / "model.safetensors")
    NEW_WEIGHTS["path"] = step
    proc, url = launch_server(tmp, "server", MODEL, run.root, seq_len=SEQ_LEN)
    try:
        wait_healthy(proc, url)
        yield url
    finally:
        proc.stop()


def chat(image: Image.Image) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(image)}},
                                         {"type": "text", "text": "Which colour is the dot?"}]}]


def rendered(messages):
    return render_image_prompt(ChatTemplate.load(MODEL), image_support(MODEL), load_tokenizer(str(MODEL)), messages, [])


def hf_prompt_logprobs(messages, images: list[bytes], weights=MODEL) -> tuple[list[int], list[float]]:
    from transformers import AutoProcessor, Idefics3ForConditionalGeneration

    processor = AutoProcessor.from_pretrained(MODEL)
    model = Idefics3ForConditionalGeneration.from_pretrained(weights)
    text = processor.apply_chat_template(template_messages(messages), add_generation_prompt=True, tokenize=False)
    inputs = processor(text=[text], images=[[Image.open(io.BytesIO(b)) for b in images]], return_tensors="pt")
    with torch.no_grad():
        logprobs = model(**inputs).logits[0].float().log_softmax(-1)
    ids = inputs["input_ids"][0].tolist()
    return ids, [logprobs[i - 1, t].item() for i, t in enumerate(ids) if i > 0]


def generate(url: str, **body) -> httpx.Response:
    return httpx.post(f"{url}/generate", json={"request_id": body.pop("request_id", "r"), **body}, timeout=120)


def test_generate_with_an_image_scores_the_prompt_as_transformers_does(server):
    messages = chat(picture(100, 60))
    prompt = rendered(messages)
    images = [base64.b64encode(b).decode() for b in prompt.images]
    r = generate(server, request_id="img", prompt_token_ids=prompt.request_ids, images=images, max_tokens=4,
                 temperature=0, prompt_logprobs=True)
    assert r.status_code == 200, r.text
    body = r.json()
    # The engine expanded the placeholder as the orchestrator did: the trainer's ids, token for token.
    assert body["prompt_token_ids"] == prompt.token_ids
    assert len(body["samples"][0]["token_ids"]) == 4 and body["samples"][0]["versions"] == [0] * 4
    served = body["prompt_logprobs"][1:]
    ids, hf = hf_prompt_logprobs(messages, prompt.images)
    assert ids == prompt.token_ids and len(served) == len(hf)
    # The engine saw these ids and these pixels: its prompt logprobs are transformers' up to
    # float32 kernel differences, far below what another picture changes (the image tokens'
    # successors read the picture).
    other = rendered(chat(picture(100, 60).rotate(90)))
    r2 = generate(server, request_id="img2", prompt_token_ids=other.request_ids,
                  images=[base64.b64encode(b).decode() for b in other.images], max_tokens=1, temperature=0,
                  prompt_logprobs=True)
    moved = max(abs(a - b) for a, b in zip(r2.json()["prompt_logprobs"][1:], served))
    close = max(abs(a - b) for a, b in zip(served, hf))
    assert close < 1e-3 and moved > 10 * close, (close, moved)


def test_openai_client_chat_with_an_image_url_part(server):
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="none")
    messages = chat(picture(100, 60))
    reply = client.chat.completions.create(model=str(MODEL), messages=messages, max_tokens=3, temperature=0)
    assert reply.choices[0].finish_reason in ("stop", "length")
    # The server's own rendering of the chat (vLLM's, with the model's processor) is as long as
    # the orchestrator's: same template, same placeholder expansion.
    assert reply.usage.prompt_tokens == len(rendered(messages).token_ids)


def test_a_prompt_with_two_images(server):
    messages = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(picture(100, 60))}}, {"type": "text", "text": "and"},
        {"type": "image_url", "image_url": {"url": data_url(picture(40, 90, (20, 160, 40)))}}]}]
    prompt = rendered(messages)
    r = generate(server, request_id="two", prompt_token_ids=prompt.request_ids, max_tokens=2, temperature=0,
                 images=[base64.b64encode(b).decode() for b in prompt.images], prompt_logprobs=True)
    assert r.status_code == 200, r.text
    assert r.json()["prompt_token_ids"] == prompt.token_ids
    _, hf = hf_prompt_logprobs(messages, prompt.images)
    assert max(abs(a - b) for a, b in zip(r.json()["prompt_logprobs"][1:], hf)) < 1e-3


def said(r: httpx.Response) -> str:
    return r.json()["error"]["message"]


def test_bad_images_are_refused_by_field(server):
    prompt = rendered(chat(picture(20, 20)))
    r = generate(server, prompt_token_ids=prompt.request_ids, images=["not base64!"])
    assert r.status_code == 400 and said(r).startswith("images[0]: not base64"), r.text
    junk = base64.b64encode(b"\x89PNG junk").decode()
    r = generate(server, prompt_token_ids=prompt.request_ids, images=[junk])
    assert r.status_code == 400 and "images[0]: unreadable image" in said(r), r.text
    # Fits with one placeholder per image (17 + 100 <= 128), not once expanded (32 + 100).
    r = generate(server, prompt_token_ids=prompt.request_ids, images=[base64.b64encode(prompt.images[0]).decode()],
                 max_tokens=SEQ_LEN - len(prompt.request_ids) - 11)
    assert r.status_code == 400 and said(r).startswith(
        f"max_tokens: prompt ({len(prompt.token_ids)} tokens with its images expanded)"), r.text
    # Two images for a prompt with one image's placeholders: refused before the processor runs.
    png = base64.b64encode(prompt.images[0]).decode()
    r = generate(server, prompt_token_ids=prompt.request_ids, images=[png, png])
    assert r.status_code == 400 and said(r).startswith("images:"), r.text


def test_the_orchestrators_client_carries_images_and_checks_the_expansion(server):
    import asyncio

    import aiohttp

    from orchestrator.rendering.images import ImageError, ImagePrompt, check_expanded, request_fields
    from rl.inference_api import GenerateRequest, InferenceClient

    prompt = rendered(chat(picture(70, 70, (20, 160, 40))))

    async def main():
        async with aiohttp.ClientSession() as session:
            client = InferenceClient(server, session)
            return await client.generate(GenerateRequest(request_id="client", n=2, max_tokens=3, **request_fields(prompt)),
                                         timeout=120)

    response = asyncio.run(main())
    assert len(response.samples) == 2 and all(len(s.token_ids) == 3 for s in response.samples)
    check_expanded(prompt, response.prompt_token_ids, "row 0")  # the trainer's ids, as sampled after
    other = ImagePrompt(prompt.token_ids[:-1], prompt.request_ids, prompt.images)
    with pytest.raises(ImageError, match="row 0: the server expanded the image placeholders to 32 ids, the model.s processor to 31"):
        check_expanded(other, response.prompt_token_ids, "row 0")


def test_zz_a_weight_reload_reaches_the_vision_tower_and_the_tied_head(server):
    """Last in the module: it changes the server's weights. After /update_weights to step 1 the
    engine's prompt logprobs on an image chat it has seen are transformers' on step 1's weights
    (vision tower, connector, language model and tied head all moved), not the old ones'.
    Without resetting vLLM's encoder cache at the reload the engine died here ("Encoder cache
    miss": the worker's reload cleared its encodings, the scheduler still counted them)."""
    messages = chat(picture(100, 60))
    prompt = rendered(messages)
    fields = {"prompt_token_ids": prompt.request_ids, "images": [base64.b64encode(b).decode() for b in prompt.images],
              "max_tokens": 1, "temperature": 0, "prompt_logprobs": True}
    before = generate(server, request_id="before", **fields).json()["prompt_logprobs"][1:]
    r = httpx.post(f"{server}/update_weights", json={"path": str(NEW_WEIGHTS["path"]), "version": 1, "mode": "wait"},
                   timeout=120)
    assert r.status_code == 200, r.text
    after = generate(server, request_id="after", **fields).json()
    assert "samples" in after, after
    assert after["samples"][0]["versions"] == [1]
    _, new = hf_prompt_logprobs(messages, prompt.images, NEW_WEIGHTS["path"])
    close = max(abs(a - b) for a, b in zip(after["prompt_logprobs"][1:], new))
    moved = max(abs(a - b) for a, b in zip(before, new))
    assert close < 1e-3 and moved > 10 * close, (close, moved)
