"""models/tiny-vlm, as scripts/make_vlm_model.py builds it: the committed files are what the
script writes (same tokenizer ids, same config), transformers' AutoProcessor loads the real
Idefics3 classes from them, and an image chat expands its <image> to the image's tokens."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from conftest import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
import make_vlm_model as mvm  # noqa: E402

MODEL = ROOT / "models" / "tiny-vlm"


@pytest.fixture(scope="module")
def processor():
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(MODEL)


def test_committed_model_is_what_the_script_builds(tmp_path):
    torch.manual_seed(1234)
    tokenizer = mvm.build_tokenizer()
    mvm.save(mvm.build_model(tokenizer), mvm.build_processor(tokenizer), tmp_path)
    for name in ("config.json", "processor_config.json", "tokenizer.json", "generation_config.json"):
        assert json.loads((tmp_path / name).read_text()) == json.loads((MODEL / name).read_text()), name
    from safetensors.torch import load_file

    built, committed = load_file(tmp_path / "model.safetensors"), load_file(MODEL / "model.safetensors")
    assert built.keys() == committed.keys()
    assert all(torch.equal(built[k], committed[k]) for k in built)


def test_processor_classes_and_placeholder_expansion(processor):
    from transformers import Idefics3ForConditionalGeneration

    assert type(processor).__name__ == "Idefics3Processor"
    assert type(processor.image_processor).__name__ == "Idefics3ImageProcessorPil"  # no torchvision here
    text = processor.apply_chat_template(mvm.example_chat(), add_generation_prompt=True, tokenize=False)
    assert text.count("<image>") == 1
    inputs = processor(text=[text], images=[[mvm.example_image()]], return_tensors="pt")
    ids = inputs["input_ids"][0].tolist()
    tok = processor.tokenizer
    image, fake, glob = tok.convert_tokens_to_ids(["<image>", "<fake_token_around_image>", "<global-img>"])
    start = ids.index(fake)
    # <fake_token_around_image><global-img> <image> x IMAGE_TOKENS <fake_token_around_image>
    assert ids[start:start + 2] == [fake, glob]
    assert ids[start + 2:start + 2 + mvm.IMAGE_TOKENS] == [image] * mvm.IMAGE_TOKENS
    assert ids[start + 2 + mvm.IMAGE_TOKENS] == fake and ids.count(image) == mvm.IMAGE_TOKENS
    assert tuple(inputs["pixel_values"].shape) == (1, 1, 3, mvm.IMAGE_SIZE, mvm.IMAGE_SIZE)
    model = Idefics3ForConditionalGeneration.from_pretrained(MODEL)
    with torch.no_grad():
        logits = model(**inputs).logits
        flipped = processor(text=[text], images=[[mvm.example_image().rotate(90)]], return_tensors="pt")
        other = model(**flipped).logits
    assert logits.shape == (1, len(ids), len(tok))
    # The picture reaches the language model: its tokens' logits change with the pixels.
    assert not torch.allclose(logits[0, -1], other[0, -1])
