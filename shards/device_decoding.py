"""Training images decoded and augmented on the device, from encoded bytes that loader processes hand over.

Loader side (:class:`EncodedTransform`, run by :mod:`shards.batch_decoding` in the loader processes):
for each image slot it reads the stored image's header, draws the slot's
:class:`~shards.augment.AugmentParams` exactly as :class:`~shards.transforms.TrainTransform` does
(the same generator, the same draws in the same order, so the same crop, flip and factors for every
(seed, epoch, rank, batch, slot)), and hands over the bytes with the record. What the device path
does not decode (anything but an RGB or grayscale JPEG, or a rotated crop) is decoded and augmented
right there by the CPU transform and handed over as pixels. A batch travels as one
:class:`EncodedImages`.

Device side (:class:`DeviceDecoder`, in the training process): one batched
``torchvision.io.decode_jpeg`` (nvJPEG on CUDA), then each record applied with PIL's arithmetic on
tensors (:mod:`shards.pixel_ops`): the crop box resampled (antialiased bilinear, horizontal then
vertical, rounded to 8 bits after each pass), the flip folded into the horizontal weights, colour
jitter, grayscale, erasing, normalization, then Gaussian noise from a generator seeded by the
record's noise seed (the same distribution as the CPU path's numpy field, not the same numbers).

Pixels: the device path always decodes at full resolution (no JPEG draft scaling), so it compares
with ``TrainTransform(draft=False)``: on the CPU (libjpeg-turbo, as PIL; float64 resampling) equal
but for rare float32 roundings of the colour-jitter blends; on CUDA (float32 resampling: rare ±1)
nvJPEG's inverse DCT and chroma upsampling differ from libjpeg's by a few levels. Rotation is not applied on the device (configs refuse
``data.decode=device`` with ``data.augment.rotation``; a record with an angle is decoded on the CPU).

An encoded image the device cannot decode (a corrupt entropy stream: headers are checked in the
loader, members at read time) takes a decoded image of its batch, with that image's label, and is
counted in :attr:`DeviceDecoder.skipped`.
"""

from __future__ import annotations

import io
import logging
import random
import warnings
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image
from torch import Tensor
from torchvision.io import ImageReadMode, decode_jpeg

from dmltrain.config import AugmentConfig
from shards.augment import AugmentParams
from shards.pixel_ops import adjust, bilinear_taps, dense_weights, luma, round8, shift_hue
from shards.transforms import ERASE_GRAY, ERASE_RGB, TrainTransform, normalize_batch

log = logging.getLogger(__name__)

DEVICE_MODES = ("RGB", "L")  # JPEG colour modes nvJPEG turns into RGB the way PIL does
CHUNK_IMAGES = 32  # images resampled together: bounds the padded buffer of full-resolution crops


@dataclass(frozen=True)
class Encoded:
    """One slot's stored JPEG bytes and its augmentation record."""

    data: bytes
    params: AugmentParams


@dataclass
class EncodedImages:
    """One batch as loader processes hand it over for device decoding.

    ``data`` (uint8) holds the encoded images back to back, image ``j`` at
    ``data[offsets[j]:offsets[j + 1]]``, going to slot ``slots[j]`` with record ``params[j]``;
    ``pixels`` (``m × C × S × S``, uint8, or float32 with noise) are the slots ``pixel_slots`` the
    loader decoded itself. ``batch_size`` slots in all, ``size`` the output side S.
    """

    data: Tensor
    offsets: Tensor
    slots: Tensor
    params: list[AugmentParams]
    pixels: Tensor
    pixel_slots: Tensor
    size: int
    batch_size: int

    def __len__(self) -> int:
        return self.batch_size


class EncodedTransform:
    """The loader side: stored bytes + slot generator -> :class:`Encoded` (for the device) or the CPU
    transform's pixels (``H × W × C`` array) for what the device path does not decode."""

    def __init__(self, train: TrainTransform):
        self.train = train
        self.size, self.channels, self.dtype = train.size, train.channels, train.dtype

    def __call__(self, data: bytes, rng: random.Random) -> Encoded | np.ndarray:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            img = Image.open(io.BytesIO(data))  # the header only; raises like the CPU path on a bad one
        p = self.train.draw(*img.size, rng)
        if img.format == "JPEG" and img.mode in DEVICE_MODES and not p.angle:
            return Encoded(data, p)
        return self.train.apply(img, p)

    def collate(self, images: list[Encoded | np.ndarray | None]) -> EncodedImages:
        """One batch's slots as an :class:`EncodedImages` (a slot left None becomes black pixels)."""
        enc = [(i, im) for i, im in enumerate(images) if isinstance(im, Encoded)]
        rest = [i for i, im in enumerate(images) if not isinstance(im, Encoded)]
        S, C = self.size, self.channels
        pixels = np.zeros((len(rest), C, S, S), self.dtype)
        for j, i in enumerate(rest):
            if images[i] is not None:
                pixels[j] = images[i].transpose(2, 0, 1)
        lengths = [len(e.data) for _, e in enc]
        offsets = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int64)
        data = np.frombuffer(b"".join(e.data for _, e in enc), np.uint8) if enc else np.zeros(0, np.uint8)
        return EncodedImages(
            data=torch.from_numpy(data.copy()), offsets=torch.from_numpy(offsets),
            slots=torch.tensor([i for i, _ in enc], dtype=torch.int64), params=[e.params for _, e in enc],
            pixels=torch.from_numpy(pixels), pixel_slots=torch.tensor(rest, dtype=torch.int64), size=S, batch_size=len(images),
        )


def resolve_decode(setting: str, device: torch.device | str, augment: AugmentConfig) -> str:
    """``data.decode`` for a worker on ``device``: ``cpu`` or ``device`` as given; ``auto`` is ``device`` on a
    CUDA device unless the augmentation rotates (the device path does not), else ``cpu``."""
    if setting in ("cpu", "device"):
        return setting
    if setting != "auto":
        raise ValueError(f"data.decode: unknown setting {setting!r} (auto, cpu or device)")
    rotates = augment.rotation_range != (0.0, 0.0)
    return "device" if torch.device(device).type == "cuda" and not rotates else "cpu"


def _crop_bounds(first: np.ndarray, taps: np.ndarray, size: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per image, the source pixels ``[lo, hi)`` that any tap reads."""
    k = taps.shape[2]
    return first.min(1), np.minimum((first + k).max(1), size)


class DeviceDecoder:
    """The device side: :class:`EncodedImages` + labels -> normalized ``b × 3 × S × S`` images (``dtype``,
    channels_last if asked) on ``device`` and the labels (changed only where an image would not decode).

    ``augment`` must be the config the loader drew the records with (grayscale, noise and the
    erase colour are read from it).
    """

    def __init__(
        self, augment: AugmentConfig, device: torch.device | str, dtype: torch.dtype = torch.float32, channels_last: bool = False,
        resample_dtype: torch.dtype | None = None,
    ):
        self.augment, self.device, self.dtype = augment, torch.device(device), dtype
        self.memory_format = torch.channels_last if channels_last else torch.contiguous_format
        # float64 resampling is PIL's exactly; GPUs default to float32 (rare ±1, see shards.pixel_ops)
        self.resample_dtype = resample_dtype or (torch.float32 if self.device.type == "cuda" else torch.float64)
        self.skipped = 0
        self._noted = 0
        self._decode_stream: torch.cuda.Stream | None = None

    def __call__(self, batch: EncodedImages, labels: Tensor) -> tuple[Tensor, Tensor]:
        dev, S, n = self.device, batch.size, batch.batch_size
        labels = labels.to(dev, non_blocking=True)
        out = torch.empty((n, 3, S, S), dtype=torch.float32, device=dev)
        decoded = self._decode(batch)
        good = [j for j, im in enumerate(decoded) if im is not None]
        if good:
            x = torch.cat([
                self._augment([decoded[j] for j in part], [batch.params[j] for j in part], S)
                for part in (good[i : i + CHUNK_IMAGES] for i in range(0, len(good), CHUNK_IMAGES))
            ])
            if len(good) == n:  # every slot encoded and decoded, in slot order: no scatter
                out = x
            else:
                out[batch.slots[good].to(dev, non_blocking=True)] = x
        if batch.pixel_slots.numel():
            out[batch.pixel_slots.to(dev, non_blocking=True)] = normalize_batch(batch.pixels.to(dev, non_blocking=True))
        bad = [int(batch.slots[j]) for j, im in enumerate(decoded) if im is None]
        if bad:
            labels = self._borrow(out, labels, bad, n)
        return out.to(dtype=self.dtype, memory_format=self.memory_format), labels

    # -- decoding ---------------------------------------------------------------------------------
    def _decode(self, batch: EncodedImages) -> list[Tensor | None]:
        o = batch.offsets.tolist()
        chunks = [batch.data[o[j] : o[j + 1]] for j in range(len(o) - 1)]
        if not chunks:
            return []
        if self.device.type != "cuda":
            return self._decode_all(chunks)
        # nvJPEG writes from a stream of its own into tensors allocated on the current stream. Allocated on
        # the current (prefetch) stream they could reuse memory whose last reads there are still queued, so
        # they come from a stream that runs nothing, and are marked as used by the current one.
        current = torch.cuda.current_stream(self.device)
        if self._decode_stream is None:
            self._decode_stream = torch.cuda.Stream(self.device)
        with torch.cuda.stream(self._decode_stream):
            images = self._decode_all(chunks)
        current.wait_stream(self._decode_stream)
        for im in images:
            if im is not None:
                im.record_stream(current)
        return images

    def _decode_all(self, chunks: list[Tensor]) -> list[Tensor | None]:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torchvision's notice that its decoders move to TorchCodec
            try:
                return list(decode_jpeg(chunks, mode=ImageReadMode.RGB, device=self.device))
            except RuntimeError:  # the batched call fails as a whole: find the culprits one by one
                return [self._decode_one(c) for c in chunks]

    def _decode_one(self, chunk: Tensor) -> Tensor | None:
        try:
            return decode_jpeg(chunk, mode=ImageReadMode.RGB, device=self.device)
        except RuntimeError as e:
            if self._noted < 20:
                log.warning("skipped an image the device could not decode (%s)", str(e).splitlines()[0] if str(e) else type(e).__name__)
            self._noted += 1
            return None

    def _borrow(self, out: Tensor, labels: Tensor, bad: list[int], n: int) -> Tensor:
        """Fill undecodable slots with decoded images of the batch and their labels (black if none)."""
        self.skipped += len(bad)
        donors = [i for i in range(n) if i not in set(bad)]
        labels = labels.clone()
        for k, i in enumerate(bad):
            if donors:
                j = donors[k % len(donors)]
                out[i], labels[i] = out[j], labels[j]
            else:
                out[i] = normalize_batch(torch.zeros((1, 3, out.shape[2], out.shape[3]), device=out.device))[0]
        return labels

    # -- augmentation -----------------------------------------------------------------------------
    def _augment(self, images: list[Tensor], params: list[AugmentParams], S: int) -> Tensor:
        """Decoded ``3 × H × W`` uint8 images and their records -> normalized float32 ``b × 3 × S × S``."""
        dev, a = self.device, self.augment
        heights = np.array([im.shape[1] for im in images])
        widths = np.array([im.shape[2] for im in images])
        boxes = np.array([p.box for p in params], np.float64)
        fx, tx = bilinear_taps(widths, boxes[:, 0], boxes[:, 2], S)
        fy, ty = bilinear_taps(heights, boxes[:, 1], boxes[:, 3], S)
        x0, x1 = _crop_bounds(fx, tx, widths)
        y0, y1 = _crop_bounds(fy, ty, heights)
        wc, hc = int((x1 - x0).max()), int((y1 - y0).max())
        dt = self.resample_dtype
        crops = torch.zeros((len(images), 3, hc, wc), dtype=dt, device=dev)
        for i, im in enumerate(images):  # only the pixels the taps read, at the top-left of the padded buffer
            crops[i, :, : y1[i] - y0[i], : x1[i] - x0[i]] = im[:, y0[i] : y1[i], x0[i] : x1[i]]
        wx = dense_weights(fx, tx, x0, wc, dev, dt)
        flips = [i for i, p in enumerate(params) if p.flip]
        if flips:  # a left-right mirror of the output is a reversal of the horizontal weights' rows
            idx = torch.tensor(flips, device=dev)
            wx[idx] = wx[idx].flip(1)
        wy = dense_weights(fy, ty, y0, hc, dev, dt)
        x = round8(torch.matmul(crops, wx.transpose(1, 2).unsqueeze(1)))  # horizontal pass: b × 3 × hc × S
        x = round8(torch.matmul(wy.unsqueeze(1), x)).float()  # vertical pass: b × 3 × S × S, 8-bit values
        x = self._jitter(x, params)
        if a.grayscale:
            x = luma(x)
        for i, p in enumerate(params):
            if p.erase is not None:
                top, left, h, w = p.erase
                value = torch.tensor(float(ERASE_GRAY) if a.grayscale else ERASE_RGB.astype(np.float32), device=dev)
                x[i, :, top : top + h, left : left + w] = value.view(-1, 1, 1)
        x = normalize_batch(x)
        noisy = [(i, p.noise_seed) for i, p in enumerate(params) if p.noise_seed is not None]
        for i, seed in noisy:
            g = torch.Generator(device=dev)
            g.manual_seed(int(seed))
            x[i] += a.noise * torch.randn((3, S, S), generator=g, device=dev)
        return x

    def _jitter(self, x: Tensor, params: list[AugmentParams]) -> Tensor:
        """Each image's colour-jitter operations in its own drawn order, batched by (position, operation)."""
        depth = max((len(p.jitter) for p in params), default=0)
        for pos in range(depth):
            ops: dict[str, list[tuple[int, float]]] = {}
            for i, p in enumerate(params):
                if pos < len(p.jitter):
                    name, factor = p.jitter[pos]
                    ops.setdefault(name, []).append((i, factor))
            for name, items in ops.items():
                idx = torch.tensor([i for i, _ in items], device=x.device)
                f = torch.tensor([v for _, v in items], dtype=torch.float64, device=x.device)
                x[idx] = shift_hue(x[idx], f) if name == "hue" else adjust(x[idx], name, f)
        return x


class DeviceInput:
    """A training stream's batch -> ``(images, labels)`` on ``device``, ready for the model: normalized
    ``b × 3 × S × S`` in ``dtype``, channels_last if asked.

    A CPU-decoded batch (uint8, pinned by the stream on CUDA) is copied without blocking and normalized
    on the device (a quarter of the bytes cross the bus); an :class:`EncodedImages` batch goes through
    a :class:`DeviceDecoder`. Nothing here waits for the device.
    """

    def __init__(self, augment: AugmentConfig, device: torch.device | str, dtype: torch.dtype = torch.float32, channels_last: bool = False):
        self.device, self.dtype, self.channels_last = torch.device(device), dtype, channels_last
        self.decoder = DeviceDecoder(augment, self.device, dtype, channels_last)

    @property
    def skipped(self) -> int:
        """Images that did not decode on the device (each replaced by another image of its batch)."""
        return self.decoder.skipped

    def __call__(self, images: Tensor | EncodedImages, labels: Tensor) -> tuple[Tensor, Tensor]:
        if isinstance(images, EncodedImages):
            return self.decoder(images, labels)
        x = images.to(self.device, non_blocking=True)
        if self.channels_last:  # on the uint8 batch: a quarter of the bytes; normalize_batch keeps the format
            x = x.contiguous(memory_format=torch.channels_last)
        return normalize_batch(x, self.dtype), labels.to(self.device, non_blocking=True)
