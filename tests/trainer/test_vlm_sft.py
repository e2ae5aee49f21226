"""`rl sft` on image chats (issue 62, docs/vlm.md): the data step renders a chat with image parts
as the model's own processor does (placeholders expanded, token for token) and trains on the
assistant's tokens only, never the image tokens; the trainer packs the conversations and feeds
their pictures through the vision path (trainer/vision.py): its held-out loss falls and is the
published model's loss on the rows' own pictures (transformers, unpacked), not on pictures
swapped between rows."""

from __future__ import annotations

import copy
import io

import pytest
import torch

from conftest import ROOT
from orchestrator.sft.data import Tokenize
from rl.config import RunConfig
from rl.config.datasets import DatasetConfig
from rl.sft_data import SftData
from tasks import shapes
from sft_runs import config, records, sft
from vlm_pictures import data_url, part, picture

MODEL = ROOT / "models" / "tiny-vlm"


@pytest.fixture(scope="module")
def tokenize(tmp_path_factory):
    return Tokenize(RunConfig.model_validate({"model": str(MODEL), "output_dir": str(tmp_path_factory.mktemp("run")),
                                              "seq_len": 256}))


def chats() -> list[list[dict]]:
    """A shapes row, and two turns with a picture in each user turn."""
    two = [{"role": "user", "content": [part(data_url(picture(100, 60))), {"type": "text", "text": "Which colour?"}]},
           {"role": "assistant", "content": "red"},
           {"role": "user", "content": [{"type": "text", "text": "And this one?"},
                                        part(data_url(picture(50, 80, (20, 40, 220))))]},
           {"role": "assistant", "content": "blue"}]
    return [next(shapes.sft_rows(0))["messages"], two]


def processor_ids(hf, messages: list[dict], images: list[bytes], generation_prompt: bool = False) -> list[int]:
    from PIL import Image

    # (apply_chat_template rewrites image_url parts in place: it gets a copy)
    text = hf.apply_chat_template(copy.deepcopy(messages), add_generation_prompt=generation_prompt, tokenize=False)
    pictures = [Image.open(io.BytesIO(b)).convert("RGB") for b in images]
    return hf(text=[text], images=[pictures] if pictures else None, return_tensors="pt")["input_ids"][0].tolist()


def test_image_chats_are_the_processors_ids_and_only_the_assistants_tokens_are_trained(tokenize):
    from transformers import AutoProcessor

    hf = AutoProcessor.from_pretrained(MODEL)
    spec = DatasetConfig(function="tasks.shapes:sft_rows")
    image_id = hf.tokenizer.convert_tokens_to_ids("<image>")
    for messages in chats():
        ids, mask, images = tokenize({"messages": messages}, spec)
        assert len(images) == sum(isinstance(c, list) and any(p["type"] == "image_url" for p in c)
                                  for c in (m["content"] for m in messages))
        # Token for token what AutoProcessor makes of the whole conversation (placeholders expanded).
        assert ids == processor_ids(hf, messages, images)
        assert ids.count(image_id) == 16 * len(images)
        # The mask: each assistant turn is what the conversation adds past the prompt before it
        # (the processor's ids of the chat up to that turn with the generation prompt), up to
        # and including <end_of_utterance>; nothing else, no image token.
        want = [0] * len(ids)
        pictures = iter(images)
        seen = []
        for i, m in enumerate(messages):
            seen += [next(pictures) for p in (m["content"] if isinstance(m["content"], list) else ())
                     if p["type"] == "image_url"]
            if m["role"] != "assistant":
                continue
            before = processor_ids(hf, messages[:i], seen, generation_prompt=True)
            through = processor_ids(hf, messages[:i + 1], seen)
            assert ids[:len(through)] == through
            end = through.index(hf.tokenizer.convert_tokens_to_ids("<end_of_utterance>"), len(before)) + 1
            want[len(before):end] = [1] * (end - len(before))
        assert mask == want
        assert not any(m for t, m in zip(ids, mask) if t == image_id)


def test_rows_with_bad_images_are_skipped_by_name_and_a_text_model_refuses_them(tokenize, tmp_path):
    from orchestrator.sft.assistant_mask import MaskError

    spec = DatasetConfig(function="tasks.shapes:sft_rows")
    outside = [{"role": "user", "content": [part("/etc/hostname"), {"type": "text", "text": "?"}]},
               {"role": "assistant", "content": "1"}]
    with pytest.raises(MaskError, match="outside the run's roots"):
        tokenize({"messages": outside}, spec)
    text_only = Tokenize(RunConfig.model_validate({"model": str(ROOT / "models" / "tiny-chat"),
                                                   "output_dir": str(tmp_path), "seq_len": 256}))
    with pytest.raises(MaskError, match="reads text only"):
        text_only({"messages": chats()[0]}, spec)


SHAPES = """[trainer.optim]
lr = 1e-3
[sft]
batch_size = 16
eval_every = 15
eval_rows = 48
[[sft.datasets]]
function = "tasks.shapes:sft_rows"
size = 480
[[sft.eval_datasets]]
name = "heldout"
function = "tasks.shapes:sft_heldout"
"""


def heldout_nll(model, hf, data: SftData, swap: bool) -> float:
    """Mean NLL per assistant token of the held-out conversations, each alone (transformers, the
    processor's pixels); `swap`: each row given the next row's picture."""
    from PIL import Image

    total = count = 0.0
    n = data.num_rows
    for i in range(n):
        ids, mask = data.row(i)
        png = data.images((i + 1) % n if swap else i)[0]
        pixels = hf.image_processor(images=[[Image.open(io.BytesIO(png)).convert("RGB")]], return_tensors="pt")
        with torch.no_grad():
            logits = model(input_ids=torch.tensor(ids)[None], **pixels).logits[0].double()
        logprobs = logits[:-1].log_softmax(-1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
        trained = torch.tensor(mask[1:], dtype=torch.float64)
        total += float(-(logprobs * trained).sum())
        count += float(trained.sum())
    return total / count


def test_rl_sft_on_image_chats_learns_through_the_vision_path(tmp_path):
    path = config(tmp_path, SHAPES, model=MODEL, steps=30)
    result = sft(path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "480 conversation(s)" in result.stderr and "480 image(s)" in result.stderr, result.stderr[-3000:]
    run = tmp_path / "run"
    evals = records(run, "eval")
    assert [r["step"] for r in evals] == [0, 15, 30]
    assert evals[-1]["eval/loss"] < evals[0]["eval/loss"] - 0.5
    data = SftData.read(run / "sft_data" / "eval.safetensors")
    assert data.num_rows == 48 and data.image_counts.tolist() == [1] * 48
    # The held-out loss the trainer computed (packed rows, pictures through its vision path) is
    # transformers' on the published model with each row's own picture; with the pictures
    # swapped between rows it is not: the trainer read the right picture for each row.
    from transformers import AutoProcessor, Idefics3ForConditionalGeneration

    hf = AutoProcessor.from_pretrained(MODEL)
    model = Idefics3ForConditionalGeneration.from_pretrained(run / "weights" / "step_30").eval()
    own, swapped = heldout_nll(model, hf, data, False), heldout_nll(model, hf, data, True)
    recorded = evals[-1]["eval/loss"]
    assert abs(recorded - own) < 1e-4, (recorded, own, swapped)
    assert abs(recorded - swapped) > 100 * abs(recorded - own), (recorded, own, swapped)
