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


_MEAN255 = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1) * 255
_INV_STD255 = 1.0 / (torch.tensor(IMAGENET_STD).view(1, 3, 1, 1) * 255)


def normalize_batch(images: torch.Tensor) -> torch.Tensor:
    """``b × H × W × 3`` uint8 -> contiguous ``b × 3 × H × W`` float32 normalized with the ImageNet mean and std."""
    x = images.permute(0, 3, 1, 2).to(torch.float32, memory_format=torch.contiguous_format)
    return x.sub_(_MEAN255).mul_(_INV_STD255)
