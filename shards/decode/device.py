"""The device half of device decoding: training images decoded and augmented on the worker's device.

The loader processes hand over encoded bytes with each image's augmentation record
(:mod:`shards.decode.encoded`). :class:`DeviceDecoder`, in the training process: the batch's crop plan (PIL's
resampling taps), jitter factors, labels and loader-decoded slots are built on the host and cross
in one non-blocking copy from pinned memory; then, in runs of images of similar crop size bounded
by a pixel budget (:data:`PIXEL_BUDGET`: decoded plus padded crop pixels, so multi-megapixel photos do
not allocate gigabytes at once), one batched ``torchvision.io.decode_jpeg`` (nvJPEG on CUDA) and
each record applied with PIL's arithmetic on tensors (:mod:`shards.decode.pixel_ops`): the crop box
resampled (antialiased bilinear or bicubic, horizontal then vertical, rounded to 8 bits after each pass), the
flip folded into the horizontal weights, colour jitter, grayscale, erasing, normalization, then
Gaussian noise from a generator seeded by the record's noise seed (the same distribution as the
CPU path's numpy field, not the same numbers). Nothing waits for the device (see
:class:`DeviceDecoder`).

Pixels: the device path always decodes at full resolution. The CPU path by default
(``TrainTransform(draft=True)``) decodes a JPEG at 1/2, 1/4 or 1/8 scale (libjpeg's DCT scaling,
PIL's draft mode) when the crop box is at least twice the output side both ways, then resamples
that; neither nvJPEG nor torchvision's decoders scale in the DCT, so the device path does not
reproduce it. For such crops the two paths' pixels differ by resampling detail (a level or two
on average, tens of levels at single sharp edges), not in geometry: the crop, flip and factors
are the same. Where draft does not apply, and against ``TrainTransform(draft=False)`` always, the
device path on the CPU (libjpeg-turbo, as PIL; float64 resampling) gives PIL's pixels but for
rare float32 roundings of the colour-jitter blends; on CUDA (float32 resampling: rare ±1)
nvJPEG's inverse DCT and chroma upsampling differ from libjpeg's by a few levels. Rotation and
RandAugment are not applied on the device (configs refuse ``data.decode=device`` with
``data.augment.rotation`` or ``.randaugment``; a record with an angle or RandAugment operations is decoded
on the CPU).

An encoded image the device cannot decode (a corrupt entropy stream: headers are checked in the
loader, members at read time) takes a decoded image of its batch, with that image's label, and is
counted in :attr:`DeviceDecoder.skipped`.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor
from torchvision.io import ImageReadMode, decode_jpeg

from shards.config import AugmentConfig, DataConfig
from shards.decode.augment import AugmentParams
from shards.decode.encoded import EncodedImages
from shards.decode.pixel_ops import FILTERS, adjust, dense_weights, luma, resample_taps, round8, shift_hue, tap_entries
from shards.decode.transforms import IMAGENET, PixelNorm, normalize_batch

log = logging.getLogger(__name__)

PIXEL_BUDGET = 1 << 25  # decoded + padded crop pixels decoded and resampled together (see DeviceDecoder)


def _crop_bounds(first: np.ndarray, taps: np.ndarray, size: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per image, the source pixels ``[lo, hi)`` that any tap reads."""
    k = taps.shape[2]
    return first.min(1), np.minimum((first + k).max(1), size)


class _Staging:
    """Host arrays gathered for one batch and sent to the device in one copy.

    On CUDA the arrays are packed into one pinned buffer and copied with ``non_blocking=True`` on the
    current stream: a copy from pageable memory (``torch.tensor(list, device=...)``) would make the
    host wait for everything queued on that stream. On the CPU the buffer is the result. Each array
    starts 16-byte aligned, so it is viewed in its own dtype and shape there.
    """

    ALIGN = 16

    def __init__(self) -> None:
        self.parts: list[tuple[int, np.ndarray]] = []
        self.nbytes = 0

    def add(self, a: np.ndarray) -> int:
        """Queue ``a``; its index in :meth:`send`'s list."""
        a = np.ascontiguousarray(a)
        self.parts.append((self.nbytes, a))
        self.nbytes += -(-a.nbytes // self.ALIGN) * self.ALIGN
        return len(self.parts) - 1

    def send(self, device: torch.device) -> list[Tensor]:
        host = torch.empty(max(self.nbytes, self.ALIGN), dtype=torch.uint8, pin_memory=device.type == "cuda")
        buf = host.numpy()
        for start, a in self.parts:
            buf[start : start + a.nbytes] = a.reshape(-1).view(np.uint8)
        dev = host.to(device, non_blocking=True)
        return [
            dev[start : start + a.nbytes].view(torch.from_numpy(a[:0]).dtype).view(a.shape) for start, a in self.parts
        ]


@dataclass
class _Chunk:
    """Host plan of one run of encoded images ``idx`` (positions in the batch's encoded list): crop bounds,
    padded crop size, and the staging indices of its slots, resampling entries and colour-jitter groups."""

    idx: np.ndarray
    slots: int
    x0: np.ndarray
    x1: np.ndarray
    y0: np.ndarray
    y1: np.ndarray
    hc: int
    wc: int
    wx: tuple[int, int]
    wy: tuple[int, int]
    jitter: list[list[tuple[str, int, int]]]  # per position: (operation, image indices, factors)


def _runs(decoded: np.ndarray, hc: np.ndarray, wc: np.ndarray, budget: int) -> list[tuple[int, int]]:
    """Consecutive ``[a, b)`` runs whose decoded pixels plus padded crop buffer (run length × largest crop
    height × largest crop width) stay within ``budget`` pixels; an image over the budget by itself runs alone.
    A run also ends before its padded crops would hold more than twice its crops' own pixels, so the padded
    products cost at most about twice what the crops need (runs are fewer given crops in decreasing area)."""
    runs, a, n = [], 0, len(decoded)
    while a < n:
        b, dec, own, h, w = a + 1, int(decoded[a]), int(hc[a]) * int(wc[a]), int(hc[a]), int(wc[a])
        while b < n:
            d2, own2, h2, w2 = (
                dec + int(decoded[b]),
                own + int(hc[b]) * int(wc[b]),
                max(h, int(hc[b])),
                max(w, int(wc[b])),
            )
            padded = (b + 1 - a) * h2 * w2
            if d2 + padded > budget or padded > 2 * own2:
                break
            b, dec, own, h, w = b + 1, d2, own2, h2, w2
        runs.append((a, b))
        a = b
    return runs


class DeviceDecoder:
    """The device side: :class:`EncodedImages` + labels -> normalized ``b × 3 × S × S`` images (``dtype``,
    channels_last if asked) on ``device`` and the labels (changed only where an image would not decode).

    ``augment`` must be the config the loader drew the records with (grayscale, noise and the
    erase colour are read from it); ``norm`` and ``interpolation`` the loader's too (the erase colour is
    ``norm``'s mean). A batch is decoded and resampled in runs of images (taken in order
    of crop area, so that a run's crops pad to similar sizes) whose decoded pixels plus padded crop buffer
    (images × largest crop height × largest crop width)
    stay within ``pixel_budget`` pixels (default :data:`PIXEL_BUDGET`, 2^25: on a GPU at most about
    0.1 GB of decoded uint8 and 0.4 GB of float32 crops at a time); an image over the budget by itself
    is decoded alone. The runs change memory, not results.

    Nothing here waits for the device: the batch's crop plan, resampling weights, jitter factors,
    labels and CPU-decoded slots cross in one non-blocking copy from pinned memory (on CUDA).
    ``torchvision``'s nvJPEG decode waits on the host for its own stream (the decoding itself), not
    for the caller's streams.
    """

    def __init__(
        self,
        augment: AugmentConfig,
        device: torch.device | str,
        dtype: torch.dtype = torch.float32,
        channels_last: bool = False,
        resample_dtype: torch.dtype | None = None,
        pixel_budget: int = PIXEL_BUDGET,
        norm: PixelNorm = IMAGENET,
        interpolation: str | None = None,
    ):
        self.augment, self.device, self.dtype = augment, torch.device(device), dtype
        self.norm, self.interpolation = norm, interpolation or "bilinear"
        if self.interpolation not in FILTERS:
            raise ValueError(f"DeviceDecoder: interpolation must be one of {', '.join(FILTERS)}, got {interpolation!r}")
        self.memory_format = torch.channels_last if channels_last else torch.contiguous_format
        # float64 resampling is PIL's exactly; GPUs default to float32 (rare ±1, see shards.decode.pixel_ops)
        self.resample_dtype = resample_dtype or (torch.float32 if self.device.type == "cuda" else torch.float64)
        if pixel_budget < 1:
            raise ValueError(f"DeviceDecoder: pixel_budget must be positive, got {pixel_budget}")
        self.pixel_budget = int(pixel_budget)
        self.skipped = 0
        self._noted = 0
        self._decode_stream: torch.cuda.Stream | None = None

    def __call__(self, batch: EncodedImages, labels: Tensor) -> tuple[Tensor, Tensor]:
        dev, S, n = self.device, batch.size, batch.batch_size
        staging = _Staging()
        lab = staging.add(labels.numpy()) if labels.device.type == "cpu" else None
        chunks = self._plan(batch, S, staging)
        pix, pix_slots = staging.add(batch.pixels.numpy()), staging.add(batch.pixel_slots.numpy())
        sent = staging.send(dev)  # the one host-to-device copy of this batch
        labels = sent[lab] if lab is not None else labels
        out, bad = torch.empty((n, 3, S, S), dtype=torch.float32, device=dev), []
        for c in chunks:
            images = self._decode(batch, c.idx)
            bad += [int(batch.slots[j]) for j, im in zip(c.idx, images) if im is None]
            out.index_copy_(0, sent[c.slots], self._augment(images, batch, c, sent, S))
        if batch.pixel_slots.numel():
            out.index_copy_(0, sent[pix_slots], normalize_batch(sent[pix], norm=self.norm))
        if bad:
            labels = self._borrow(out, labels, bad, n)
        return out.to(dtype=self.dtype, memory_format=self.memory_format), labels

    # -- the host plan ----------------------------------------------------------------------------
    def _plan(self, batch: EncodedImages, S: int, staging: _Staging) -> list[_Chunk]:
        """Every host-side number of the batch's resampling and jitter, queued on ``staging``, by run. Runs are
        formed in order of crop area, so each pads its crops to similar sizes (less zero work in the products)."""
        if not batch.params:
            return []
        heights, widths = batch.sizes[:, 0].numpy(), batch.sizes[:, 1].numpy()
        boxes = np.array([p.box for p in batch.params], np.float64)
        flips = np.array([p.flip for p in batch.params], bool)
        fx, tx = resample_taps(widths, boxes[:, 0], boxes[:, 2], S, self.interpolation)
        fy, ty = resample_taps(heights, boxes[:, 1], boxes[:, 3], S, self.interpolation)
        x0, x1 = _crop_bounds(fx, tx, widths)
        y0, y1 = _crop_bounds(fy, ty, heights)
        chunks = []
        order = np.argsort(-(y1 - y0) * (x1 - x0), kind="stable")
        for a, b in _runs((heights * widths)[order], (y1 - y0)[order], (x1 - x0)[order], self.pixel_budget):
            r = order[a:b]
            wc, hc = int((x1[r] - x0[r]).max()), int((y1[r] - y0[r]).max())
            wx = tap_entries(fx[r], tx[r], x0[r], wc, flips[r])
            wy = tap_entries(fy[r], ty[r], y0[r], hc)
            chunks.append(
                _Chunk(
                    r,
                    staging.add(batch.slots.numpy()[r]),
                    x0[r],
                    x1[r],
                    y0[r],
                    y1[r],
                    hc,
                    wc,
                    (staging.add(wx[0]), staging.add(wx[1])),
                    (staging.add(wy[0]), staging.add(wy[1])),
                    self._jitter_plan([batch.params[j] for j in r], staging),
                )
            )
        return chunks

    @staticmethod
    def _jitter_plan(params: list[AugmentParams], staging: _Staging) -> list[list[tuple[str, int, int]]]:
        """Each image's colour-jitter operations in its own drawn order, grouped by (position, operation)."""
        plan = []
        for pos in range(max((len(p.jitter) for p in params), default=0)):
            ops: dict[str, list[tuple[int, float]]] = {}
            for i, p in enumerate(params):
                if pos < len(p.jitter):
                    name, factor = p.jitter[pos]
                    ops.setdefault(name, []).append((i, factor))
            plan.append(
                [
                    (
                        name,
                        staging.add(np.array([i for i, _ in items], np.int64)),
                        staging.add(np.array([f for _, f in items], np.float64)),
                    )
                    for name, items in ops.items()
                ]
            )
        return plan

    # -- decoding ---------------------------------------------------------------------------------
    def _decode(self, batch: EncodedImages, idx: np.ndarray) -> list[Tensor | None]:
        """Encoded images ``idx`` of the batch, ``3 × H × W`` uint8 on the device (None: would not decode)."""
        o = batch.offsets.tolist()
        chunks = [batch.data[o[j] : o[j + 1]] for j in idx]
        if self.device.type != "cuda":
            images = self._decode_all(chunks)
        else:
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
        for j, im in zip(idx, images):
            if im is not None and tuple(im.shape[1:]) != tuple(batch.sizes[j].tolist()):
                raise RuntimeError(
                    f"device decoding: image of slot {int(batch.slots[j])} decoded to {tuple(im.shape[1:])}, "
                    f"its header says {tuple(batch.sizes[j].tolist())}"
                )
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
                log.warning(
                    "skipped an image the device could not decode (%s)",
                    str(e).splitlines()[0] if str(e) else type(e).__name__,
                )
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
                black = torch.zeros((1, 3, out.shape[2], out.shape[3]), device=out.device)
                out[i] = normalize_batch(black, norm=self.norm)[0]
        return labels

    # -- augmentation -----------------------------------------------------------------------------
    def _augment(
        self, images: list[Tensor | None], batch: EncodedImages, c: _Chunk, sent: list[Tensor], S: int
    ) -> Tensor:
        """One run's decoded ``3 × H × W`` uint8 images (None: black, replaced later) -> normalized float32
        ``b × 3 × S × S``, with the plan's tensors already on the device."""
        dev, a, dt = self.device, self.augment, self.resample_dtype
        params = [batch.params[j] for j in c.idx]
        crops = torch.zeros((len(images), 3, c.hc, c.wc), dtype=dt, device=dev)
        for i, im in enumerate(images):  # only the pixels the taps read, at the top-left of the padded buffer
            if im is not None:
                crops[i, :, : c.y1[i] - c.y0[i], : c.x1[i] - c.x0[i]] = im[:, c.y0[i] : c.y1[i], c.x0[i] : c.x1[i]]
        wx = dense_weights(sent[c.wx[0]], sent[c.wx[1]], c.wc, dt)  # flips already folded in: reversed rows
        wy = dense_weights(sent[c.wy[0]], sent[c.wy[1]], c.hc, dt)
        x = round8(torch.matmul(crops, wx.transpose(1, 2).unsqueeze(1)))  # horizontal pass: b × 3 × hc × S
        x = round8(torch.matmul(wy.unsqueeze(1), x)).float()  # vertical pass: b × 3 × S × S, 8-bit values
        for ops in c.jitter:
            for name, idx, f in ops:
                idx = sent[idx]
                x[idx] = shift_hue(x[idx], sent[f]) if name == "hue" else adjust(x[idx], name, sent[f])
        if a.grayscale:
            x = luma(x)
        for i, p in enumerate(params):
            if p.erase is not None:  # python scalars: a fill, no copy from the host
                top, left, h, w = p.erase
                colour = (self.norm.erase_gray,) if a.grayscale else self.norm.erase_rgb
                for ch, v in enumerate(colour):
                    x[i, ch, top : top + h, left : left + w] = float(v)
        x = normalize_batch(x, norm=self.norm)
        noisy = [(i, p.noise_seed) for i, p in enumerate(params) if p.noise_seed is not None]
        for i, seed in noisy:
            g = torch.Generator(device=dev)
            g.manual_seed(int(seed))
            x[i] += a.noise * torch.randn((3, S, S), generator=g, device=dev)
        return x


class DeviceInput:
    """A training stream's batch -> ``(images, labels)`` on ``device``, ready for the model: normalized
    ``b × 3 × S × S`` in ``dtype``, channels_last if asked.

    A CPU-decoded batch (uint8, pinned by the stream on CUDA) is copied without blocking and normalized
    on the device (a quarter of the bytes cross the bus) with ``norm`` (the backbone's mean and std); an
    :class:`EncodedImages` batch goes through a :class:`DeviceDecoder` (``norm``, ``interpolation``).
    Nothing here waits for the device.
    """

    def __init__(
        self,
        augment: AugmentConfig,
        device: torch.device | str,
        dtype: torch.dtype = torch.float32,
        channels_last: bool = False,
        norm: PixelNorm = IMAGENET,
        interpolation: str | None = None,
    ):
        self.device, self.dtype, self.channels_last, self.norm = torch.device(device), dtype, channels_last, norm
        self.decoder = DeviceDecoder(augment, self.device, dtype, channels_last, norm=norm, interpolation=interpolation)

    @classmethod
    def from_config(
        cls,
        data: DataConfig,
        device: torch.device | str,
        dtype: torch.dtype = torch.float32,
        channels_last: bool = False,
    ) -> DeviceInput:
        """The input of a run's ``data`` section: its augmentation, normalization (``data.mean``, ``data.std``) and
        resampling (``data.interpolation``)."""
        norm = PixelNorm.of(data.mean, data.std)
        return cls(data.augment, device, dtype, channels_last, norm=norm, interpolation=data.interpolation)

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
        return normalize_batch(x, self.dtype, norm=self.norm), labels.to(self.device, non_blocking=True)
