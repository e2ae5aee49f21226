"""Chat prompts (orchestrator/rendering/chat.py, orchestrator/prompts/dataset_mix.py): rendered with jinja2 alone, they give the
ids transformers' apply_chat_template gives; a completion ends at the template's end-of-turn
token as well as eos; system prompts, template options and template files apply; rows and
templates that cannot render are named."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from chat_tokenizers import chatml, llama3
from orchestrator.prompts.dataset_mix import RowError
from orchestrator.rendering.renderer import Renderer
from orchestrator.rendering.tokenizer import load_tokenizer
from orchestrator.rendering.chat import ChatTemplate
from rl.config import ConfigError, RunConfig

CONVERSATIONS = [
    [{"role": "user", "content": "What is 2 + 3?"}],
    [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "héllo wörld, ça va? 数学"}],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": " c \n"}],
]


def renderer(model, **prompts) -> Renderer:
    """`prompts`: keys of [orchestrator.prompts]."""
    cfg = RunConfig(model=model, orchestrator={"prompts": prompts})
    tokenizer = load_tokenizer(str(model))
    return Renderer(cfg.orchestrator, model, tokenizer, lambda text, add_special_tokens=True:
                    tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)


def dataset(run_prompts: dict | None = None, **spec):
    """`run_prompts`: keys of [orchestrator.prompts]; `spec`: the dataset entry's own keys."""
    cfg = RunConfig(model="m", orchestrator={"datasets": [{"function": "x:y", "reward": "x:r", **spec}],
                                             "prompts": run_prompts or {}})
    return cfg.orchestrator.resolved_datasets()[0]


@pytest.mark.parametrize("make", [chatml, llama3])
def test_prompt_ids_equal_apply_chat_template(tmp_path, make):
    model = make(tmp_path / "tok")
    hf = AutoTokenizer.from_pretrained(model)
    r = renderer(model)
    for messages in CONVERSATIONS:
        _, ids, _ = r.render(dataset(), {"messages": messages}, "row 0")
        assert ids == hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                             return_dict=False), messages


def test_template_options_are_passed_through(tmp_path):
    model = chatml(tmp_path / "tok")
    hf = AutoTokenizer.from_pretrained(model)
    messages = CONVERSATIONS[0]
    plain = renderer(model).render(dataset(), {"messages": messages}, "row 0")[1]
    off = renderer(model, chat_template_kwargs={"enable_thinking": False}).render(dataset(), {"messages": messages},
                                                                                   "row 0")[1]
    assert off != plain
    assert off == hf.apply_chat_template(messages, add_generation_prompt=True, enable_thinking=False,
                                         tokenize=True, return_dict=False)


def test_a_prompt_string_is_one_user_message_after_the_system_prompt(tmp_path):
    model = chatml(tmp_path / "tok")
    hf = AutoTokenizer.from_pretrained(model)
    ds = dataset({"system_prompt": "Be terse."})
    asked, ids, _ = renderer(model).render(ds, {"prompt": "What is 2 + 3?"}, "row 0")
    assert asked == "What is 2 + 3?"  # what the reward sees: the question, not the markup
    assert ids == hf.apply_chat_template([{"role": "system", "content": "Be terse."},
                                          {"role": "user", "content": "What is 2 + 3?"}],
                                         add_generation_prompt=True, tokenize=True, return_dict=False)
    # A row's own system message wins over the configured one; a dataset's over the orchestrator's.
    own = [{"role": "system", "content": "Mine."}, {"role": "user", "content": "x"}]
    assert renderer(model).render(ds, {"messages": own}, "row 0")[1] == hf.apply_chat_template(
        own, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert dataset({"system_prompt": "A"}, prompts={"system_prompt": "B"}).system_prompt == "B"


def test_completions_end_at_end_of_turn_and_eos(tmp_path):
    # A base-model-like tokenizer: eos is <|endoftext|>, the template's turns end with <|im_end|>.
    model = chatml(tmp_path / "base", eos="<|endoftext|>")
    tok = load_tokenizer(str(model))
    assert renderer(model).stop_token_ids == sorted({tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|im_end|>")})
    # Llama 3: <|eot_id|> ends a turn, <|end_of_text|> is eos; generation_config lists more.
    model = llama3(tmp_path / "llama")
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 8]}))
    tok = load_tokenizer(str(model))
    assert renderer(model).stop_token_ids == sorted({tok.token_to_id("<|eot_id|>"),
                                                     tok.token_to_id("<|end_of_text|>"), 7, 8})


def test_template_sources_and_modes(tmp_path):
    model = chatml(tmp_path / "tok")
    override = tmp_path / "mine.jinja"
    override.write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}")
    r = renderer(model, chat_template=str(override))
    assert load_tokenizer(str(model)).decode(r.render(dataset(), {"prompt": "hi"}, "row 0")[1]) == "[user] hi\n"
    # tokenizer_config.json's chat_template, where older transformers put it, is read too.
    (model / "chat_template.jinja").unlink()
    config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": "{{ messages[0]['content'] }}!"}))
    assert ChatTemplate.load(model).render([{"role": "user", "content": "x"}]) == "x!"
    # Raw mode: the prompt text as it is, with the tokenizer's own special tokens.
    raw = renderer(model, chat="off")
    assert raw.template is None
    with pytest.raises(RowError, match="holds chat messages but the model has no chat template"):
        raw.render(dataset(), {"messages": CONVERSATIONS[0]}, "data.jsonl row 3")


def test_chat_on_without_a_template_is_a_config_error(tmp_path):
    model = chatml(tmp_path / "tok")
    (model / "chat_template.jinja").unlink()
    assert renderer(model).template is None  # auto: raw completion for a base model
    with pytest.raises(ConfigError, match='orchestrator.prompts.chat = "on"'):
        renderer(model, chat="on")


def test_rows_the_template_cannot_render_are_named(tmp_path):
    model = chatml(tmp_path / "tok")
    strict = tmp_path / "strict.jinja"
    strict.write_text("{% if messages[-1]['role'] != 'user' %}{{ raise_exception('last message must be user') }}"
                      "{% endif %}{{ messages[-1]['content'] }}")
    r = renderer(model, chat_template=str(strict))
    with pytest.raises(RowError, match=r"data.jsonl row 7\): the chat template .* last message must be user"):
        r.render(dataset(), {"messages": [{"role": "assistant", "content": "x"}]}, "dataset d (data.jsonl row 7)")
    with pytest.raises(RowError, match="row 8 has neither a 'prompt' string nor a 'messages' list"):
        r.render(dataset(), {"question": "x"}, "row 8")
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}{{ m.content }")
    with pytest.raises(ConfigError, match=r"broken.jinja\) line 1"):
        renderer(model, chat_template=str(broken))
