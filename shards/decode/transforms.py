"""Decoding and augmentation from stored image bytes, with explicit random generators.

Train: an :class:`~shards.decode.augment.AugmentParams` record is drawn for each image
(:func:`shards.decode.augment.draw_params`: torchvision's RandomResizedCrop, flip, RandomRotation,
ColorJitter, RandomErasing sampling) and then applied to its pixels here. Eval: shorter side
to ``resize``, then a centre ``crop`` (torchvision's Resize + CenterCrop, same rounding).
Images in any mode become RGB here; ``grayscale`` (both) then converts them to luminance
(PIL's ITU-R 601-2 weights, as torchvision's Grayscale) with 1 or 3 channels.

Both decode JPEGs in PIL's draft mode when the crop allows: the DCT is scaled by 1/2, 1/4
or 1/8 so that the region to crop still has at least the output resolution, then the crop
and the resize happen in one bilinear (antialiased) resample. The result differs from a
full decode by resampling detail only; the crop geometry is the same. A rotated crop is an
affine resample (bilinear) after an integer box reduction that leaves at most 2x to shrink.

Outputs are ``S × S × C`` uint8 arrays, except with Gaussian ``noise``: noise of std σ on
*normalized* pixels is σ·255·std_c in pixel units, so the train transform then returns
float32 pixel values (3 channels, unclipped) that :func:`normalize_batch` maps exactly to
``normalized image + N(0, σ²)``. Randomness comes only from the ``random.Random`` passed in
(one per image: cheap to seed), so a batch's augmentation is a function of the seeds it was
given, whichever process decodes it.
"""

from __future__ import annotations

import functools
import math
import random
import warnings

import numpy as np
import torch
from PIL import Image, ImageEnhance

from shards.config import AugmentConfig
from shards.decode.augment import AugmentParams, draw_params
from shards.decode.rgb import open_image, to_rgb

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
LUMA = (0.299, 0.587, 0.114)  # PIL's convert("L") weights
# RandomErasing's value 0 after normalization is the mean colour: its nearest 8-bit pixel (and its luminance)
ERASE_RGB = np.array([round(255 * m) for m in IMAGENET_MEAN], np.uint8)
ERASE_GRAY = np.uint8(round(255 * sum(w * m for w, m in zip(LUMA, IMAGENET_MEAN))))


def _open(data: bytes) -> Image.Image:
    return open_image(data)


def _draft_scale(img: Image.Image, bw: float, bh: float, out_w: int, out_h: int) -> tuple[float, float]:
    """Ask a JPEG for the smallest DCT scale that keeps a ``bw × bh`` region at >= (out_w, out_h) pixels;
    return the factors (x, y) by which source coordinates shrank (1 when nothing changed)."""
    if img.format != "JPEG":
        return 1.0, 1.0
    W, H = img.size
    req = (max(1, math.ceil(W * out_w / max(bw, 1e-6))), max(1, math.ceil(H * out_h / max(bh, 1e-6))))
    if req[0] >= W and req[1] >= H:
        return 1.0, 1.0
    img.draft("RGB", req)
    return img.size[0] / W, img.size[1] / H


def _draft(
    img: Image.Image, box: tuple[float, float, float, float], out_w: int, out_h: int
) -> tuple[float, float, float, float]:
    """:func:`_draft_scale` for ``box``; the box in the new scale."""
    sx, sy = _draft_scale(img, box[2] - box[0], box[3] - box[1], out_w, out_h)
    return (box[0] * sx, box[1] * sy, box[2] * sx, box[3] * sy)


def _rotated_crop(
    img: Image.Image, box: tuple[float, float, float, float], angle: float, size: int, draft: bool
) -> Image.Image:
    """The ``box`` window of ``img`` rotated by ``angle`` degrees (counter-clockwise, about the centre, black outside),
    resized to ``size × size``: one affine resample, as PIL's ``rotate`` maps output points to the source."""
    sx0, sy0 = _draft_scale(img, box[2] - box[0], box[3] - box[1], size, size) if draft else (1.0, 1.0)
    img = to_rgb(img)
    # shrink by an integer box filter first, so the affine resample (no antialiasing) shrinks by less than 2x
    f = max(1, int(min((box[2] - box[0]) * sx0, (box[3] - box[1]) * sy0) / size))
    w1, h1 = img.size
    if f > 1:
        img = img.reduce(f)
    kx, ky = sx0 * img.size[0] / w1, sy0 * img.size[1] / h1  # source coordinates -> this image's
    x0, y0, x1, y1 = box[0] * kx, box[1] * ky, box[2] * kx, box[3] * ky
    cx, cy = img.size[0] / 2, img.size[1] / 2
    a = -math.radians(angle)
    m00, m01, m10, m11 = math.cos(a), math.sin(a), -math.sin(a), math.cos(a)
    ux, vy = (x1 - x0) / size, (y1 - y0) / size  # output pixel -> rotated-frame units
    data = (  # the affine matrix's two rows, kept as rows
        m00 * ux, m01 * vy, m00 * (x0 - cx) + m01 * (y0 - cy) + cx,
        m10 * ux, m11 * vy, m10 * (x0 - cx) + m11 * (y0 - cy) + cy,
    )  # fmt: skip
    return img.transform((size, size), Image.AFFINE, data, resample=Image.BILINEAR, fillcolor=(0, 0, 0))


def _hue(img: Image.Image, shift: float) -> Image.Image:
    """torchvision's PIL ``adjust_hue``: the HSV hue channel moved by ``shift`` of a turn (8-bit, wrapping)."""
    h, s, v = img.convert("HSV").split()
    hue = (np.asarray(h, np.int16) + int(shift * 255)) % 256
    return Image.merge("HSV", (Image.fromarray(hue.astype(np.uint8), "L"), s, v)).convert("RGB")


_JITTER = {
    "brightness": lambda im, f: ImageEnhance.Brightness(im).enhance(f),
    "contrast": lambda im, f: ImageEnhance.Contrast(im).enhance(f),
    "saturation": lambda im, f: ImageEnhance.Color(im).enhance(f),
    "hue": _hue,
}


def _channels(img: Image.Image, grayscale: int) -> np.ndarray:
    """``H × W × C`` uint8: RGB, or luminance with ``grayscale`` (1 or 3) channels."""
    if not grayscale:
        return np.asarray(img)
    gray = np.asarray(img.convert("L"))[:, :, None]
    return gray if grayscale == 1 else np.repeat(gray, 3, axis=2)


class TrainTransform:
    """Stored bytes -> ``size × size × C`` training image: :meth:`draw` a record, then :meth:`apply` it.

    ``augment`` (default: :class:`~shards.config.AugmentConfig`'s defaults, a RandomResizedCrop with
    scale (0.08, 1) and a flip with p = 0.5) says what to draw. :attr:`channels` and :attr:`dtype`
    describe the output (uint8, or float32 pixel values when ``augment.noise`` > 0).
    """

    def __init__(self, size: int = 224, augment: AugmentConfig | None = None, draft: bool = True):
        self.size, self.augment, self.draft = int(size), augment if augment is not None else AugmentConfig(), draft
        a = self.augment
        self.channels = 3 if a.noise > 0 or a.grayscale != 1 else 1
        self.dtype = np.float32 if a.noise > 0 else np.uint8

    def draw(self, width: int, height: int, rng: random.Random) -> AugmentParams:
        """The record of one ``width × height`` source image (see :func:`shards.decode.augment.draw_params`)."""
        return draw_params(self.augment, width, height, self.size, rng)

    def apply(self, img: Image.Image, p: AugmentParams) -> np.ndarray:
        """``img`` (opened, not yet loaded, so JPEG draft decoding can apply) augmented as ``p`` says."""
        S, a = self.size, self.augment
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if p.angle:
                out = _rotated_crop(img, p.box, p.angle, S, self.draft)
            else:
                box = _draft(img, p.box, S, S) if self.draft else p.box
                out = to_rgb(img).resize((S, S), Image.BILINEAR, box=box)
        if p.flip:
            out = out.transpose(Image.FLIP_LEFT_RIGHT)
        for name, factor in p.jitter:
            out = _JITTER[name](out, factor)
        arr = _channels(out, a.grayscale)
        if p.erase is not None:
            top, left, h, w = p.erase
            arr = arr.copy()
            arr[top : top + h, left : left + w] = ERASE_GRAY if a.grayscale else ERASE_RGB
        if p.noise_seed is not None:
            std = np.asarray(IMAGENET_STD, np.float32) * np.float32(255 * a.noise)
            noise = np.random.default_rng(p.noise_seed).standard_normal((S, S, 3), dtype=np.float32)
            arr = np.broadcast_to(arr, (S, S, 3)).astype(np.float32) + noise * std
        return arr

    def __call__(self, data: bytes, rng: random.Random) -> np.ndarray:
        img = _open(data)
        return self.apply(img, self.draw(*img.size, rng))


class EvalTransform:
    """Stored bytes -> ``crop × crop × C`` uint8: shorter side to ``resize``, centre crop (deterministic);
    ``grayscale`` as in training (C = 1 with ``grayscale=1``, else 3)."""

    def __init__(self, resize: int = 256, crop: int = 224, draft: bool = True, grayscale: int = 0):
        if crop > resize:
            raise ValueError(f"crop {crop} is larger than resize {resize}")
        self.resize, self.crop, self.draft, self.grayscale = int(resize), int(crop), draft, int(grayscale)
        self.channels, self.dtype = (1 if self.grayscale == 1 else 3), np.uint8

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
            return _channels(to_rgb(img).resize((self.crop, self.crop), Image.BILINEAR, box=box), self.grayscale)


@functools.lru_cache(maxsize=16)
def _affine(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, shift) per channel, ``1×3×1×1`` float32 on ``device``: ``(x / 255 - mean) / std = x * scale + shift``."""
    std = torch.tensor(IMAGENET_STD, dtype=torch.float64).view(1, 3, 1, 1)
    mean = torch.tensor(IMAGENET_MEAN, dtype=torch.float64).view(1, 3, 1, 1)
    scale, shift = 1.0 / (255.0 * std), -mean / std
    return scale.to(device=device, dtype=torch.float32), shift.to(device=device, dtype=torch.float32)


def normalize_batch(
    images: torch.Tensor, dtype: torch.dtype = torch.float32, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``b × 3 × H × W`` pixel values in 0..255 (uint8 as the stream yields them, or any real dtype) ->
    ``(x / 255 - mean) / std`` with the ImageNet mean and std, float32, ``b × 3 × H × W``.

    A ``b × 1 × H × W`` (grayscale) batch is broadcast to 3 channels first, so it gives what
    torchvision's ``Grayscale(3)`` + ``Normalize`` would. Runs on the tensor's own device (CPU or an
    accelerator: normalize after the copy, so a quarter of the bytes cross the bus), in float32
    whatever the input; ``dtype`` (e.g. ``torch.bfloat16``) casts the result afterwards. The result
    keeps the input's memory format (a ``channels_last`` batch stays ``channels_last``). ``out``
    (float32, ``b × 3 × H × W``, same device) receives the result instead of a new tensor, e.g. a pinned buffer.
    """
    if images.dim() != 4 or images.shape[1] not in (1, 3):
        raise ValueError(
            f"normalize_batch: expected a b×3×H×W (or b×1×H×W grayscale) batch, got shape {tuple(images.shape)}"
        )
    if images.is_complex() or images.dtype == torch.bool:
        raise TypeError(f"normalize_batch: pixel values must be real numbers, got {images.dtype}")
    scale, shift = _affine(images.device)
    if images.device.type == "cpu":
        # the CPU's mixed-dtype addcmul is not vectorized: convert first, then one in-place pass (about 2x faster)
        if out is None:  # empty_like keeps the memory format
            out = (
                torch.empty_like(images, dtype=torch.float32)
                if images.shape[1] == 3
                else images.new_empty((images.shape[0], 3, *images.shape[2:]), dtype=torch.float32)
            )
        x = out.copy_(images)  # broadcasts a grayscale channel
        torch.addcmul(shift, x, scale, out=x)
    else:  # uint8 * float32 promotes inside the kernel: one pass, no float32 copy of the input
        x = torch.addcmul(shift, images, scale) if out is None else torch.addcmul(shift, images, scale, out=out)
    return x if dtype == torch.float32 else x.to(dtype)
