"""Decoding an image file that a dataset row or another process handed over: the orchestrator's
rows (orchestrator/rendering/images.py) and /generate's `images` (inference/multimodal.py) share one
bound, so that a server refuses no image the orchestrator accepted.

Pillow's own decompression-bomb check is only a warning below twice its limit and is set through a
module global (Image.MAX_IMAGE_PIXELS) that swapping around each open would race between threads:
the size is read from the file's header instead, before any pixel is decoded.
"""

from __future__ import annotations

import io
import re

MAX_DECODE_PIXELS = 64 * 1024 * 1024


class ImageRefused(ValueError):
    """Why an image file was not decoded, in a few words (the caller names the row or field)."""


def open_image(raw: bytes):
    """An RGB PIL image from an encoded file (PNG, JPEG, ...), or ImageRefused."""
    from PIL import Image

    try:
        image = Image.open(io.BytesIO(raw))  # the header only
    except Image.DecompressionBombError as e:
        raise ImageRefused(f"refused as a decompression bomb ({e})") from None
    except Exception as e:  # PIL raises many kinds for a broken file
        raise ImageRefused(f"unreadable image: {type(e).__name__}: {without_address(e)}") from None
    width, height = image.size
    if width * height > MAX_DECODE_PIXELS:
        raise ImageRefused(f"refused as a decompression bomb ({width} x {height} pixels, more than "
                           f"{MAX_DECODE_PIXELS})")
    try:
        image.load()
    except Exception as e:
        raise ImageRefused(f"unreadable image: {type(e).__name__}: {without_address(e)}") from None
    return image.convert("RGB")


def without_address(e: Exception) -> str:
    """PIL's message without the buffer's address ("cannot identify image file <_io.BytesIO object
    at 0x7f...>"): the same bad picture then says the same line, which is said once
    (orchestrator/quiet_warning.py), not once per episode."""
    return re.sub(r" ?<_io\.BytesIO object at 0x[0-9a-fA-F]+>", "", str(e))
