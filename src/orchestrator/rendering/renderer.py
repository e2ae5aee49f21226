"""A row -> the prompt text a reward sees and the prompt's token ids, as every single-turn request
(orchestrator/rollout/single_turn.py) and held-out evaluation (orchestrator/evaluation/held_out.py)
sends it, and where a completion ends (the stop token ids). The text is the one the start-up check
measured (fit.py: dataset_prompt); the chat template is chat.py's.
"""

from __future__ import annotations

from pathlib import Path

import jinja2

from orchestrator.prompts import RowError, row_problem
from orchestrator.rendering.chat import ChatTemplate, read_json, token_text
from orchestrator.rendering.fit import dataset_prompt
from orchestrator.rendering.images import ImageError, ImagePrompt, has_images, image_support, render_image_prompt
from rl.config import OrchestratorConfig
from rl.config.datasets import Dataset


class Renderer:
    """A row -> (the prompt text a reward sees, prompt ids). Chat: the row's messages (or its
    prompt as one user message), a system message first if configured, through the chat
    template with the generation prompt. Raw: the prompt text as is."""

    def __init__(self, o: OrchestratorConfig, model: Path, tokenizer, encode):
        self.encode, self.tokenizer = encode, tokenizer
        self.template = ChatTemplate.configured(o, model)
        self.stop_token_ids = stop_token_ids(model, tokenizer, self.template)
        self.image_support = image_support(model)  # None: the model reads text only

    def render(self, ds: Dataset, row: dict, where: str, roots: list[Path] = ()
               ) -> tuple[str, list[int], ImagePrompt | None]:
        """(what a reward sees, the prompt ids as the trainer sees them, the row's images or None).
        A row with image parts is rendered with the model's processor's expansion
        (orchestrator/rendering/images.py); an unusable image is a RowError naming the row and
        the image (the row skipped and counted: skipped_image_rows)."""
        problem = row_problem(row, ds.spec)
        if problem is not None:
            raise RowError(f"{where} {problem}", f"set dataset {ds.name}'s prompt_key / messages_key to the fields "
                           "that hold the prompt")
        messages = row.get(ds.spec.messages_key)
        if self.template is None:
            if messages is not None:
                raise RowError(f"{where} holds chat messages but the model has no chat template",
                               "set orchestrator.prompts.chat_template, or use a chat model")
            text, _ = dataset_prompt(None, ds, row)
            return text, self.encode(text), None
        try:  # the text the start-up check measured (orchestrator/rendering/fit.py)
            text, messages = dataset_prompt(self.template, ds, row)
        except jinja2.TemplateError as e:
            raise RowError(f"{where}: the chat template ({self.template.origin}) failed: {e}",
                           "fix the template (orchestrator.prompts.chat_template) or the row") from None
        # The reward sees what the user asked (the last user message), not the markup.
        asked = next((m["content"] for m in reversed(messages) if m["role"] == "user"), text)
        if not has_images(messages):
            return asked, self.encode(text, add_special_tokens=False), None
        if isinstance(asked, list):  # its text parts
            asked = "".join(p.get("text", "") for p in asked if isinstance(p, dict) and p.get("type") == "text")
        try:
            prompt = render_image_prompt(self.template, self.image_support, self.tokenizer, messages, list(roots),
                                         row.get("images") or ())
        except ImageError as e:
            raise RowError(f"{where}: {e}", "fix or drop the row's image (docs/vlm.md, Bad input)", image=True) from None
        return asked, prompt.token_ids, prompt


def stop_token_ids(model: Path, tokenizer, template: ChatTemplate | None) -> list[int]:
    """Where a completion ends: the tokenizer's eos, generation_config.json's eos ids (several in
    chat models), and the template's end-of-turn token."""
    ids: list[int] = []
    eos = token_text(read_json(Path(model) / "tokenizer_config.json").get("eos_token"))
    if eos is not None and tokenizer is not None and tokenizer.token_to_id(eos) is not None:
        ids.append(tokenizer.token_to_id(eos))
    generation = read_json(Path(model) / "generation_config.json").get("eos_token_id")
    ids += generation if isinstance(generation, list) else [generation] if isinstance(generation, int) else []
    if template is not None and tokenizer is not None:
        ids += template.end_of_turn(tokenizer)
    return sorted(set(ids))
