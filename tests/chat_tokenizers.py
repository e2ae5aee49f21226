"""Tokenizers with real chat templates, built here (nothing is downloaded): a byte-level BPE
trained on a little text, ChatML or Llama-3-style special tokens, saved the way transformers
saves them (tokenizer.json, tokenizer_config.json, chat_template.jinja)."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

# Qwen2.5's shape: a default system message, each turn <|im_start|>role\ncontent<|im_end|>\n.
CHATML = (
    "{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
# Llama 3's shape: bos first, <|eot_id|> ends a turn, eos is another token.
LLAMA3 = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
CORPUS = ["You are a helpful assistant.", "What is 2 + 3? The answer is 5.", "system user assistant think",
          "Spell this word backward: ammonia -> ainomma", "héllo wörld, ça va? 数学"]


def build(directory: Path, template: str, specials: list[str], eos: str, bos: str | None = None,
          pad: str | None = None) -> Path:
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 20, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, bos_token=bos, pad_token=pad or eos)
    fast.chat_template = template
    fast.save_pretrained(directory)
    return directory


def chatml(directory: Path, eos: str = "<|im_end|>") -> Path:
    """eos "<|im_end|>" as in an instruct model; "<|endoftext|>" as in a base model that has a
    template (generation must then stop at <|im_end|> all the same)."""
    return build(directory, CHATML, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], eos, pad="<|endoftext|>")


def llama3(directory: Path) -> Path:
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    return build(directory, LLAMA3, specials, eos="<|end_of_text|>", bos="<|begin_of_text|>")
