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
    check_pixels(img)
    return img


def check_pixels(img: Image.Image) -> None:
    """:class:`ImageTooLarge` when ``img`` holds more than :data:`MAX_IMAGE_PIXELS` pixels (whoever opened it)."""
    w, h = img.size
    if w * h > MAX_IMAGE_PIXELS:
        raise ImageTooLarge(
            f"too large to decode: {w} x {h} = {w * h:,} pixels, more than the {MAX_IMAGE_PIXELS:,} any image may "
            "have (a decompression bomb?)"
        )


def to_rgb(img: Image.Image) -> Image.Image:
    """Any PIL mode as 8-bit RGB: alpha composited on white, 16-bit and float grayscale rescaled, the rest converted.

    The pixel bound (:func:`check_pixels`) holds here too, before any conversion. 16-bit and 32-bit integer images
    are scaled with integer arithmetic (``v // 257`` for a 16-bit range, exactly what ``v * 255 / 65535`` floors
    to) and float ones in float32 in place, so a conversion holds about one copy of the image's own bytes, never
    a float64 one (8 bytes a pixel, several times over)."""
    check_pixels(img)
    if img.mode == "RGB":
        return img
    if img.mode in ("RGBA", "LA", "PA", "La", "RGBa") or (img.mode == "P" and "transparency" in img.info):
        rgba = img.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    if img.mode.startswith("I") or img.mode == "F":
        return Image.fromarray(_gray8(img), "L").convert("RGB")
    return img.convert("RGB")


def _gray8(img: Image.Image) -> np.ndarray:
    """An ``I``, ``I;16*`` or ``F`` image as uint8: values up to 255 kept, a 16-bit range (up to 65535) scaled by
    255/65535, a float image up to 1.0 by 255; below 0 and above the range clipped."""
    arr = np.asarray(img)
    if arr.dtype.kind == "f":
        top = float(arr.max(initial=0))
        scale = 255.0 if top <= 1.0 else (1.0 if top <= 255 else 255.0 / 65535.0)
        out = arr.astype(np.float32, copy=True)  # one float32 copy, scaled and clipped in place
        out *= np.float32(scale)
        np.clip(out, 0, 255, out=out)
        return out.astype(np.uint8)
    top = int(arr.max(initial=0))
    if arr.dtype.kind == "u" and top <= 255:
        return arr.astype(np.uint8)
    out = arr.copy() if arr.dtype.kind == "u" else np.clip(arr, 0, None)  # a signed image: below 0 is 0
    if top > 255:
        np.minimum(out, 65535, out=out)
        out //= 257  # floor(v * 255 / 65535), exactly
    else:
        np.minimum(out, 255, out=out)
    return out.astype(np.uint8)
