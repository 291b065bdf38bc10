"""Any stored image as 8-bit RGB, the one colour model the transforms work in.

Shards keep each source's bytes as they were (grayscale, palette, CMYK, 16-bit, RGBA...); the conversion
happens here, at decode time, the same way for training, evaluation and the build's checks.
"""

from __future__ import annotations

import numpy as np
from PIL import Image


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
