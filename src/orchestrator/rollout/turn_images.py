"""Pictures in the environment kinds' turns: a tool's result in the built-in tool loop
(orchestrator/rollout/tool_episode.py), a text environment's start or observation
(orchestrator/rollout/text_environment.py), a tool environment's opening messages.

The Python-side form (docs/tools.md, docs/vlm.md): a PIL image, or a list of content parts whose
items are strings, PIL images or OpenAI parts (`{"type": "text", "text": ...}`,
`{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}`, transformers'
`{"type": "image", "image": <PIL image>}`). `content_of` turns it
into OpenAI message content, each PIL image a PNG data: URL, so that the conversation a reward
reads stays JSON; a string stays a string, anything else is the caller's to render as before.

An episode's pictures (`EpisodeImages`) are decoded and bounded as an agent's are
(orchestrator/rollout/agent_images.py: data: URLs only, rl/image_decode.py's bound, at most the
model's pictures a prompt, shrunk past max pixels), their placeholders expanded as the model's
processor expands them (orchestrator/rendering/images.py expand_placeholders). The episode keeps
two id lists side by side: the trajectory's (expanded: what the trainer scores) and the ones sent
(one placeholder per picture: what /generate takes), with the PNGs in placeholder order, so that
every turn's request carries all the pictures of the turns before it."""

from __future__ import annotations

import base64

from orchestrator.rendering import ImageError, ImagePrompt, expand_placeholders, png
from orchestrator.rollout.agent_images import AgentImages, image_positions

PART_TYPES = ("text", "image_url", "image")


def is_picture(value) -> bool:
    return hasattr(value, "getpixel") and hasattr(value, "mode")  # a PIL image (PIL not imported for text runs)


def image_part(image) -> dict:
    """A PIL image as an OpenAI image part (a PNG data: URL)."""
    data = base64.b64encode(png(image.convert("RGB"))).decode()
    return {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}}


def content_of(value) -> str | list[dict] | None:
    """A tool's result or an environment's turn as message content: a string as is; a picture (a
    PIL image, or a list of parts holding one) as OpenAI content parts; None for anything else."""
    if isinstance(value, str):
        return value
    if is_picture(value):
        return [image_part(value)]
    if not isinstance(value, (list, tuple)) or not value:
        return None
    if not all(isinstance(v, str) or is_picture(v) or (isinstance(v, dict) and v.get("type") in PART_TYPES)
               for v in value):
        return None
    if not any(is_picture(v) or isinstance(v, dict) and v.get("type") != "text" for v in value):
        return None  # no picture: a list of strings stays JSON, as before
    return [{"type": "text", "text": v} if isinstance(v, str) else image_part(v) if is_picture(v)
            else image_part(v["image"]) if is_picture(v.get("image")) else v for v in value]


def with_pictures(messages: list[dict]) -> list[dict]:
    """Messages whose list contents may hold PIL images, in OpenAI form (content_of)."""
    return [{**m, "content": content_of(m["content"]) or m["content"]}
            if isinstance(m, dict) and isinstance(m.get("content"), list) else m for m in messages]


def named_pictures(content, where: str) -> list[tuple[str, object]]:
    """(`<where>: content[j]`, the url) of each image part of one message's content."""
    return [(f"{where}: {name.split('.', 1)[1]}", url)
            for name, url in image_positions([{"content": content}])]


class EpisodeImages:
    """One episode's pictures so far and the ids sent beside the trajectory's (module docstring).
    `images`: the model's AgentImages (its support None for a text-only model); `encode`: the
    toolkit's, for text before any picture (the ids then are the text path's, unchanged)."""

    def __init__(self, images: AgentImages, encode):
        self.images, self.encode = images, encode
        self.sent: list[int] = []
        self.pngs: list[bytes] = []

    def decoded(self, parts: list[tuple[str, object]]) -> list:
        """The pictures of `parts` ((where, url) each), decoded; ImageError naming the part."""
        if parts and self.images.support is None:
            raise ImageError(f"{parts[0][0]}: a picture, and the model has no image processor "
                             "(processor_config.json): it reads text only")
        return self.images.pictures(parts, len(self.pngs)) if parts else []

    def piece(self, text: str, pictures: list, add_special_tokens: bool = False,
              wrote: str = "the chat template") -> ImagePrompt:
        """`text` (one placeholder per picture of `pictures`, decoded, in order) as the trajectory's
        ids (token_ids), the ids sent (request_ids) and the PNGs; `keep` adds it to the episode."""
        if not pictures and not self.pngs:  # text so far: the text path's ids
            ids = self.encode(text, add_special_tokens=add_special_tokens)
            return ImagePrompt(ids, ids, [])
        return expand_placeholders(self.images.support, self.images.tokenizer, text, pictures, add_special_tokens,
                                   wrote)

    def keep(self, piece: ImagePrompt) -> list[int]:
        self.sent += piece.request_ids
        self.pngs += piece.images
        return piece.token_ids

    def readable(self, piece: ImagePrompt) -> bool:
        """Whether the engine reads the episode with `piece` as sent: one placeholder per picture.
        Not so once the model itself wrote the placeholder token in a turn (its turn is text to
        the engine that sampled it, a picture's placeholder to the next request): the episode
        ends there, as it does out of room."""
        pictures = len(self.pngs) + len(piece.images)
        if not pictures:
            return True
        placeholder = self.images.tokenizer.token_to_id(self.images.support.image_token)
        return self.sent.count(placeholder) + piece.request_ids.count(placeholder) == pictures

    def sampled(self, ids: list[int]) -> None:
        self.sent += ids

    def raw_text(self, content, where: str) -> tuple[str, list]:
        """A text environment's turn (a string or content parts) as raw text, each picture its
        placeholder token, and its pictures decoded."""
        if isinstance(content, str):
            return content, []
        pictures = self.decoded(named_pictures(content, where))
        token = self.images.support.image_token if pictures else ""
        return "".join(p["text"] if p.get("type") == "text" else token for p in content), pictures

    def request(self, tokens: list[int]) -> ImagePrompt | None:
        """What the next turn's request carries (rendering/images.py request_fields), None
        without pictures. `tokens`: the trajectory's ids so far."""
        if not self.pngs:
            return None
        return ImagePrompt(list(tokens), list(self.sent), list(self.pngs))
