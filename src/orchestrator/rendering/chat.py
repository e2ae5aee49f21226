"""A model's chat template, rendered the way transformers' `apply_chat_template` renders it, but
with jinja2 alone: the orchestrator never imports transformers (which imports torch;
orchestrator/rendering/tokenizer.py says why). tests/orchestrator/test_chat.py checks the ids against
apply_chat_template's.

Where the template lives, first found wins: the file orchestrator.prompts.chat_template names;
chat_template.jinja in the model directory (transformers >= 4.43 saves it there);
tokenizer_config.json's "chat_template" (a string, or a list of named templates: "default").
The template sees `messages`, `add_generation_prompt`, the tokenizer's special tokens by name
(bos_token, eos_token, ...) and the config's chat_template_kwargs (e.g. enable_thinking), as
with transformers; the rendered text is tokenized without adding special tokens (the template
writes them).

End of turn: the template marks where an assistant message ends, often with a token that is not
the tokenizer's eos (ChatML's <|im_end|> in a base model, Llama 3's <|eot_id|>). `end_of_turn`
renders a conversation ending in a probe assistant message and takes the special token right
after it, so generation stops there without naming model families.

`{% generation %}...{% endgeneration %}`: transformers' marker of what the assistant generates
(its `return_assistant_tokens_mask`). It renders its body as is; `render_spans` also returns the
character span of each marked block (orchestrator/sft/assistant_mask.py turns them into a loss mask).
"""

from __future__ import annotations

import json
import re
from datetime import datetime
from functools import cached_property
from pathlib import Path

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

from rl.config import ConfigError, OrchestratorConfig

SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
PROBE = "Probe0x5Fend"


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # transformers' filter: Jinja's own escapes HTML characters, which templates do not expect.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise(message: str):
    raise jinja2.exceptions.TemplateError(message)


def token_text(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: unreadable JSON: {e}") from None


def find_template(model: Path, override: Path | None) -> tuple[str, str] | None:
    """(template source, where it came from), or None when the model has no template."""
    if override is not None:
        try:
            return override.read_text(encoding="utf-8"), str(override)
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"orchestrator.prompts.chat_template = {override}: cannot read it: {e}") from None
    jinja_file = model / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8"), str(jinja_file)
    config_file = model / "tokenizer_config.json"
    template = read_json(config_file).get("chat_template")
    if isinstance(template, list):  # named templates ("default", "tool_use", ...)
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return (template, f"{config_file} chat_template") if isinstance(template, str) else None


def row_messages(row: dict, prompt_key: str, messages_key: str, system_prompt: str) -> list[dict]:
    """A row's chat: its messages, or its prompt as one user message; the system prompt first
    unless the row brings its own."""
    messages = row.get(messages_key)
    if messages is None:
        messages = [{"role": "user", "content": row[prompt_key]}]
    if system_prompt and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": system_prompt}, *messages]
    return messages


GENERATION_TAG = re.compile(r"{%-?\s*generation\s*-?%}")


class Spans:
    """One rendering's output so far and the spans of its generation blocks."""

    def __init__(self):
        self.chunks: list[str] = []
        self.spans: list[tuple[int, int]] = []


class GenerationBlocks(Extension):
    """`{% generation %}body{% endgeneration %}` renders body; given a `Spans` as the render
    variable `_spans`, it also notes where body landed. The offset is the length of what the
    render yielded before the block: jinja yields a template's top-level output in order, so a
    consumer that collects each chunk as it comes (render_spans) holds exactly that. A block
    inside a macro or a {% set %} buffer would be mis-placed (as in transformers)."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_block", [nodes.Name("_spans", "load")])
        return nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    @staticmethod
    def _block(spans, caller) -> str:
        text = caller()
        if isinstance(spans, Spans):
            start = sum(len(c) for c in spans.chunks)
            spans.spans.append((start, start + len(text)))
        return text


class ChatTemplate:
    def __init__(self, source: str, origin: str, special_tokens: dict[str, str], kwargs: dict):
        self.origin, self.kwargs = origin, kwargs
        self.special_tokens = special_tokens
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols", GenerationBlocks])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self.marks_generation = bool(GENERATION_TAG.search(source))
        try:
            self.template = env.from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ConfigError(f"chat template ({origin}) line {e.lineno}: {e.message}") from None

    @classmethod
    def load(cls, model: Path, override: Path | None = None, kwargs: dict | None = None) -> ChatTemplate | None:
        found = find_template(Path(model), override)
        if found is None:
            return None
        config = read_json(Path(model) / "tokenizer_config.json")
        special_map = read_json(Path(model) / "special_tokens_map.json")
        specials = {}
        for key in SPECIAL_KEYS:
            text = token_text(config.get(key)) or token_text(special_map.get(key))
            if text is not None:
                specials[key] = text
        return cls(*found, specials, dict(kwargs or {}))

    @classmethod
    def configured(cls, o: OrchestratorConfig, model: Path) -> ChatTemplate | None:
        """The template orchestrator config `o` asks for (chat, chat_template, chat_template_kwargs):
        None for raw completion; ConfigError for chat = "on" without one."""
        template = None if o.prompts.chat == "off" else cls.load(model, o.prompts.chat_template, o.prompts.chat_template_kwargs)
        if o.prompts.chat == "on" and template is None:
            raise ConfigError(f"orchestrator.prompts.chat = \"on\": {model} has no chat template (chat_template.jinja or "
                              "tokenizer_config.json chat_template); set orchestrator.prompts.chat_template")
        return template

    def render(self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None) -> str:
        """The prompt text; a template that raises (or a message it rejects) raises TemplateError.
        `tools`: JSON schemas as transformers passes them ({"type": "function", "function": ...})."""
        try:
            return self.template.render(messages=messages, tools=tools, documents=None,
                                        add_generation_prompt=add_generation_prompt,
                                        **self.special_tokens, **self.kwargs)
        except jinja2.TemplateError:
            raise
        except Exception as e:  # a template's own bug (a missing key, a type error) reads the same
            raise jinja2.TemplateError(f"{type(e).__name__}: {e}") from None

    def render_spans(self, messages: list[dict], tools: list[dict] | None = None) -> tuple[str, list[tuple[int, int]]]:
        """The whole conversation's text (no generation prompt) and the character spans of its
        {% generation %} blocks (none on a template without them)."""
        spans = Spans()
        try:
            for chunk in self.template.generate(messages=messages, tools=tools, documents=None,
                                                add_generation_prompt=False, _spans=spans,
                                                **self.special_tokens, **self.kwargs):
                spans.chunks.append(chunk)
        except jinja2.TemplateError:
            raise
        except Exception as e:
            raise jinja2.TemplateError(f"{type(e).__name__}: {e}") from None
        return "".join(spans.chunks), spans.spans

    @cached_property
    def probe_text(self) -> str | None:
        """What the template writes right after an assistant message's content (end of turn)."""
        try:
            text = self.render([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": PROBE}],
                               add_generation_prompt=False)
        except jinja2.TemplateError:
            return None
        at = text.rfind(PROBE)
        return None if at < 0 else text[at + len(PROBE):]

    def end_of_turn(self, tokenizer) -> list[int]:
        """Id of the special token that ends an assistant turn (empty if the template has none)."""
        after = self.probe_text
        if not after:
            return []
        ids = tokenizer.encode(after, add_special_tokens=False).ids
        specials = {i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
        return ids[:1] if ids and ids[0] in specials else []
