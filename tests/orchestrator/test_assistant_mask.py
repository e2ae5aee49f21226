"""The assistant-token mask of supervised training (orchestrator/sft/assistant_mask.py): on templates
that mark generations ({% generation %}), equal to transformers' return_assistant_tokens_mask,
ids included; on the same templates without the marks, derived from render differences, equal
to it all the same; ChatML, Llama 3 and a tool-calling template, several turns each."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerFast

from chat_tokenizers import build, chatml, llama3
from orchestrator.sft.assistant_mask import MaskError, conversation_tokens
from orchestrator.rendering.chat import ChatTemplate

CHATML_MARKED = (
    "{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}<|im_end|>{% endgeneration %}{{ '\\n' }}"
    "{% else %}{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LLAMA3_MARKED = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] | trim }}<|eot_id|>{% endgeneration %}"
    "{% else %}{{ m['content'] | trim }}<|eot_id|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
# Hermes-style tool calls: tool schemas in the system turn, calls as <tool_call> JSON, results as
# a user turn of <tool_response>s.
TOOLS_MARKED = (
    "{% if tools %}<|im_start|>system\n# Tools\n<tools>{% for t in tools %}{{ '\\n' + (t | tojson) }}{% endfor %}"
    "{{ '\\n' }}</tools><|im_end|>{{ '\\n' }}{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' %}<|im_start|>assistant{{ '\\n' }}{% generation %}{{ m['content'] or '' }}"
    "{% for c in m['tool_calls'] or [] %}<tool_call>{{ '\\n' }}"
    "{{ {'name': c['function']['name'], 'arguments': c['function']['arguments']} | tojson }}{{ '\\n' }}</tool_call>"
    "{% endfor %}<|im_end|>{% endgeneration %}{{ '\\n' }}"
    "{% elif m['role'] == 'tool' %}<|im_start|>user{{ '\\n' }}<tool_response>{{ '\\n' + m['content'] + '\\n' }}"
    "</tool_response><|im_end|>{{ '\\n' }}"
    "{% else %}<|im_start|>{{ m['role'] + '\\n' + m['content'] }}<|im_end|>{{ '\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant{{ '\\n' }}{% endif %}"
)
CHAT = [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "The answer is 5."},
        {"role": "user", "content": "Spell ammonia backward"}, {"role": "assistant", "content": "ainomma"}]
TOOL_CHAT = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]},
    {"role": "tool", "content": "5"},
    {"role": "assistant", "content": "The answer is 5."},
]
TOOLS = [{"type": "function", "function": {"name": "add", "description": "a + b", "parameters": {
    "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}}}}]


def unmarked(template: str) -> str:
    return template.replace("{% generation %}", "").replace("{% endgeneration %}", "")


def tool_tokenizer(directory):
    return build(directory, TOOLS_MARKED, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], "<|im_end|>",
                 pad="<|endoftext|>")


CASES = {"chatml": (chatml, CHATML_MARKED, CHAT, None), "llama3": (llama3, LLAMA3_MARKED, CHAT, None),
         "tools": (tool_tokenizer, TOOLS_MARKED, TOOL_CHAT, TOOLS)}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("marked", [True, False], ids=["marked", "by-difference"])
def test_the_mask_equals_transformers_assistant_tokens_mask(tmp_path, case, marked):
    make, template, messages, tools = CASES[case]
    directory = make(tmp_path / case)
    hf = PreTrainedTokenizerFast.from_pretrained(directory)
    want = hf.apply_chat_template(messages, tools=tools, chat_template=template, tokenize=True, return_dict=True,
                                  return_assistant_tokens_mask=True)
    specials = {k: v for k, v in (("bos_token", hf.bos_token), ("eos_token", hf.eos_token)) if v}
    ours = ChatTemplate(template if marked else unmarked(template), case, specials, {})
    assert ours.marks_generation is marked
    ids, mask = conversation_tokens(ours, Tokenizer.from_file(str(directory / "tokenizer.json")), messages, tools)
    assert ids == list(want["input_ids"])
    assert sum(want["assistant_masks"]) > 0
    assert mask == list(want["assistant_masks"])
    # What the mask covers is the assistants' text and their end-of-turn, nothing of the others'.
    trained = hf.decode([i for i, m in zip(ids, mask) if m])
    assert "The answer is 5." in trained and "What is 2 + 3?" not in trained


def test_a_conversation_without_an_assistant_turn_is_refused(tmp_path):
    template = ChatTemplate(unmarked(CHATML_MARKED), "chatml", {}, {})
    tokenizer = Tokenizer.from_file(str(chatml(tmp_path) / "tokenizer.json"))
    with pytest.raises(MaskError) as e:
        conversation_tokens(template, tokenizer, [{"role": "user", "content": "Hi"}])
    assert e.value.kind == "no assistant turn"


def test_a_template_that_rewrites_earlier_turns_is_refused_without_marks(tmp_path):
    """A template that drops earlier assistant turns' reasoning (as Qwen3's does) renders turn 1
    differently once turn 2 follows: no prefix, so no mask by difference."""
    drops = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
             "{% if m['role'] == 'assistant' and not loop.last %}{{ m['content'].split('</think>')[-1] }}"
             "{% else %}{{ m['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
             "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    tokenizer = Tokenizer.from_file(str(chatml(tmp_path) / "tokenizer.json"))
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "<think>x</think>b"},
                {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]
    with pytest.raises(MaskError, match="renders earlier turns differently"):
        conversation_tokens(ChatTemplate(drops, "drops", {}, {}), tokenizer, messages)
