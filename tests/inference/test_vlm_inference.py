"""`rl inference` serving the tiny VLM (models/tiny-vlm, Idefics3) on real vLLM (CPU): /generate
with the orchestrator's rendered ids and PNG images, the OpenAI chat route with an image_url part
through the official openai client, and bad images refused by field. One server for the module."""

from __future__ import annotations

import base64
import io

import shutil
from pathlib import Path

import httpx
import openai
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

from conftest import ROOT
from float32_rounding import U
from orchestrator.rendering.chat import ChatTemplate
from orchestrator.rendering.images import image_support, render_image_prompt, template_messages
from orchestrator.rendering.tokenizer import load_tokenizer
from rl.rundir import RunDir
from programs import launch_server, wait_healthy
from vlm_pictures import data_url, picture

pytestmark = pytest.mark.slow

MODEL = ROOT / "models" / "tiny-vlm"
SEQ_LEN = 128
CHUNK = 24


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
    # Step 2: other moved weights, for the in-flight update (test_zzz).
    shutil.copytree(MODEL, run.weights_dir(2))
    gen = torch.Generator().manual_seed(1)
    save_file({k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in tensors.items()},
              run.weights_dir(2) / "model.safetensors")
    NEW_WEIGHTS["other"] = run.weights_dir(2)
    # Prefill in chunks of at most 24 tokens (beside the decodes): a 32-token image prompt takes
    # two steps or more, its picture encoded in the first, so the in-flight update (test_zzz)
    # can land between them.
    proc, url = launch_server(tmp, "server", MODEL, run.root, seq_len=SEQ_LEN,
                              extra=f'extra_args = ["--max-num-batched-tokens", "{CHUNK}"]\n')
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


# --- an in-flight update ("keep") while image requests generate ---------------------------------


def float64_vision(weights: Path):
    from transformers import Idefics3ForConditionalGeneration

    from trainer.vision import vision_for

    model = Idefics3ForConditionalGeneration.from_pretrained(weights, dtype=torch.float64, attn_implementation="eager")
    vision = vision_for(model.eval(), MODEL)
    pixels = vision.pixels
    vision.pixels = lambda png: {k: v.double() if v.is_floating_point() else v for k, v in pixels(png).items()}
    return vision


def switched_logprobs(old, new, ids: list[int], images: list[bytes], sampled: list[bool], p: int
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """What the engine computes for a request an update caught in flight, exactly (float64):
    positions before `p` fed to the old weights (their keys and values, and the old vision
    tower's encodings for their image placeholders: "keep" keeps the request's KV cache), the
    rest to the new weights over that cache (the new tower's encodings for the placeholders
    there: a prompt whose prefill the update split). Returns the log_softmax at each position
    [T, V] and each position's logit scale max_v sum_j |E_vj h_j| (the float32 bound's factor,
    tests/integration/test_vlm_run.py)."""
    ids_t, marks = torch.tensor(ids), torch.tensor(sampled)
    placeholder = (ids_t == old.image_token_id) & ~marks
    out, scales = [], []
    with torch.no_grad():
        cache = None
        for vision, lo, hi in ((old, 0, p), (new, p, len(ids))):
            if hi <= lo:
                continue
            embeds = vision.model.get_input_embeddings()(ids_t[lo:hi])
            here = placeholder[lo:hi]
            if bool(here.any()):
                first = int(placeholder[:lo].sum())
                embeds[here] = vision.features(images)[first:first + int(here.sum())].to(embeds.dtype)
            head = vision.model.get_output_embeddings()
            seen = []
            hook = head.register_forward_hook(lambda m, i, o: seen.append((i[0][0].abs() @ m.weight.abs().T).amax(-1)))
            try:
                result = vision.model(inputs_embeds=embeds[None], position_ids=torch.arange(lo, hi)[None],
                                      past_key_values=cache, use_cache=True)
            finally:
                hook.remove()
            cache = result.past_key_values
            out.append(result.logits[0].log_softmax(-1))
            scales.append(seen[-1])
    return torch.cat(out), torch.cat(scales)


def within(lp: torch.Tensor, scale: torch.Tensor, error: float, prompt: int, tokens: list[int],
           logprobs: list[float]) -> list[tuple[float, float]]:
    """Per sampled token: (|engine - exact|, the float32 bound), token i read at position prompt + i - 1."""
    from float32_rounding import U

    return [(abs(e - float(lp[prompt + i - 1, t])), 2 * error * float(scale[prompt + i - 1]) + abs(e) * U)
            for i, (t, e) in enumerate(zip(tokens, logprobs))]


def fed_before(old, new, prompt, smp: dict, error: float, new_version: int) -> int:
    """How many positions the old weights were fed: everything before the token whose step
    sampled the first new-version token (that step fed it to the new weights). A sample whose
    first token is new may have had part of its prompt prefilled before the update (chunked
    prefill, or a sibling's cached blocks): the split that reproduces its tokens, searched."""
    versions = smp["versions"]
    first = next((i for i, v in enumerate(versions) if v == new_version), None)
    ids = prompt.token_ids + smp["token_ids"]
    if first is None:
        return len(ids)
    if first > 0:
        return len(prompt.token_ids) + first - 1
    sampled = [False] * len(prompt.token_ids) + [True] * len(smp["token_ids"])
    for p in range(len(prompt.token_ids)):
        lp, scale = switched_logprobs(old, new, ids, prompt.images, sampled, p)
        if all(d <= b for d, b in within(lp, scale, error, len(prompt.token_ids), smp["token_ids"], smp["logprobs"])):
            return p
    return 0  # none does: the caller's check names the tokens


def test_zzz_an_in_flight_update_keeps_image_requests_going_on_the_new_weights(server):
    """Last: it moves the server's weights twice. Long image requests run (a picture the engine
    encoded before among them), a burst of new image requests arrives as the update goes out, and
    /update_weights in mode "keep" swaps the weights under them. Every request finishes (no
    "Encoder cache miss": inference/reload.py resets vLLM's encoder cache while requests are in
    progress, which vLLM warns may desync it); each sample's versions go old -> new at most once,
    and some change mid-sample; every token's engine logprob is what float64 transformers gives
    for that switch (the old weights' keys and values up to the switch, the new weights' after,
    the new vision tower's encodings for a prompt first computed after it) within the derived
    float32 bound, where the old weights alone miss it on most tokens after the switch. Then a
    picture encoded, a request on it running through another "keep" update, and the picture
    again: served, its prompt logprobs float64 transformers' on the weights now served (the
    picture encoded again by their vision tower; without the encoder cache reset the engine
    died here: "Encoder cache miss")."""
    import asyncio

    import aiohttp

    from server_calls import wait_running

    def fields(prompt, max_tokens: int) -> dict:
        return {"prompt_token_ids": prompt.request_ids, "max_tokens": max_tokens, "temperature": 1.0,
                "images": [base64.b64encode(b).decode() for b in prompt.images]}

    running = [rendered(chat(picture(40 + 20 * i, 60, (30 + 50 * i, 120, 200 - 40 * i)))) for i in range(3)]
    running.append(rendered(chat(picture(100, 60))))  # the picture the earlier tests sent: seen before
    burst = [rendered(chat(picture(60, 30 + 15 * i, (200, 40 * i, 90)))) for i in range(4)]

    async def post(s, route: str, body: dict) -> dict:
        async with s.post(f"{server}{route}", json=body, timeout=aiohttp.ClientTimeout(total=180)) as r:
            answer = await r.json()
            assert r.status == 200, answer
            return answer

    async def attempt(s, k: int, old: Path, new: Path, version: int):
        await post(s, "/update_weights", {"path": str(old), "version": version, "mode": "wait"})
        long = [asyncio.create_task(post(s, "/generate", {"request_id": f"keep-{k}-{i}", "n": 4,
                                                          **fields(pr, SEQ_LEN - len(pr.token_ids))}))
                for i, pr in enumerate(running)]
        together = asyncio.gather(*long)
        await wait_running(s, server, lambda c: c >= 8, timeout=120, task=together)
        late = [asyncio.create_task(post(s, "/generate", {"request_id": f"burst-{k}-{i}", "n": 2, **fields(pr, 24)}))
                for i, pr in enumerate(burst)]
        await asyncio.sleep(0)  # the burst's requests go out first: in prefill (or queued) as the update lands
        update = await post(s, "/update_weights", {"path": str(new), "version": version + 1, "mode": "keep"})
        return update, await together, await asyncio.gather(*late)

    async def main():
        async with aiohttp.ClientSession() as s:
            version = (await (await s.get(f"{server}/health")).json())["version"] + 1
            weights = [NEW_WEIGHTS["path"], NEW_WEIGHTS["other"]]
            for k in range(3):  # an update that lands after the requests ended shows no switch: again
                old, new = weights[k % 2], weights[(k + 1) % 2]
                update, answers, late = await attempt(s, k, old, new, version)
                samples = [(pr, smp) for pr, a in zip(running + burst, answers + late) for smp in a["samples"]]
                if any(len(set(smp["versions"])) == 2 for _, smp in samples):
                    break
                version += 2
            after = await again(s, old, version + 2)
            return version, old, new, update, samples, after

    async def again(s, old: Path, version: int) -> dict:
        """A picture encoded, a request on it running as another "keep" update lands, then the
        same picture again: its encoding must be the new weights' (vLLM's scheduler still counted
        the old one, which the reload had dropped: "Encoder cache miss" without the reset)."""
        seen = running[-1]
        await post(s, "/generate", {"request_id": "encode", **fields(seen, 1)})
        going = asyncio.create_task(post(s, "/generate", {"request_id": "going", "n": 2,
                                                          **fields(seen, SEQ_LEN - len(seen.token_ids))}))
        await wait_running(s, server, lambda c: c >= 2, timeout=120, task=going)
        await post(s, "/update_weights", {"path": str(old), "version": version, "mode": "keep"})
        await going
        return await post(s, "/generate", {"request_id": "after-keep", "prompt_logprobs": True, **fields(seen, 1)})

    version, old_path, new_path, update, samples, after = asyncio.run(main())
    assert update["version"] == version + 1
    assert after["samples"][0]["versions"] == [version + 2]  # served after the second update
    switched = [smp for _, smp in samples if len(set(smp["versions"])) == 2]
    assert switched, [smp["versions"] for _, smp in samples]
    # One thread for the test's own forwards (~60 small float64 ones): beside the engine on 2
    # cores, torch's default spends its time in spin-waits (as tests/trainer/test_sampling_mask.py
    # found); the bound holds for any summation order.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        check_switched_samples(samples, version, old_path, new_path)
        check_prompt(running[-1], after["prompt_logprobs"], old_path)
    finally:
        torch.set_num_threads(threads)


def check_prompt(prompt, served: list, weights: Path) -> None:
    """The engine's prompt logprobs are float64 transformers' on `weights` (its vision tower
    included) within the derived bound."""
    from vlm_checks import vlm_logit_error

    vision = float64_vision(weights)
    ids = prompt.token_ids
    lp, scale = switched_logprobs(vision, vision, ids, prompt.images, [False] * len(ids), len(ids))
    error = vlm_logit_error()
    assert len(served) == len(ids)
    for i in range(1, len(ids)):
        tol = 2 * error * float(scale[i - 1]) + abs(served[i]) * U
        assert abs(served[i] - float(lp[i - 1, ids[i]])) <= tol, (i, served[i], float(lp[i - 1, ids[i]]), tol)


def check_switched_samples(samples, version: int, old_path: Path, new_path: Path) -> None:
    """Each sample's tokens against float64 transformers with the update where the versions put
    it (fed_before); the tokens after it against the old weights alone."""
    from vlm_checks import vlm_logit_error

    old, new = float64_vision(old_path), float64_vision(new_path)
    error = vlm_logit_error()
    compared = after_switch = missed = 0
    splits = []
    for prompt, smp in samples:
        tokens, versions = smp["token_ids"], smp["versions"]
        assert smp["finish_reason"] in ("stop", "length") and len(tokens) == len(smp["logprobs"]) == len(versions)
        assert versions == sorted(versions) and set(versions) <= {version, version + 1}, versions
        ids = prompt.token_ids + tokens
        sampled = [False] * len(prompt.token_ids) + [True] * len(tokens)
        p = fed_before(old, new, prompt, smp, error, version + 1)
        splits.append(p - len(prompt.token_ids))
        lp, scale = switched_logprobs(old, new, ids, prompt.images, sampled, p)
        diffs = within(lp, scale, error, len(prompt.token_ids), tokens, smp["logprobs"])
        bad = [(i, versions[i], d, b) for i, (d, b) in enumerate(diffs) if d > b]
        assert not bad, (p, len(prompt.token_ids), bad[:5])
        compared += len(diffs)
        if p < len(ids):
            stale = within(*switched_logprobs(old, old, ids, prompt.images, sampled, len(ids)), error,
                           len(prompt.token_ids), tokens, smp["logprobs"])
            for v, (d, b) in zip(versions, stale):
                after_switch += v == version + 1
                missed += v == version + 1 and d > b
    assert after_switch >= 8 and missed > after_switch // 2, (missed, after_switch, compared)
    switched = sum(len(set(smp["versions"])) == 2 for _, smp in samples)
    print(f"\n{switched} of {len(samples)} samples switched mid-way; {compared} tokens within the bound, "
          f"{missed} of the {after_switch} after the switch off the old weights'; positions fed to the old weights "
          f"(from the prompt's end): {sorted(splits)}")


def test_zzzz_aborted_image_requests_leave_the_engine_serving_their_pictures(server):
    """Group cancellation's engine side with images (the orchestrator aborts a stale group's
    requests by id, /abort): image requests decoding and others just sent (queued or in prefill)
    are aborted; each returns what it had, marked "abort", and the same pictures right after are
    served with prompt logprobs float64 transformers' on the served weights (no stale or missing
    encoding left behind by the aborted ones)."""
    import asyncio

    import aiohttp

    from server_calls import wait_running

    pictures = [rendered(chat(picture(30 + 25 * i, 50, (60 * i, 200, 100)))) for i in range(4)]

    async def post(s, route: str, body: dict) -> dict:
        async with s.post(f"{server}{route}", json=body, timeout=aiohttp.ClientTimeout(total=180)) as r:
            answer = await r.json()
            assert r.status == 200, answer
            return answer

    def fields(prompt, max_tokens: int) -> dict:
        return {"prompt_token_ids": prompt.request_ids, "max_tokens": max_tokens,
                "images": [base64.b64encode(b).decode() for b in prompt.images]}

    async def main():
        async with aiohttp.ClientSession() as s:
            version = (await (await s.get(f"{server}/health")).json())["version"] + 1
            await post(s, "/update_weights", {"path": str(NEW_WEIGHTS["path"]), "version": version, "mode": "wait"})
            ids = [f"cancel-{i}" for i in range(len(pictures))]
            long = [asyncio.create_task(post(s, "/generate", {"request_id": ids[i], "n": 4,
                                                              **fields(pr, SEQ_LEN - len(pr.token_ids))}))
                    for i, pr in enumerate(pictures[:2])]
            await wait_running(s, server, lambda c: c >= 4, timeout=120, task=asyncio.gather(*long))
            late = [asyncio.create_task(post(s, "/generate", {"request_id": ids[2 + i], "n": 4, **fields(pr, 24)}))
                    for i, pr in enumerate(pictures[2:])]
            await asyncio.sleep(0)
            await post(s, "/abort", {"request_ids": ids})
            cut = await asyncio.gather(*long, *late)
            again = [await post(s, "/generate", {"request_id": f"again-{i}", "prompt_logprobs": True,
                                                 "temperature": 0, **fields(pr, 1)}) for i, pr in enumerate(pictures)]
            return version, cut, again

    version, cut, again = asyncio.run(main())
    reasons = [smp["finish_reason"] for answer in cut for smp in answer["samples"]]
    assert "abort" in reasons and set(reasons) <= {"abort", "stop", "length"}, reasons
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for prompt, answer in zip(pictures, again):
            assert answer["samples"][0]["versions"] == [version]
            check_prompt(prompt, answer["prompt_logprobs"], NEW_WEIGHTS["path"])
    finally:
        torch.set_num_threads(threads)
    print(f"\n{reasons.count('abort')} of {len(reasons)} image samples aborted")
