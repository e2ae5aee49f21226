"""Pictures in an agent's conversation (orchestrator/rollout/agent_endpoint.py): an agent written
against the OpenAI client may put `image_url` parts with `data:` URLs in its user or tool turns
(an observation that is a picture, e.g. a rendered board), as OpenAI clients send them.

The request is rendered as a dataset row with images is (orchestrator/rendering/images.py
render_image_prompt: the model's chat template, each placeholder expanded as the model's
processor expands it, the pictures decoded under rl/image_decode.py's bound, shrunk past the
model's max pixels, carried as PNG bytes), with the request's tools. Only `data:` URLs: a file
path or a remote URL names something on the orchestrator's side (or the network), which an
agent's message must not reach. Every refusal names the part (`messages[2].content[0]`).
"""

from __future__ import annotations

from orchestrator.rendering import ImageError, ImagePrompt, decode, read_source, render_image_prompt


def image_positions(messages: list[dict]) -> list[tuple[str, object]]:
    """(`messages[i].content[j]`, the part's url) for each image part, in order."""
    out = []
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            if isinstance(part, dict) and part.get("type") in ("image_url", "image"):
                url = part.get("image_url")
                out.append((f"messages[{i}].content[{j}]", url.get("url") if isinstance(url, dict) else url))
    return out


class AgentImages:
    """Renders an agent's request that holds pictures. `support`: the model's image handling
    (rendering/images.py image_support; None for a text-only model); `tokenizer`: a
    tokenizers.Tokenizer."""

    def __init__(self, template, support, tokenizer):
        self.template, self.support, self.tokenizer = template, support, tokenizer

    def prompt(self, messages: list[dict], tools: list[dict] | None) -> ImagePrompt:
        """The request's prompt ids (placeholders expanded), its request ids and PNGs; raises
        ImageError naming the part, or jinja2.TemplateError."""
        if self.support is None:
            raise ImageError("an image part, and the model has no image processor (processor_config.json): "
                             "it reads text only")
        pictures = iter(self.pictures(image_positions(messages)))
        # Decoded once here, then handed on as images (transformers' {"type": "image", "image": ...}).
        filled = [m if not (isinstance(m, dict) and isinstance(m.get("content"), list)) else
                  {**m, "content": [{"type": "image", "image": next(pictures)}
                                    if isinstance(p, dict) and p.get("type") in ("image_url", "image") else p
                                    for p in m["content"]]}
                  for m in messages]
        return render_image_prompt(self.template, self.support, self.tokenizer, filled, [], tools=tools)

    def pictures(self, parts: list[tuple[str, object]], before: int = 0) -> list:
        """The decoded pictures of `parts` ((where, url) each, as image_positions gives them),
        `before` pictures being in the prompt already (a multi-turn episode's earlier turns:
        orchestrator/rollout/turn_images.py); raises ImageError naming the part."""
        if before + len(parts) > self.support.max_images:
            at = max(0, self.support.max_images - before)
            raise ImageError(f"{parts[at][0]}: {before + len(parts)} images, more than the "
                             f"{self.support.max_images} a prompt may hold")
        return [self.picture(where, url) for where, url in parts]

    def picture(self, where: str, url):
        if not isinstance(url, str) or not url.startswith("data:"):
            shown = url[:60] if isinstance(url, str) else type(url).__name__
            raise ImageError(f"{where}: {shown!r}: an image_url from an agent, a tool or an environment must be a "
                             "data: URL (data:image/png;base64,...); paths and remote URLs are not read")
        try:
            return decode(read_source(url, []), self.support.max_pixels, where)
        except ImageError as e:
            message = str(e)
            raise ImageError(message if message.startswith(where) else f"{where}: {message}") from None
