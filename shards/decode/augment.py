"""Training augmentation as data: a per-image parameter record drawn before any pixel is touched.

:func:`draw_params` turns the source image's size and the image slot's ``random.Random``
into an :class:`AugmentParams` (crop window, flip, rotation, colour-jitter factors, erased
rectangle, noise seed), with torchvision's sampling rules for every option of
:class:`~shards.config.AugmentConfig`. Applying a record to pixels is another step
(:class:`shards.decode.transforms.TrainTransform` on the CPU), so a backend that decodes elsewhere
(e.g. on a GPU) can apply the very same record: the geometry and factors of each image are
a function of (seed, epoch, step, slot) alone, whoever draws them.

The draws come in a fixed order (crop, flip, rotation, jitter, erase, noise, RandAugment), each
only when its option is on, so with the default options the draws are those of a plain
RandomResizedCrop + horizontal flip, and turning RandAugment on leaves every other draw as it was.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from dataclasses import dataclass

from shards.config import AugmentConfig, RandAugment

JITTER_OPS = ("brightness", "contrast", "saturation", "hue")
# torchvision's RandAugment operations, in its order (the draw is an index into this tuple)
RANDAUGMENT_OPS = tuple(
    (
        "identity shear_x shear_y translate_x translate_y rotate brightness color contrast "
        "sharpness posterize solarize autocontrast equalize"
    ).split()
)


@dataclass(frozen=True)
class AugmentParams:
    """What happens to one training image, in the order applied.

    ``box`` is the window (left, top, right, bottom), in source pixels (floats), that is resized
    to the output square; with ``angle`` it is a window of the source rotated by ``angle``
    degrees counter-clockwise about its centre (same size, black outside the source).
    ``flip``: mirror left-right after the resize. ``jitter``: (operation, factor) pairs applied
    in this order; brightness, contrast and saturation factors as in PIL's ``ImageEnhance``,
    hue a shift in [-0.5, 0.5] of the hue circle. ``erase``: (top, left, height, width) of the
    output rectangle set to the mean colour, or None. ``noise_seed``: seed of the Gaussian noise
    field (numpy ``default_rng``), or None for no noise. ``randaugment``: (operation, signed magnitude)
    pairs of :data:`RANDAUGMENT_OPS`, applied in this order after the flip (magnitudes in torchvision's
    units for an ``S × S`` image: shear as a tangent, translation in pixels, rotation in degrees, enhance
    factors minus 1, posterize bits, solarize threshold).
    """

    box: tuple[float, float, float, float]
    flip: bool = False
    angle: float = 0.0
    jitter: tuple[tuple[str, float], ...] = ()
    erase: tuple[int, int, int, int] | None = None
    noise_seed: int | None = None
    randaugment: tuple[tuple[str, float], ...] = ()


def _sides(
    area: float, scale: tuple[float, float], ratio: tuple[float, float], rng: random.Random
) -> Iterator[tuple[int, int]]:
    """torchvision's 10 tries of a rectangle: area share uniform in ``scale``, log aspect uniform in ``log(ratio)``;
    yields (round(sqrt(a·r)), round(sqrt(a/r))), which RandomResizedCrop reads as (w, h) and RandomErasing as (h, w)."""
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target_area = area * rng.uniform(scale[0], scale[1])
        aspect = math.exp(rng.uniform(log_ratio[0], log_ratio[1]))
        yield int(round(math.sqrt(target_area * aspect))), int(round(math.sqrt(target_area / aspect)))


def random_resized_crop_params(
    width: int, height: int, scale: tuple[float, float], ratio: tuple[float, float], rng: random.Random
) -> tuple[int, int, int, int]:
    """(top, left, h, w) exactly as torchvision's ``RandomResizedCrop.get_params``, drawn from ``rng``."""
    for w, h in _sides(width * height, scale, ratio, rng):
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


def resized_frame(resize: int | tuple[int, int] | None, width: int, height: int) -> tuple[int, int]:
    """(width, height) of the image after torchvision's ``Resize(resize)`` (None: unchanged)."""
    if resize is None:
        return width, height
    if isinstance(resize, int):
        if width <= height:
            return resize, int(resize * height / width)
        return int(resize * width / height), resize
    return int(resize[1]), int(resize[0])


def erase_params(
    size: int, scale: tuple[float, float], ratio: tuple[float, float], rng: random.Random
) -> tuple[int, int, int, int] | None:
    """(top, left, h, w) of torchvision's ``RandomErasing.get_params`` on a ``size``² image; None when 10 tries fail."""
    for h, w in _sides(size * size, scale, ratio, rng):
        if h < size and w < size:
            return rng.randint(0, size - h), rng.randint(0, size - w), h, w
    return None


def draw_params(aug: AugmentConfig, width: int, height: int, size: int, rng: random.Random) -> AugmentParams:
    """One image's :class:`AugmentParams` for a ``width × height`` source and a ``size × size`` output."""
    fw, fh = resized_frame(aug.resize, width, height)
    top, left, h, w = random_resized_crop_params(fw, fh, aug.scale, aug.ratio, rng)
    sx, sy = width / fw, height / fh
    box = (left * sx, top * sy, (left + w) * sx, (top + h) * sy)
    flip = aug.flip > 0 and rng.random() < aug.flip
    lo, hi = aug.rotation_range
    angle = rng.uniform(lo, hi) if (lo, hi) != (0.0, 0.0) else 0.0
    cj = aug.color_jitter
    ops = [(name, float(getattr(cj, name))) for name in JITTER_OPS if getattr(cj, name) > 0]
    jitter = tuple(
        (name, rng.uniform(-x, x) if name == "hue" else rng.uniform(max(0.0, 1 - x), 1 + x))
        for name, x in (ops[i] for i in rng.sample(range(len(ops)), len(ops)))
    )
    erase = None
    if aug.erase.p > 0 and rng.random() < aug.erase.p:
        erase = erase_params(size, aug.erase.scale, aug.erase.ratio, rng)
    noise_seed = rng.getrandbits(63) if aug.noise > 0 else None
    randaug = randaugment_ops(aug.randaugment, size, rng) if aug.randaugment.ops else ()
    return AugmentParams(box, flip, angle, jitter, erase, noise_seed, randaug)


def randaugment_magnitude(op: str, level: int, bins: int, size: int) -> tuple[float, bool]:
    """(unsigned magnitude, signed?) of ``op`` at ``level`` of ``bins`` on a ``size``-pixel square image, as
    torchvision's ``RandAugment._augmentation_space`` (in float64 rather than float32)."""
    t = level / (bins - 1)  # torch.linspace(0, x, bins)[level] = x * t
    if op in ("shear_x", "shear_y"):
        return 0.3 * t, True
    if op in ("translate_x", "translate_y"):
        return 150.0 / 331.0 * size * t, True
    if op == "rotate":
        return 30.0 * t, True
    if op in ("brightness", "color", "contrast", "sharpness"):
        return 0.9 * t, True
    if op == "posterize":
        return float(8 - int(round(level / ((bins - 1) / 4)))), False
    if op == "solarize":
        return 255.0 * (1 - t), False
    return 0.0, False  # identity, autocontrast, equalize


def randaugment_ops(cfg: RandAugment, size: int, rng: random.Random) -> tuple[tuple[str, float], ...]:
    """``cfg.ops`` (operation, signed magnitude) pairs: torchvision's ``RandAugment.forward`` draws (an operation
    uniformly, then a sign for the signed ones) from ``rng``."""
    out = []
    for _ in range(cfg.ops):
        op = RANDAUGMENT_OPS[rng.randrange(len(RANDAUGMENT_OPS))]
        magnitude, signed = randaugment_magnitude(op, cfg.magnitude, cfg.bins, size)
        if signed and rng.random() < 0.5:
            magnitude = -magnitude
        out.append((op, magnitude))
    return tuple(out)
