"""PIL's pixel arithmetic on batches of tensors: what :class:`shards.decode.transforms.TrainTransform` does to
one image with PIL, done to a batch on any device with the same rounding.

Images here are float32 tensors holding 8-bit values (integers 0..255), ``b × C × H × W``, so every
step can round exactly where PIL rounds to 8 bits:

* :func:`resample_taps`: PIL's antialiased bilinear or bicubic resampling of a float box (``Image.resize(size,
  BILINEAR or BICUBIC, box=...)``) as per-output-pixel taps, with PIL's 22-bit fixed-point coefficients, computed
  on the host (:func:`tap_entries`) and made into one matrix per axis on the device
  (:func:`dense_weights`); applied as one matrix product per axis, horizontal pass first, each
  rounded to 8 bits as PIL does.
* :func:`blend` (``Image.blend``), :func:`luma` (``convert("L")``), :func:`adjust` (``ImageEnhance``
  brightness, contrast, saturation) and :func:`shift_hue` (8-bit HSV round trip, as
  ``shards.decode.transforms._hue``), each with a factor per image.

Resampling in float64 is exact (every product and sum of 8-bit pixels and 22-bit coefficients is an
integer multiple of 2^-22 well inside float64's 53 bits), so the results are PIL's. In float32 (the
GPU default: float64 products are slow on most GPUs) a sum within about 1e-5 of a rounding boundary
can round the other way: PIL's results but for rare ±1 differences (under 0.5% of the pixels).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

PRECISION_BITS = 22  # PIL's fixed-point coefficients for 8-bit images: 32 - 8 - 2 bits


def _bilinear(t: np.ndarray) -> np.ndarray:
    return np.where(t < 1.0, 1.0 - t, 0.0)


def _bicubic(t: np.ndarray) -> np.ndarray:
    a = -0.5  # PIL's bicubic_filter (Keys' cubic convolution with a = -0.5)
    near = ((a + 2.0) * t - (a + 3.0)) * t * t + 1
    far = (((t - 5) * t + 8) * t - 4) * a
    return np.where(t < 1.0, near, np.where(t < 2.0, far, 0.0))


FILTERS = {"bilinear": (_bilinear, 1.0), "bicubic": (_bicubic, 2.0)}  # PIL's filter function and support


def resample_taps(
    in_size: np.ndarray, lo: np.ndarray, hi: np.ndarray, out: int, interpolation: str = "bilinear"
) -> tuple[np.ndarray, np.ndarray]:
    """PIL's ``precompute_coeffs`` for a bilinear or bicubic resample of ``[lo, hi)`` (source pixels, per image)
    to ``out`` pixels, for a batch: ``(first, taps)`` with ``first`` (``b × out``, int64) the first source pixel
    of each output pixel and ``taps`` (``b × out × K``, float64 multiples of 2^-22, negative ones for bicubic)
    its weights; a tap past the image has weight 0."""
    fn, filter_support = FILTERS[interpolation]
    in_size = np.asarray(in_size, np.int64)[:, None]
    lo = np.asarray(lo, np.float32).astype(np.float64)[:, None]  # PIL takes the box as C floats
    hi = np.asarray(hi, np.float32).astype(np.float64)[:, None]
    scale = (hi - lo) / out
    filterscale = np.maximum(scale, 1.0)
    support = filterscale * filter_support
    k = int(np.ceil(support).max()) * 2 + 1
    center = lo + (np.arange(out) + 0.5) * scale  # b × out
    first = np.maximum(np.trunc(center - support + 0.5).astype(np.int64), 0)
    last = np.minimum(np.trunc(center + support + 0.5).astype(np.int64), in_size)
    x = first[..., None] + np.arange(k)  # b × out × K source pixels
    t = np.abs((x - center[..., None] + 0.5) * (1.0 / filterscale)[..., None])
    w = np.where(x < last[..., None], fn(t), 0.0)
    total = np.zeros_like(center)
    for j in range(k):  # PIL sums in order; keep its rounding
        total = total + w[..., j]
    w = np.divide(w, total[..., None], out=np.zeros_like(w), where=total[..., None] != 0)
    # PIL's normalize_coeffs_8bpc: (int)(±0.5 + w·2^22), i.e. halves rounded away from zero
    return first, np.trunc(w * (1 << PRECISION_BITS) + np.copysign(0.5, w)) / (1 << PRECISION_BITS)


def tap_entries(
    first: np.ndarray, taps: np.ndarray, origin: np.ndarray, width: int, flip: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """The host half of :func:`dense_weights`: each tap of :func:`resample_taps` as (column, weight) in a source
    axis that starts at pixel ``origin`` (per image) and is ``width`` wide, ``b × out × K`` int64 and float64.
    A zero tap, or one past the axis, becomes weight 0 at column 0 (summed there, it changes nothing).
    ``flip`` (bool per image) reverses an image's output pixels: a left-right mirror folded into the weights."""
    b, out, k = taps.shape
    cols = first[..., None] + np.arange(k) - np.asarray(origin, np.int64)[:, None, None]
    keep = (taps != 0) & (cols >= 0) & (cols < width)  # zero taps may point past the crop
    cols, weights = np.where(keep, cols, 0), np.where(keep, taps, 0.0)
    if flip is not None and np.any(flip):
        cols[flip], weights[flip] = cols[flip, ::-1], weights[flip, ::-1]
    return cols, weights


def dense_weights(cols: Tensor, weights: Tensor, width: int, dtype: torch.dtype = torch.float32) -> Tensor:
    """``b × out × width`` resampling matrices (``dtype``) on the device of ``cols`` and ``weights`` (from
    :func:`tap_entries`, already there: this launches kernels only, it copies nothing from the host)."""
    b, out, _ = cols.shape
    m = torch.zeros(b, out, width, dtype=dtype, device=cols.device)
    # summing zero-weight taps into column 0 changes nothing; each real column is hit once
    return m.scatter_add_(2, cols, weights.to(dtype))


def round8(x: Tensor) -> Tensor:
    """PIL's ``clip8`` of a resampled value: round half up, clamp to 0..255 (in place)."""
    return x.add_(0.5).floor_().clamp_(0, 255)


def blend(a: Tensor, b: Tensor, alpha: Tensor) -> Tensor:
    """``Image.blend(a, b, alpha)`` with one ``alpha`` per image: ``a + alpha·(b - a)``, clamped to 0..255 and
    truncated (PIL's cast to 8 bits)."""
    f = alpha.to(torch.float32).view(-1, *([1] * (b.dim() - 1)))
    return (a + f * (b - a)).clamp_(0, 255).trunc_()


def luma(x: Tensor) -> Tensor:
    """``convert("L")`` of ``b × 3 × H × W`` 8-bit RGB: ITU-R 601-2 in PIL's 16-bit fixed point, ``b × 1 × H × W``."""
    r, g, b = x[:, 0:1], x[:, 1:2], x[:, 2:3]
    # every partial sum is an integer below 2^24, exact in float32
    return torch.floor((r * 19595 + g * 38470 + b * 7471 + 32768) / 65536)


def adjust(x: Tensor, op: str, factor: Tensor) -> Tensor:
    """``ImageEnhance.Brightness`` / ``Contrast`` / ``Color`` (saturation) ``.enhance(factor)`` of 8-bit RGB."""
    if op == "brightness":
        return blend(torch.zeros_like(x), x, factor)
    gray = luma(x)
    if op == "contrast":  # a flat image at the mean luminance, rounded as ImageStat + int(mean + 0.5)
        mean = torch.floor(gray.double().mean(dim=(1, 2, 3), keepdim=True) + 0.5).float()
        return blend(mean.expand_as(x), x, factor)
    if op == "saturation":
        return blend(gray.expand_as(x), x, factor)
    raise ValueError(f"unknown adjustment {op!r}")


def shift_hue(x: Tensor, shift: Tensor) -> Tensor:
    """PIL's 8-bit HSV round trip with the hue channel moved by ``int(shift·255)`` (mod 256), as
    ``shards.decode.transforms._hue``: ``convert("HSV")``, shift, ``convert("RGB")``, one shift per image."""
    f32, f64 = torch.float32, torch.float64
    r, g, b = x[:, 0], x[:, 1], x[:, 2]
    maxc, minc = torch.maximum(r, torch.maximum(g, b)), torch.minimum(r, torch.minimum(g, b))
    gray = maxc == minc
    cr = torch.where(gray, torch.ones_like(maxc), maxc - minc)
    sat = (cr / torch.where(maxc == 0, torch.ones_like(maxc), maxc)).to(f32)
    rc, gc, bc = (maxc - r) / cr, (maxc - g) / cr, (maxc - b) / cr
    h = torch.where(r == maxc, bc - gc, torch.where(g == maxc, 2.0 + rc.double() - bc, 4.0 + gc.double() - rc).to(f32))
    h = torch.fmod(h.double() / 6.0 + 1.0, 1.0).to(f32)
    hue = torch.where(gray, 0.0, torch.trunc(h.double() * 255.0).clamp(0, 255)).to(f64)
    s8 = torch.where(gray, 0.0, torch.trunc(sat.double() * 255.0).clamp(0, 255)).to(f64)
    step = torch.trunc(shift.double() * 255).view(-1, 1, 1)  # Python's int(): toward zero
    hue = torch.remainder(hue + step, 256)
    # back to RGB (PIL's hsv2rgb): C floats where PIL keeps floats, doubles where it computes in double
    v = maxc.double()
    i = torch.floor((hue.to(f32).double() * 6.0) / 255.0)
    frac = (hue.to(f32).double() * 6.0 / 255.0 - i).to(f32)
    fs = (s8.to(f32).double() / 255.0).to(f32)
    p = torch.floor(v * (1.0 - fs.double()) + 0.5)
    q = torch.floor(v * (1.0 - (fs * frac).double()) + 0.5)
    t = torch.floor(v * (1.0 - fs.double() * (1.0 - frac.double())) + 0.5)
    p, q, t = (c.clamp(0, 255) for c in (p, q, t))
    sector = torch.remainder(i, 6)
    table = ((v, t, p), (q, v, p), (p, v, t), (p, q, v), (t, p, v), (v, p, q))
    out = []
    for c in range(3):
        ch = v.clone()
        for k, row in enumerate(table):
            ch = torch.where(sector == k, row[c], ch)
        out.append(torch.where(s8 == 0, v, ch))
    return torch.stack(out, 1).to(f32)
