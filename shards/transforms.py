"""Decoding and augmentation from stored image bytes, with explicit random generators.

Train: RandomResizedCrop (torchvision's sampling of area and aspect ratio, 10 tries then a
centre crop) + horizontal flip (p = 0.5) + optional colour jitter (brightness, contrast,
saturation factors uniform in [1-j, 1+j], applied in random order, as torchvision's
ColorJitter on PIL images). Eval: shorter side to ``resize``, then a centre ``crop``
(torchvision's Resize + CenterCrop, same rounding). Images in any mode become RGB here.

Both decode JPEGs in PIL's draft mode when the crop allows: the DCT is scaled by 1/2, 1/4
or 1/8 so that the region to crop still has at least the output resolution, then the crop
and the resize happen in one bilinear (antialiased) resample. The result differs from a
full decode by resampling detail only; the crop geometry is the same.

Randomness comes only from the ``random.Random`` passed in (one per image: cheap to seed),
so a batch's augmentation is a function of the seeds it was given, whichever process
decodes it.
"""

from __future__ import annotations

import functools
import io
import math
import random
import warnings

import numpy as np
import torch
from PIL import Image, ImageEnhance

from shards.ingest import to_rgb

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def _open(data: bytes) -> Image.Image:
    return Image.open(io.BytesIO(data))


def _draft(img: Image.Image, box: tuple[float, float, float, float], out_w: int, out_h: int) -> tuple[float, float, float, float]:
    """Ask a JPEG for the smallest DCT scale that keeps ``box`` at >= (out_w, out_h) pixels; return the box in the new scale."""
    if img.format != "JPEG":
        return box
    W, H = img.size
    bw, bh = box[2] - box[0], box[3] - box[1]
    req = (max(1, math.ceil(W * out_w / max(bw, 1e-6))), max(1, math.ceil(H * out_h / max(bh, 1e-6))))
    if req[0] >= W and req[1] >= H:
        return box
    img.draft("RGB", req)
    sx, sy = img.size[0] / W, img.size[1] / H
    return (box[0] * sx, box[1] * sy, box[2] * sx, box[3] * sy)


def random_resized_crop_params(
    width: int, height: int, scale: tuple[float, float], ratio: tuple[float, float], rng: random.Random
) -> tuple[int, int, int, int]:
    """(top, left, h, w) exactly as torchvision's ``RandomResizedCrop.get_params``, drawn from ``rng``."""
    area = width * height
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target_area = area * rng.uniform(scale[0], scale[1])
        aspect = math.exp(rng.uniform(log_ratio[0], log_ratio[1]))
        w = int(round(math.sqrt(target_area * aspect)))
        h = int(round(math.sqrt(target_area / aspect)))
        if 0 < w <= width and 0 < h <= height:
            top = rng.randint(0, height - h)
            left = rng.randint(0, width - w)
            return top, left, h, w
    in_ratio = width / height
    if in_ratio < min(ratio):
        w, h = width, int(round(width / min(ratio)))
    elif in_ratio > max(ratio):
        h, w = height, int(round(height * max(ratio)))
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


class TrainTransform:
    """Stored bytes -> ``size × size × 3`` uint8: random resized crop, flip, optional colour jitter."""

    def __init__(
        self,
        size: int = 224,
        scale: tuple[float, float] = (0.08, 1.0),
        ratio: tuple[float, float] = (3 / 4, 4 / 3),
        flip: bool = True,
        color_jitter: float = 0.0,
        draft: bool = True,
    ):
        self.size, self.scale, self.ratio, self.flip = int(size), tuple(scale), tuple(ratio), flip
        self.jitter, self.draft = float(color_jitter), draft

    def __call__(self, data: bytes, rng: random.Random) -> np.ndarray:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            img = _open(data)
            W, H = img.size
            top, left, h, w = random_resized_crop_params(W, H, self.scale, self.ratio, rng)
            box = (left, top, left + w, top + h)
            if self.draft:
                box = _draft(img, box, self.size, self.size)
            out = to_rgb(img).resize((self.size, self.size), Image.BILINEAR, box=box)
        if self.flip and rng.random() < 0.5:
            out = out.transpose(Image.FLIP_LEFT_RIGHT)
        if self.jitter > 0:
            lo, hi = max(0.0, 1 - self.jitter), 1 + self.jitter
            for k in rng.sample(range(3), 3):
                enhancer = (ImageEnhance.Brightness, ImageEnhance.Contrast, ImageEnhance.Color)[k]
                out = enhancer(out).enhance(rng.uniform(lo, hi))
        return np.asarray(out)


class EvalTransform:
    """Stored bytes -> ``crop × crop × 3`` uint8: shorter side to ``resize``, centre crop (deterministic)."""

    def __init__(self, resize: int = 256, crop: int = 224, draft: bool = True):
        if crop > resize:
            raise ValueError(f"crop {crop} is larger than resize {resize}")
        self.resize, self.crop, self.draft = int(resize), int(crop), draft

    def box(self, W: int, H: int) -> tuple[float, float, float, float]:
        """The centre-crop window in source pixels (torchvision's Resize then CenterCrop rounding)."""
        if W <= H:
            nw, nh = self.resize, int(self.resize * H / W)
        else:
            nh, nw = self.resize, int(self.resize * W / H)
        top, left = int(round((nh - self.crop) / 2.0)), int(round((nw - self.crop) / 2.0))
        sx, sy = nw / W, nh / H
        return (left / sx, top / sy, (left + self.crop) / sx, (top + self.crop) / sy)

    def __call__(self, data: bytes, rng: random.Random | None = None) -> np.ndarray:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            img = _open(data)
            box = self.box(*img.size)
            if self.draft:
                box = _draft(img, box, self.crop, self.crop)
            return np.asarray(to_rgb(img).resize((self.crop, self.crop), Image.BILINEAR, box=box))


@functools.lru_cache(maxsize=16)
def _affine(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, shift) per channel, ``1×3×1×1`` float32 on ``device``: ``(x / 255 - mean) / std = x * scale + shift``."""
    std = torch.tensor(IMAGENET_STD, dtype=torch.float64).view(1, 3, 1, 1)
    mean = torch.tensor(IMAGENET_MEAN, dtype=torch.float64).view(1, 3, 1, 1)
    scale, shift = 1.0 / (255.0 * std), -mean / std
    return scale.to(device=device, dtype=torch.float32), shift.to(device=device, dtype=torch.float32)


def normalize_batch(images: torch.Tensor, dtype: torch.dtype = torch.float32, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """``b × 3 × H × W`` pixel values in 0..255 (uint8 as the stream yields them, or any real dtype) ->
    ``(x / 255 - mean) / std`` with the ImageNet mean and std, float32.

    Runs on the tensor's own device (CPU or an accelerator: normalize after the copy, so a quarter
    of the bytes cross the bus), in float32 whatever the input; ``dtype``
    (e.g. ``torch.bfloat16``) casts the result afterwards. The result keeps the input's memory
    format (a ``channels_last`` batch stays ``channels_last``). ``out`` (float32, same shape and
    device) receives the result instead of a new tensor, e.g. a pinned buffer.
    """
    if images.dim() != 4 or images.shape[1] != 3:
        raise ValueError(f"normalize_batch: expected a b×3×H×W batch, got shape {tuple(images.shape)}")
    if images.is_complex() or images.dtype == torch.bool:
        raise TypeError(f"normalize_batch: pixel values must be real numbers, got {images.dtype}")
    scale, shift = _affine(images.device)
    if images.device.type == "cpu":
        # the CPU's mixed-dtype addcmul is not vectorized: convert first, then one in-place pass (about 2x faster)
        x = out.copy_(images) if out is not None else images.to(torch.float32, copy=True)
        torch.addcmul(shift, x, scale, out=x)
    else:  # uint8 * float32 promotes inside the kernel: one pass, no float32 copy of the input
        x = torch.addcmul(shift, images, scale) if out is None else torch.addcmul(shift, images, scale, out=out)
    return x if dtype == torch.float32 else x.to(dtype)
