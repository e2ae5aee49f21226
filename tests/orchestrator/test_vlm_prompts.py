"""Image chats rendered by the orchestrator (orchestrator/rendering/images.py, no transformers)
against the model's own AutoProcessor: the same ids token for token, placeholders included, and
the same pixels from the PNG bytes the batch carries as from the original image. Bad image
parts: one error naming the part."""

from __future__ import annotations

import base64
import io
import logging

import pytest
from PIL import Image

from conftest import ROOT
from orchestrator.rendering.chat import ChatTemplate
from orchestrator.rendering.images import (ImageError, Shrunk, image_support, read_source, render_image_prompt,
                                         template_messages)
from orchestrator.rendering.tokenizer import load_tokenizer
from vlm_pictures import data_url, encoded, part, picture

MODEL = ROOT / "models" / "tiny-vlm"


@pytest.fixture(scope="module")
def hf():
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(MODEL)


@pytest.fixture(scope="module")
def ours():
    return ChatTemplate.load(MODEL), image_support(MODEL), load_tokenizer(str(MODEL))


def render(ours, messages, roots=()):
    template, support, tokenizer = ours
    return render_image_prompt(template, support, tokenizer, messages, list(roots))


def chats(tmp_path) -> list[tuple[list[dict], list[Image.Image]]]:
    on_disk = picture(40, 90, (20, 160, 40))
    on_disk.save(tmp_path / "green.png")
    jpeg = picture(240, 200, (10, 10, 220))
    return [
        ([{"role": "user", "content": [part(data_url(picture(100, 60))), {"type": "text", "text": "Which colour is the dot?"}]}],
         [picture(100, 60)]),
        ([{"role": "system", "content": "Answer with a number."},
          {"role": "user", "content": [{"type": "text", "text": "How many shapes?"}, part(str(tmp_path / "green.png")),
                                        {"type": "text", "text": " and "}, {"type": "image_url", "image_url": {"bytes": encoded(jpeg, "JPEG"), "path": None}}]},
          {"role": "assistant", "content": "2"}, {"role": "user", "content": "Which colour?"}],
         [on_disk, Image.open(io.BytesIO(encoded(jpeg, "JPEG"))).convert("RGB")]),
    ]


def test_ids_and_pixels_as_the_processor_makes_them(ours, hf, tmp_path):
    import torch

    image_id = hf.tokenizer.convert_tokens_to_ids("<image>")
    for messages, originals in chats(tmp_path):
        prompt = render(ours, messages, [tmp_path])
        text = hf.apply_chat_template(template_messages(messages), add_generation_prompt=True, tokenize=False)
        carried = [Image.open(io.BytesIO(b)) for b in prompt.images]
        expected = hf(text=[text], images=[carried], return_tensors="pt")
        assert prompt.token_ids == expected["input_ids"][0].tolist()
        assert prompt.token_ids.count(image_id) == 16 * len(originals)
        # PNG is lossless: the carried bytes give the processor the original's pixels.
        direct = hf(text=[text], images=[originals], return_tensors="pt")
        assert torch.equal(direct["pixel_values"], expected["pixel_values"])


def test_bad_parts_name_the_culprit(ours, tmp_path, caplog):
    outside = tmp_path.parent / "outside.png"
    picture(10, 10).save(outside)
    (tmp_path / "broken.png").write_bytes(b"\x89PNG not really")
    bomb = Image.new("1", (9000, 9000))  # 81M pixels, ~10 KB as PNG
    cases = {
        str(tmp_path / "missing.png"): "No such file",
        str(outside): "outside the run's roots",
        str(tmp_path / "broken.png"): "unreadable image",
        "data:image/png;base64," + base64.b64encode(encoded(bomb)).decode(): "decompression bomb",
        "https://example.com/a.png": "nothing is downloaded",
        "data:image/png,abc": "must be base64",
    }
    for url, said in cases.items():
        with pytest.raises(ImageError, match=said):
            render(ours, [{"role": "user", "content": [part(url), {"type": "text", "text": "hi"}]}], [tmp_path])
    five = [part(data_url(picture(8, 8)))] * 5
    with pytest.raises(ImageError, match="5 images, more than the 4"):
        render(ours, [{"role": "user", "content": five}], [tmp_path])
    template, _, tokenizer = ours
    with pytest.raises(ImageError, match="reads text only"):
        render_image_prompt(template, None, tokenizer, [{"role": "user", "content": [part(data_url(picture(8, 8)))]}], [])
    assert image_support(ROOT / "models" / "tiny-chat") is None  # a text-only model has no processor
    # Larger than the processor uses: shrunk, said once.
    Shrunk.said = False
    with caplog.at_level(logging.WARNING, logger="orchestrator"):
        for _ in range(2):
            big = render(ours, [{"role": "user", "content": [part(data_url(picture(640, 320)))]}])
    assert sum("shrunk" in r.message for r in caplog.records) == 1
    assert Image.open(io.BytesIO(big.images[0])).size == (362, 181)  # 256*256 pixels at most, 2:1 kept


def test_hf_datasets_image_value(tmp_path):
    (tmp_path / "a.png").write_bytes(encoded(picture(5, 5)))
    assert read_source({"bytes": None, "path": str(tmp_path / "a.png")}, [tmp_path]) == encoded(picture(5, 5))
    assert read_source({"bytes": b"xyz", "path": "ignored"}, []) == b"xyz"


@pytest.mark.parametrize("model,says", [
    ("tiny-chat", "reads text only (no processor_config.json)"),
    ("tiny-vlm", None),  # a vision-language model: accepted (rl run carries the images)
])
def test_image_rows_refused_at_start_up_with_exit_2(tmp_path, model, says):
    import json
    import subprocess

    from conftest import rl_command

    row = {"messages": [{"role": "user", "content": [part(data_url(picture(8, 8))), {"type": "text", "text": "hi"}]}],
           "answer": "1"}
    (tmp_path / "images.jsonl").write_text(json.dumps(row) + "\n")
    cfg = tmp_path / "cfg.toml"
    cfg.write_text(f'model = "{ROOT / "models" / model}"\noutput_dir = "{tmp_path / "out"}"\nseq_len = 128\n'
                   f'[[orchestrator.datasets]]\npath = "{tmp_path / "images.jsonl"}"\nreward = "math_verify"\n')
    result = subprocess.run(rl_command("orchestrator", "@", str(cfg), "--dry-run"), capture_output=True, text=True,
                            timeout=120)
    if says is None:
        assert result.returncode == 0, result.stderr
        return
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert says in lines[-1] and "images.jsonl row 0" in lines[-1], result.stderr
    assert not (tmp_path / "out").exists()


def test_an_hf_datasets_image_column_with_image_parts(ours, hf):
    """TRL's form: {"type": "image"} parts and an `images` column; an HF datasets Image
    sequence decodes to PIL images on access. Same ids and pixels as AutoProcessor's."""
    import datasets
    import torch

    ds = datasets.Dataset.from_dict(
        {"messages": [[{"role": "user", "content": [{"type": "image", "text": None},
                                                    {"type": "text", "text": "How many shapes?"},
                                                    {"type": "image", "text": None}]}]],
         "images": [[picture(30, 50), picture(90, 40, (10, 10, 220))]]},
        features=datasets.Features({
            "messages": [{"role": datasets.Value("string"),
                          "content": [{"type": datasets.Value("string"), "text": datasets.Value("string")}]}],
            "images": datasets.Sequence(datasets.Image())}))
    row = ds[0]
    assert all(isinstance(im, Image.Image) for im in row["images"])
    template, support, tokenizer = ours
    prompt = render_image_prompt(template, support, tokenizer, row["messages"], [], row["images"])
    text = hf.apply_chat_template(template_messages(row["messages"]), add_generation_prompt=True, tokenize=False)
    expected = hf(text=[text], images=[[im.convert("RGB") for im in row["images"]]], return_tensors="pt")
    assert prompt.token_ids == expected["input_ids"][0].tolist()
    carried = hf(text=[text], images=[[Image.open(io.BytesIO(b)) for b in prompt.images]], return_tensors="pt")
    assert torch.equal(carried["pixel_values"], expected["pixel_values"])
    with pytest.raises(ImageError, match="more images than the chat has image parts"):
        render_image_prompt(template, support, tokenizer, row["messages"], [], row["images"] * 2)
    with pytest.raises(ImageError, match="fewer"):
        render_image_prompt(template, support, tokenizer, row["messages"], [], row["images"][:1])


@pytest.mark.parametrize("max_tokens,fits", [(40, False), (36, True)])
def test_the_start_up_fit_check_measures_image_rows_expanded(tmp_path, max_tokens, fits):
    """A row with one picture is 10 ids with one placeholder, 28 once expanded (tiny-vlm: 19
    tokens in its place). seq_len 64 leaves a prompt 64 - max_tokens: 24 (max_tokens 40) fits the
    unexpanded prompt but not the one the model reads: exit 2 before any engine starts, one line
    naming the dataset, the row and the key; 28 (max_tokens 36) fits it exactly: the dry run
    passes (a measure one token long would refuse it)."""
    import json
    import subprocess

    from conftest import rl_command

    row = {"messages": [{"role": "user", "content": [part(data_url(picture(8, 8))), {"type": "text", "text": "hi"}]}],
           "answer": "1"}
    (tmp_path / "images.jsonl").write_text(json.dumps(row) + "\n")
    cfg = tmp_path / "cfg.toml"
    cfg.write_text(f'model = "{ROOT / "models" / "tiny-vlm"}"\noutput_dir = "{tmp_path / "out"}"\nseq_len = 64\n'
                   f"[orchestrator.sampling]\nmax_tokens = {max_tokens}\n"
                   f'[[orchestrator.datasets]]\nname = "pictures"\npath = "{tmp_path / "images.jsonl"}"\n'
                   'reward = "math_verify"\n')
    result = subprocess.run(rl_command("run", "@", str(cfg), "--dry-run"), capture_output=True, text=True,
                            timeout=120)
    if fits:
        assert result.returncode == 0, result.stderr
        return
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    said = lines[-1]
    assert len([line for line in lines if "within seq_len" in line]) == 1, result.stderr
    assert said.startswith("rl run: dataset pictures:") and "the longest is 28 tokens" in said, said
    assert "images.jsonl row 0, its images expanded" in said and "orchestrator.sampling.max_tokens" in said, said
    assert not (tmp_path / "out" / "logs" / "inference.log").exists()  # no engine started
