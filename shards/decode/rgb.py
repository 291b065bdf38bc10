"""Any stored image as 8-bit RGB, the one colour model the transforms work in.

Shards keep each source's bytes as they were (grayscale, palette, CMYK, 16-bit, RGBA...); the conversion
happens here, at decode time, the same way for training, evaluation and the build's checks.

:func:`open_image` is how every stored image is opened, at build and at load: it reads the header only and
refuses an image that would decode to more than :data:`MAX_IMAGE_PIXELS` pixels (a decompression bomb: a
small PNG that claims 100,000 × 100,000 pixels) before any pixel is decoded.
"""

from __future__ import annotations

import io
import warnings

import numpy as np
from PIL import Image

#: PIL's own warning threshold (a quarter GiB of RGB, about 9,500 × 9,500), made a refusal: larger than any
#: image of the benchmarks (SOP, CUB, Cars, In-Shop) by far, small enough that one decode cannot exhaust memory
MAX_IMAGE_PIXELS = 1024 * 1024 * 1024 // 4 // 3


class ImageTooLarge(ValueError):
    """An image whose header claims more than :data:`MAX_IMAGE_PIXELS` pixels; the message gives its size."""


def open_image(data: bytes) -> Image.Image:
    """The PIL image of stored bytes, header read only (PIL decodes on first use); :class:`ImageTooLarge` when it
    would decode to more than :data:`MAX_IMAGE_PIXELS` pixels, PIL's own errors for bytes that are no image."""
    try:
        with warnings.catch_warnings():  # PIL's warning threshold is our bound, which refuses below
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError as e:  # PIL's hard limit (twice its warning threshold) comes first
        raise ImageTooLarge(f"too large to decode ({e})") from None
    w, h = img.size
    if w * h > MAX_IMAGE_PIXELS:
        raise ImageTooLarge(
            f"too large to decode: {w} x {h} = {w * h:,} pixels, more than the {MAX_IMAGE_PIXELS:,} any image may "
            "have (a decompression bomb?)"
        )
    return img


def to_rgb(img: Image.Image) -> Image.Image:
    """Any PIL mode as 8-bit RGB: alpha composited on white, 16-bit and float grayscale rescaled, the rest converted."""
    if img.mode == "RGB":
        return img
    if img.mode in ("RGBA", "LA", "PA", "La", "RGBa") or (img.mode == "P" and "transparency" in img.info):
        rgba = img.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    if img.mode.startswith("I") or img.mode == "F":
        arr = np.asarray(img, dtype=np.float64)
        top = (
            1.0 if img.mode == "F" and arr.max(initial=0) <= 1.0 else (255.0 if arr.max(initial=0) <= 255 else 65535.0)
        )
        return Image.fromarray(np.clip(arr * (255.0 / top), 0, 255).astype(np.uint8), "L").convert("RGB")
    return img.convert("RGB")
