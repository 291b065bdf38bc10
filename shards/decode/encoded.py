"""The loader half of device decoding: stored bytes and augmentation records handed over, not pixels.

:class:`EncodedTransform` runs in the loader processes (:mod:`shards.read.datasets` calls it): for each
image slot it reads the stored image's header, draws the slot's :class:`~shards.decode.augment.AugmentParams`
exactly as :class:`~shards.decode.transforms.TrainTransform` does (the same generator, the same draws in the
same order, so the same crop, flip and factors for every (seed, epoch, step, slot)), and hands over
the bytes with the record. What the device path does not decode (anything but an RGB or grayscale JPEG, a
rotated crop, or RandAugment operations) is decoded and augmented right there by the CPU transform and handed over as pixels. A
batch travels as one :class:`EncodedImages`; :mod:`shards.decode.device` is the other half.
"""

from __future__ import annotations

import random
import warnings
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from shards.decode.augment import AugmentParams
from shards.decode.rgb import open_image
from shards.decode.transforms import TrainTransform

DEVICE_MODES = ("RGB", "L")  # JPEG colour modes nvJPEG turns into RGB the way PIL does


@dataclass(frozen=True)
class Encoded:
    """One slot's stored JPEG bytes, its augmentation record and its header's ``(width, height)``."""

    data: bytes
    params: AugmentParams
    size: tuple[int, int]


@dataclass
class EncodedImages:
    """One batch as loader processes hand it over for device decoding.

    ``data`` (uint8) holds the encoded images back to back, image ``j`` at
    ``data[offsets[j]:offsets[j + 1]]``, going to slot ``slots[j]`` with record ``params[j]``,
    ``sizes[j]`` its (height, width) as its header says;
    ``pixels`` (``m × C × S × S``, uint8, or float32 with noise) are the slots ``pixel_slots`` the
    loader decoded itself. ``batch_size`` slots in all, ``size`` the output side S.
    """

    data: Tensor
    offsets: Tensor
    slots: Tensor
    params: list[AugmentParams]
    sizes: Tensor
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
            img = open_image(data)  # the header only; raises like the CPU path on a bad (or too large) one
        p = self.train.draw(*img.size, rng)
        if img.format == "JPEG" and img.mode in DEVICE_MODES and not p.angle and not p.randaugment:
            return Encoded(data, p, img.size)
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
            data=torch.from_numpy(data.copy()),
            offsets=torch.from_numpy(offsets),
            slots=torch.tensor([i for i, _ in enc], dtype=torch.int64),
            params=[e.params for _, e in enc],
            sizes=torch.tensor([(e.size[1], e.size[0]) for _, e in enc], dtype=torch.int64).reshape(-1, 2),
            pixels=torch.from_numpy(pixels),
            pixel_slots=torch.tensor(rest, dtype=torch.int64),
            size=S,
            batch_size=len(images),
        )
