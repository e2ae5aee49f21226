"""scripts/make_real_size_model.py: the 2-layer variant of the Qwen2.5-0.5B-shaped model, built
into tmp_path from a 2 MB corpus (the script's own test of loading it in vLLM is --check-vllm)."""

from __future__ import annotations

import json
import subprocess
import sys
import unicodedata

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer
from transformers import AutoConfig, AutoTokenizer

from conftest import ROOT
from orchestrator.rendering.chat import ChatTemplate

SCRIPT = ROOT / "scripts" / "make_real_size_model.py"
# Qwen2.5-0.5B-Instruct's config.json, but for num_hidden_layers (24 there).
QWEN25_05B = {"hidden_size": 896, "intermediate_size": 4864, "num_attention_heads": 14,
              "num_key_value_heads": 2, "vocab_size": 151_936, "tie_word_embeddings": True,
              "rms_norm_eps": 1e-6, "hidden_act": "silu", "bos_token_id": 151_643, "eos_token_id": 151_645}
QWEN25_IDS = {"<|endoftext|>": 151_643, "<|im_start|>": 151_644, "<|im_end|>": 151_645,
              "<|object_ref_start|>": 151_646, "<|video_pad|>": 151_656, "<tool_call>": 151_657,
              "</tool_call>": 151_658, "<|fim_prefix|>": 151_659, "<|file_sep|>": 151_664}
TOOLS = [{"type": "function", "function": {
    "name": "lookup_capital", "description": "The capital city of a country.",
    "parameters": {"type": "object", "properties": {"country": {"type": "string"}}, "required": ["country"]}}}]


def run_script(out, *args: str) -> str:
    argv = [sys.executable, str(SCRIPT), "--layers", "2", "--out", str(out), "--corpus-mb", "2", *args]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("models")
    stdout = run_script(out)
    return out, stdout


@pytest.fixture(scope="module")
def tokenizer(built):
    return AutoTokenizer.from_pretrained(built[0] / "qwen-shape-2l")


def test_config_is_qwen25_05b_but_for_layers(built):
    config = AutoConfig.from_pretrained(built[0] / "qwen-shape-2l")
    assert config.model_type == "qwen2" and config.architectures == ["Qwen2ForCausalLM"]
    assert {k: getattr(config, k) for k in QWEN25_05B} == QWEN25_05B
    assert config.num_hidden_layers == 2
    assert config.hidden_size // config.num_attention_heads == 64  # head_dim
    assert config.rope_parameters["rope_theta"] == 1_000_000.0
    assert json.loads((built[0] / "qwen-shape-2l" / "config.json").read_text())["dtype"] == "bfloat16"


def test_special_tokens_have_qwen25_ids(built, tokenizer):
    assert {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN25_IDS} == QWEN25_IDS
    assert len(tokenizer) == 151_665  # as Qwen2.5's: regular ids 0..151,642, then 22 added
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    # What the orchestrator reads: tokenizer.json alone gives the same ids.
    rust = Tokenizer.from_file(str(built[0] / "qwen-shape-2l" / "tokenizer.json"))
    assert {t: rust.token_to_id(t) for t in QWEN25_IDS} == QWEN25_IDS
    # As in Qwen2.5, tool-call tags survive decoding without special tokens (parsers read them).
    ids = tokenizer.encode("<|im_start|><tool_call>{}</tool_call><|im_end|>", add_special_tokens=False)
    assert tokenizer.decode(ids, skip_special_tokens=True) == "<tool_call>{}</tool_call>"


def test_chat_template_renders_tools(built, tokenizer):
    messages = [
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "lookup_capital", "arguments": {"country": "France"}}}]},
        {"role": "tool", "content": "Paris"},
    ]
    text = tokenizer.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|im_start|>system\n") and "<tools>" in text
    assert json.dumps(TOOLS[0]) in text.split("<tools>")[1].split("</tools>")[0]
    assert '<tool_call>\n{"name": "lookup_capital", "arguments": {"country": "France"}}\n</tool_call>' in text
    assert "<|im_start|>user\n<tool_response>\nParis\n</tool_response><|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")
    ids = tokenizer.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True, return_dict=False)
    # <|im_start|> of system, user, assistant, user (the tool's result), assistant; the tags are
    # single tokens, in the system message's instructions and in the call.
    assert ids.count(151_644) == 5 and ids.count(151_645) == 4
    assert ids.count(151_657) == 2 and ids.count(151_658) == 2
    # The orchestrator's renderer (jinja2 alone) gives the same text and ends turns at <|im_end|>.
    model = built[0] / "qwen-shape-2l"
    ours = ChatTemplate.load(model)
    assert ours.render(messages, add_generation_prompt=True, tools=TOOLS) == text
    assert ours.end_of_turn(Tokenizer.from_file(str(model / "tokenizer.json"))) == [151_645]


@settings(max_examples=200, deadline=None)
@given(text=st.text(max_size=60))
def test_any_text_round_trips(tokenizer, text):
    """Byte-level: every character encodes, none to an unknown token; text comes back as NFC,
    the normalizer Qwen2's tokenizer applies. Text that spells an added token ("<|endoftext|>":
    Hypothesis draws string constants from the code under test, and found it) encodes to that
    token, as in HF tokenizers and vLLM alike: out of this property's scope."""
    assume(not any(added in text for added in tokenizer.get_added_vocab()))
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert all(i < 151_643 for i in ids)
    assert tokenizer.decode(ids) == unicodedata.normalize("NFC", text)


def test_second_run_is_cached(built):
    out, first = built
    assert "qwen-shape-tokenizer: built" in first and "qwen-shape-2l: built" in first
    again = run_script(out)
    assert "qwen-shape-tokenizer: cached" in again and "qwen-shape-2l: cached" in again
