"""Which tokens of a rendered conversation the assistant wrote: the loss mask of supervised
training (`rl sft`, orchestrator/sft/data.py).

Two ways, by template:
  - marked: a template with {% generation %} blocks says itself what the assistant generates
    (transformers' `return_assistant_tokens_mask` reads the same blocks): their spans.
  - unmarked: derived from render differences. For assistant message i, what the template adds
    for it is render(messages[:i+1]) past render(messages[:i], add_generation_prompt=True): the
    content and whatever closes the turn (ChatML's <|im_end|>, Llama 3's <|eot_id|>), trailing
    whitespace left out (the newline after <|im_end|> is not generated: generation stops at
    the end-of-turn token). Each of those must be a prefix of the whole conversation's text; a
    template that renders earlier turns differently once later ones follow (one that drops past
    reasoning) has no such prefix, and the row is refused (`MaskError`).

Tokens: the whole text tokenized once; a token is the assistant's when its characters overlap a
span (as transformers marks them, through char_to_token).
"""

from __future__ import annotations

import jinja2

from orchestrator.rendering import ChatTemplate


class MaskError(Exception):
    """A conversation that cannot be trained on; `kind` groups the skipped rows in the report."""

    def __init__(self, kind: str, detail: str = ""):
        super().__init__(f"{kind}{': ' + detail if detail else ''}")
        self.kind, self.detail = kind, detail


def assistant_spans(template: ChatTemplate, messages: list[dict],
                    tools: list[dict] | None = None) -> tuple[str, list[tuple[int, int]]]:
    """The conversation's text and the character spans of its assistant turns."""
    if not any(m.get("role") == "assistant" for m in messages):
        raise MaskError("no assistant turn")
    try:
        text, spans = template.render_spans(messages, tools)
        if template.marks_generation and spans:
            return text, spans
        return text, _spans_by_difference(template, messages, tools, text)
    except jinja2.TemplateError as e:
        raise MaskError("the chat template failed", str(e)) from None


def _spans_by_difference(template: ChatTemplate, messages: list[dict], tools: list[dict] | None,
                         text: str) -> list[tuple[int, int]]:
    spans = []
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        if i == 0:
            raise MaskError("an assistant turn opens the conversation", "nothing prompts it")
        before = template.render(messages[:i], add_generation_prompt=True, tools=tools)
        through = template.render(messages[:i + 1], add_generation_prompt=False, tools=tools)
        if not (text.startswith(through) and through.startswith(before)):
            raise MaskError("the template renders earlier turns differently once later ones follow",
                            f"at message {i}; split such conversations into one row per assistant turn")
        spans.append((len(before), len(through.rstrip())))
    return spans


def tokens_and_mask(tokenizer, text: str, spans: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
    """`text` tokenized as the template wrote it (no special tokens added), and 1 on each token
    overlapping a span. `tokenizer`: a `tokenizers.Tokenizer`, or a transformers fast tokenizer."""
    if hasattr(tokenizer, "encode_batch"):  # tokenizers.Tokenizer
        enc = tokenizer.encode(text, add_special_tokens=False)
        ids, offsets = enc.ids, enc.offsets
    else:
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids, offsets = enc["input_ids"], enc["offset_mapping"]
    mask = [0] * len(ids)
    spans = sorted(spans)
    for j, (start, end) in enumerate(offsets):
        if end > start and any(start < s_end and end > s_start for s_start, s_end in spans):
            mask[j] = 1
    return list(ids), mask


def conversation_tokens(template: ChatTemplate, tokenizer, messages: list[dict],
                        tools: list[dict] | None = None) -> tuple[list[int], list[int]]:
    """Token ids of a whole conversation and its assistant mask."""
    text, spans = assistant_spans(template, messages, tools)
    ids, mask = tokens_and_mask(tokenizer, text, spans)
    if not any(mask):
        raise MaskError("no assistant token", "its assistant turns render empty")
    return ids, mask
