"""Images in prompts: a row's chat messages may hold OpenAI image parts
(`{"type": "image_url", "image_url": {"url": ...}}`), the url a file path within the run's
roots, a `data:` URL, or an HF `datasets` Image value ({"bytes": ..., "path": ...}). This module
turns such a chat into what the server samples after and the trainer scores: the prompt's token
ids, each image's placeholder expanded as the model's own processor expands it, and the images
themselves as PNG bytes (lossless: the server and the trainer decode the same pixels).

Without transformers (the orchestrator never imports it: orchestrator/rendering/tokenizer.py): the
template is rendered by chat.py, the expansion is the processor's, read from the model's
processor_config.json (one class per processor kind, PROCESSORS), and tests/orchestrator/test_vlm_prompts.py
checks the ids against AutoProcessor's token for token.

Bad input raises ImageError naming the part: a missing or unreadable image, a path outside the
roots, a decompression bomb (more than MAX_DECODE_PIXELS, rl/image_decode.py), too
many images for the model. An image over the model's max_pixels (a bound well above what its
processor resizes to) is shrunk to it first, said once per run: the batch carries less, and the
server and the trainer still see the same pixels (the shrunk ones; the processor's output then
differs in the last resampling bits from what it would make of the original).
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import logging
from dataclasses import dataclass
from pathlib import Path

from rl.config import ConfigError
from rl.image_decode import ImageRefused, open_image

log = logging.getLogger("orchestrator")

"""Pixels an image file may declare; more is refused before decoding (a decompression bomb)."""


class ImageError(ValueError):
    """An image part that cannot be used; the message names it."""


@dataclass(frozen=True)
class Idefics3Images:
    """Idefics3Processor (SmolVLM): each image becomes <fake_token_around_image><global-img>,
    image_seq_len <image> tokens and <fake_token_around_image>. Tiling (do_image_splitting)
    adds rows of tiles; not supported yet (refused at start-up)."""

    image_seq_len: int
    longest_edge: int
    image_token: str = "<image>"
    max_images: int = 4

    @classmethod
    def from_config(cls, config: dict, where: str) -> Idefics3Images:
        images = config.get("image_processor", {})
        if images.get("do_image_splitting", True):
            raise ConfigError(f"{where}: image_processor.do_image_splitting is on (image tiles): not supported yet")
        edge = images.get("max_image_size", {}).get("longest_edge") or images.get("size", {}).get("longest_edge")
        return cls(image_seq_len=int(config["image_seq_len"]), longest_edge=int(edge))

    def expansion(self) -> str:
        return ("<fake_token_around_image><global-img>" + self.image_token * self.image_seq_len
                + "<fake_token_around_image>")

    @property
    def max_pixels(self) -> int:
        # The processor resizes every image to longest_edge; up to 4x that edge is carried as is
        # (the processor's own resize of it, exactly), beyond it shrunk first (the docstring says why).
        return (4 * self.longest_edge) ** 2


PROCESSORS = {"Idefics3Processor": Idefics3Images}


def image_support(model: Path):
    """The model's image handling (a PROCESSORS class), or None for a text-only model."""
    path = Path(model) / "processor_config.json"
    if not path.is_file():
        return None
    where = str(path)
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ConfigError(f"{where}: unreadable: {e}") from None
    kind = PROCESSORS.get(config.get("processor_class"))
    if kind is None:
        raise ConfigError(f"{where}: processor_class {config.get('processor_class')!r} is not supported "
                          f"(supported: {', '.join(PROCESSORS)})")
    return kind.from_config(config, where)


def image_parts(messages: list[dict], row_images=()) -> list:
    """Each image part's source, in order: an `image_url` part's url (or HF Image value); an
    `image` part's own "image" value (transformers' form) or else the row's next image (TRL's
    form: {"type": "image"} parts and an `images` column, e.g. an HF datasets Image sequence)."""
    sources, column = [], iter(row_images or ())
    for m in messages:
        content = m.get("content")
        if not isinstance(content, list):
            continue
        for part in content:
            if not isinstance(part, dict):
                continue
            if part.get("type") == "image_url":
                url = part.get("image_url")
                sources.append(url.get("url") if isinstance(url, dict) and "url" in url else url)
            elif part.get("type") == "image":
                value = part.get("image")
                if value is None:
                    value = next(column, None)
                    if value is None:
                        raise ImageError("an image part with no image: the row's images column has fewer")
                sources.append(value)
    if next(column, None) is not None:
        raise ImageError("the row's images column has more images than the chat has image parts")
    return sources


def has_images(messages: list[dict]) -> bool:
    return any(isinstance(p, dict) and p.get("type") in ("image_url", "image")
               for m in messages if isinstance(m, dict) and isinstance(m.get("content"), list) for p in m["content"])


def template_messages(messages: list[dict]) -> list[dict]:
    """The messages as chat templates read image parts: {"type": "image"} (SmolVLM's and
    Qwen2-VL's templates test the type)."""
    out = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            content = [{"type": "image"} if isinstance(p, dict) and p.get("type") in ("image_url", "image") else p
                       for p in content]
            m = {**m, "content": content}
        out.append(m)
    return out


def read_source(source, roots: list[Path]):
    """The encoded image a part names (bytes), or a decoded PIL image as it came (an HF
    datasets Image column decodes on access)."""
    if hasattr(source, "getpixel") and hasattr(source, "mode"):  # a PIL image
        return source
    if isinstance(source, dict) and ("bytes" in source or "path" in source):  # HF datasets Image
        if source.get("bytes"):
            return bytes(source["bytes"])
        source = source.get("path")
    if isinstance(source, (bytes, bytearray)):
        return bytes(source)
    if not isinstance(source, str) or not source:
        raise ImageError(f"image_url: {type(source).__name__} is neither a url, a path nor image bytes")
    if source.startswith("data:"):
        head, _, data = source.partition(",")
        if not head.endswith(";base64"):
            raise ImageError("image_url: a data: URL must be base64 (data:image/png;base64,...)")
        try:
            return base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError) as e:
            raise ImageError(f"image_url: data: URL is not valid base64: {e}") from None
    if "://" in source:
        raise ImageError(f"image_url: {source[:80]}: only file paths and data: URLs (nothing is downloaded)")
    path = Path(source)
    resolved = path.resolve()
    if not any(resolved.is_relative_to(Path(r).resolve()) for r in roots):
        raise ImageError(f"image_url: {source} is outside the run's roots ({', '.join(map(str, roots))})")
    try:
        return resolved.read_bytes()
    except OSError as e:
        raise ImageError(f"image_url: {source}: {e.strerror or e}") from None


class Shrunk:
    """Says once per run that images were shrunk."""

    said = False


def decode(data, max_pixels: int, what: str):
    """An RGB PIL image, at most max_pixels (shrunk, aspect kept, when larger)."""
    from PIL import Image

    if isinstance(data, Image.Image):
        return shrink(data.convert("RGB"), max_pixels, what)
    try:
        image = open_image(data)
    except ImageRefused as e:
        raise ImageError(f"{what}: {e}") from None
    return shrink(image, max_pixels, what)


def shrink(image, max_pixels: int, what: str):
    from PIL import Image

    w, h = image.size
    if w * h > max_pixels:
        scale = (max_pixels / (w * h)) ** 0.5
        size = (max(1, int(w * scale)), max(1, int(h * scale)))
        if not Shrunk.said:
            Shrunk.said = True
            log.warning("%s: %dx%d is over the model's max_pixels (%d): shrunk to %dx%d "
                        "(said once; every larger image is shrunk alike)", what, w, h, max_pixels, *size)
        image = image.resize(size, Image.Resampling.BICUBIC)
    return image


def png(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


@dataclass(frozen=True)
class ImagePrompt:
    token_ids: list[int]
    """The prompt as the model reads it, each placeholder expanded: what the trainer sees."""
    request_ids: list[int]
    """One placeholder token per image: what /generate takes (the server's processor expands it,
    and answers the expanded ids, which must be token_ids)."""
    images: list[bytes]
    """PNG bytes, in the order of the prompt's placeholders."""


def render_image_prompt(template, support, tokenizer, messages: list[dict], roots: list[Path],
                        row_images=(), tools: list[dict] | None = None) -> ImagePrompt:
    """A chat with image parts -> its prompt ids (placeholders expanded) and its images.
    `template`: chat.py's ChatTemplate; `tokenizer`: a tokenizers.Tokenizer; `row_images`: the
    row's images column, for {"type": "image"} parts; `tools`: the tool schemas the template
    renders (an agent's request: orchestrator/rollout/agent_images.py). Raises ImageError."""
    sources = image_parts(messages, row_images)
    if support is None:
        raise ImageError("the model has no image processor (processor_config.json): it reads text only")
    if len(sources) > support.max_images:
        raise ImageError(f"{len(sources)} images, more than the {support.max_images} a prompt may hold")
    images = [decode(read_source(s, roots), support.max_pixels, f"image {i}") for i, s in enumerate(sources)]
    return expand_placeholders(support, tokenizer, template.render(template_messages(messages), True, tools), images)


def expand_placeholders(support, tokenizer, text: str, images: list, add_special_tokens: bool = False,
                        wrote: str = "the chat template") -> ImagePrompt:
    """`text` holding one placeholder per image (decoded PIL images, in order) -> its ids with each
    placeholder expanded as the model's processor expands it, its ids as sent, and the PNGs.
    `wrote`: what made the text, for the refusal when the counts differ."""
    found = text.count(support.image_token)
    if found != len(images):
        raise ImageError(f"{wrote} wrote {found} {support.image_token} for {len(images)} images")
    expanded = expand(support, text)
    return ImagePrompt(tokenizer.encode(expanded, add_special_tokens=add_special_tokens).ids,
                       tokenizer.encode(text, add_special_tokens=add_special_tokens).ids, [png(i) for i in images])


def expanded_text(template, support, messages: list[dict], tools: list[dict] | None = None) -> tuple[str, str]:
    """(the chat's prompt text with one placeholder per image, the same with each placeholder
    expanded as the model's processor expands it): what /generate takes and what the model
    reads. The run's renderer (render_image_prompt) and the start-up fit check
    (orchestrator/rendering/fit.py) both measure the second."""
    text = template.render(template_messages(messages), True, tools)
    return text, expand(support, text)


def expand(support, text: str) -> str:
    """Each placeholder in `text` replaced by the model's processor's expansion of it."""
    return text.replace(support.image_token, support.expansion())


def images_at_start_up(model: Path, dataset: str, rows: list[tuple[object, str]], messages_key: str) -> None:
    """Refuse (ConfigError, exit 2) a dataset whose first rows drawn hold image parts when the
    model reads text only (rendering such a row as text would train on prompts the model never
    saw); a vision-language model's processor must be one this module expands (image_support)."""
    for row, where in rows:
        messages = row.get(messages_key) if isinstance(row, dict) else None
        if not isinstance(messages, list) or not has_images(messages):
            continue
        if image_support(model) is None:
            raise ConfigError(f"dataset {dataset}: {where} holds an image part, but {model} reads text only "
                              "(no processor_config.json): use a vision-language model or drop the images")
        return


def request_fields(prompt: ImagePrompt) -> dict:
    """What a GenerateRequest takes of an image prompt: the ids with one placeholder per image
    and the images, base64 (rl/inference_api.py)."""
    return {"prompt_token_ids": prompt.request_ids, "images": [base64.b64encode(b).decode() for b in prompt.images]}


def check_expanded(prompt: ImagePrompt, engine_ids: list[int] | None, where: str) -> None:
    """The server's expansion of the placeholders must be this prompt's token_ids, the ids the
    trainer will score: else the sample is not trainable (its tokens would not be what was sampled)."""
    if engine_ids != prompt.token_ids:
        got = "none" if engine_ids is None else f"{len(engine_ids)} ids"
        raise ImageError(f"{where}: the server expanded the image placeholders to {got}, the model's processor "
                         f"to {len(prompt.token_ids)}: the prompt the server sampled after is not the trainer's")
