"""Pictures as the VLM tests make them (Pillow): a picture of a size and colour, its encoded
bytes, a data: URL and an OpenAI image_url part."""

from __future__ import annotations

import base64
import io

from PIL import Image, ImageDraw


def picture(w: int, h: int, colour=(200, 30, 30)) -> Image.Image:
    image = Image.new("RGB", (w, h), (255, 255, 255))
    ImageDraw.Draw(image).ellipse((w // 4, h // 4, w // 2, h // 2), fill=colour)
    return image


def encoded(image: Image.Image, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return buf.getvalue()


def data_url(image: Image.Image) -> str:
    return "data:image/png;base64," + base64.b64encode(encoded(image)).decode()


def part(url) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}
