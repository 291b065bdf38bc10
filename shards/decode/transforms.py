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

Resampling is Pillow's antialiased ``bilinear`` (the default) or ``bicubic`` (``interpolation``:
the backbone's own, e.g. timm's ViTs and ConvNeXts were trained with bicubic), in training and evaluation alike.

Normalization (:class:`PixelNorm`) is the backbone's mean and std (``data.mean``, ``data.std``; ImageNet's
by default). Outputs are ``S × S × C`` uint8 arrays, except with Gaussian ``noise``: noise of std σ on
*normalized* pixels is σ·255·std_c in pixel units, so the train transform then returns
float32 pixel values (3 channels, unclipped) that :func:`normalize_batch` maps exactly to
``normalized image + N(0, σ²)``. Randomness comes only from the ``random.Random`` passed in
(one per image: cheap to seed), so a batch's augmentation is a function of the seeds it was
given, whichever process decodes it. RandAugment's operations are torchvision's functional ones on the
PIL image (``torchvision.transforms.functional``), with the operations and magnitudes of the record.
"""

from __future__ import annotations

import functools
import math
import random
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torchvision.transforms.functional as TF
from PIL import Image, ImageEnhance
from torchvision.transforms import InterpolationMode

from shards.config import IMAGENET_MEAN, IMAGENET_STD, AugmentConfig
from shards.decode.augment import AugmentParams, draw_params
from shards.decode.rgb import open_image, to_rgb

LUMA = (0.299, 0.587, 0.114)  # PIL's convert("L") weights
RESAMPLE = {"bilinear": Image.BILINEAR, "bicubic": Image.BICUBIC}


@dataclass(frozen=True)
class PixelNorm:
    """``(x / 255 - mean) / std`` per channel: a backbone's input normalization (ImageNet's by default)."""

    mean: tuple[float, float, float] = IMAGENET_MEAN
    std: tuple[float, float, float] = IMAGENET_STD

    @classmethod
    def of(cls, mean: Sequence[float] | None = None, std: Sequence[float] | None = None) -> PixelNorm:
        """From config values; None keeps ImageNet's."""
        return cls(
            tuple(float(v) for v in mean) if mean is not None else IMAGENET_MEAN,
            tuple(float(v) for v in std) if std is not None else IMAGENET_STD,
        )

    @functools.cached_property  # read for every erased image
    def erase_rgb(self) -> np.ndarray:
        """RandomErasing's value 0 after normalization is the mean colour: its nearest 8-bit pixel."""
        return np.array([round(255 * m) for m in self.mean], np.uint8)

    @functools.cached_property  # read for every erased image
    def erase_gray(self) -> np.uint8:
        """The mean colour's 8-bit luminance (the erase value of grayscale images)."""
        return np.uint8(round(255 * sum(w * m for w, m in zip(LUMA, self.mean))))


IMAGENET = PixelNorm()
ERASE_RGB = IMAGENET.erase_rgb  # the erase colour with ImageNet's normalization


def resample_filter(interpolation: str | None) -> int:
    """Pillow's filter for ``data.interpolation`` (None: bilinear); ValueError names an unknown one."""
    if interpolation is None:
        return Image.BILINEAR
    if interpolation not in RESAMPLE:
        raise ValueError(f"interpolation must be one of {', '.join(RESAMPLE)}, got {interpolation!r}")
    return RESAMPLE[interpolation]


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
    img: Image.Image, box: tuple[float, float, float, float], angle: float, size: int, draft: bool, resample: int
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
    return img.transform((size, size), Image.AFFINE, data, resample=resample, fillcolor=(0, 0, 0))


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


def _randaugment(img: Image.Image, op: str, m: float) -> Image.Image:
    """One RandAugment operation as torchvision's ``_apply_op`` does it to a PIL image (nearest, black fill)."""
    nearest = InterpolationMode.NEAREST
    if op in ("shear_x", "shear_y"):
        shear = [math.degrees(math.atan(m)), 0.0] if op == "shear_x" else [0.0, math.degrees(math.atan(m))]
        return TF.affine(img, 0.0, [0, 0], 1.0, shear, interpolation=nearest, center=[0, 0])
    if op in ("translate_x", "translate_y"):
        shift = [int(m), 0] if op == "translate_x" else [0, int(m)]
        return TF.affine(img, 0.0, shift, 1.0, [0.0, 0.0], interpolation=nearest)
    if op == "rotate":
        return TF.rotate(img, m, interpolation=nearest)
    if op == "brightness":
        return TF.adjust_brightness(img, 1.0 + m)
    if op == "color":
        return TF.adjust_saturation(img, 1.0 + m)
    if op == "contrast":
        return TF.adjust_contrast(img, 1.0 + m)
    if op == "sharpness":
        return TF.adjust_sharpness(img, 1.0 + m)
    if op == "posterize":
        return TF.posterize(img, int(m))
    if op == "solarize":
        return TF.solarize(img, m)
    if op == "autocontrast":
        return TF.autocontrast(img)
    if op == "equalize":
        return TF.equalize(img)
    if op == "identity":
        return img
    raise ValueError(f"unknown RandAugment operation {op!r}")


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
    describe the output (uint8, or float32 pixel values when ``augment.noise`` > 0). ``norm`` gives the
    erase colour (the mean) and the noise's pixel scale (the std); ``interpolation`` the resampling.
    """

    def __init__(
        self,
        size: int = 224,
        augment: AugmentConfig | None = None,
        draft: bool = True,
        norm: PixelNorm = IMAGENET,
        interpolation: str | None = None,
    ):
        self.size, self.augment, self.draft = int(size), augment if augment is not None else AugmentConfig(), draft
        self.norm, self.interpolation = norm, interpolation or "bilinear"
        self.resample = resample_filter(self.interpolation)
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
                out = _rotated_crop(img, p.box, p.angle, S, self.draft, self.resample)
            else:
                box = _draft(img, p.box, S, S) if self.draft else p.box
                out = to_rgb(img).resize((S, S), self.resample, box=box)
        if p.flip:
            out = out.transpose(Image.FLIP_LEFT_RIGHT)
        for op, magnitude in p.randaugment:
            out = _randaugment(out, op, magnitude)
        for name, factor in p.jitter:
            out = _JITTER[name](out, factor)
        arr = _channels(out, a.grayscale)
        if p.erase is not None:
            top, left, h, w = p.erase
            arr = arr.copy()
            arr[top : top + h, left : left + w] = self.norm.erase_gray if a.grayscale else self.norm.erase_rgb
        if p.noise_seed is not None:
            std = np.asarray(self.norm.std, np.float32) * np.float32(255 * a.noise)
            noise = np.random.default_rng(p.noise_seed).standard_normal((S, S, 3), dtype=np.float32)
            arr = np.broadcast_to(arr, (S, S, 3)).astype(np.float32) + noise * std
        return arr

    def __call__(self, data: bytes, rng: random.Random) -> np.ndarray:
        img = _open(data)
        return self.apply(img, self.draw(*img.size, rng))


class EvalTransform:
    """Stored bytes -> ``crop × crop × C`` uint8: shorter side to ``resize``, centre crop (deterministic);
    ``grayscale`` as in training (C = 1 with ``grayscale=1``, else 3); ``interpolation`` as in training."""

    def __init__(
        self,
        resize: int = 256,
        crop: int = 224,
        draft: bool = True,
        grayscale: int = 0,
        interpolation: str | None = None,
    ):
        if crop > resize:
            raise ValueError(f"crop {crop} is larger than resize {resize}")
        self.resize, self.crop, self.draft, self.grayscale = int(resize), int(crop), draft, int(grayscale)
        self.interpolation, self.resample = interpolation, resample_filter(interpolation)
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
            return _channels(to_rgb(img).resize((self.crop, self.crop), self.resample, box=box), self.grayscale)


@functools.lru_cache(maxsize=16)
def _affine(device: torch.device, norm: PixelNorm) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, shift) per channel, ``1×3×1×1`` float32 on ``device``: ``(x / 255 - mean) / std = x * scale + shift``."""
    std = torch.tensor(norm.std, dtype=torch.float64).view(1, 3, 1, 1)
    mean = torch.tensor(norm.mean, dtype=torch.float64).view(1, 3, 1, 1)
    scale, shift = 1.0 / (255.0 * std), -mean / std
    return scale.to(device=device, dtype=torch.float32), shift.to(device=device, dtype=torch.float32)


def normalize_batch(
    images: torch.Tensor,
    dtype: torch.dtype = torch.float32,
    *,
    out: torch.Tensor | None = None,
    norm: PixelNorm = IMAGENET,
) -> torch.Tensor:
    """``b × 3 × H × W`` pixel values in 0..255 (uint8 as the stream yields them, or any real dtype) ->
    ``(x / 255 - mean) / std`` with ``norm``'s mean and std (ImageNet's by default), float32, ``b × 3 × H × W``.

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
    scale, shift = _affine(images.device, norm)
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
