"""Device decoding: the loader hands over JPEG bytes with the records the CPU path would draw, and the device
path (run here on CPU tensors) turns them into the CPU path's pixels within decoder rounding.

Tolerance against ``TrainTransform(draft=False)`` (the CPU path without JPEG draft scaling; on the CPU both
decode with libjpeg-turbo, identically). The device path resamples as Pillow's classic algorithm does
(horizontal pass first, 22-bit coefficients, 8-bit intermediate), exactly; the installed Pillow runs the
vertical pass first for some shapes (tall images), so its intermediate rounds elsewhere: pixels within 1
level, mean |Δ| under 0.2 level, most pixels identical. Colour jitter carries such a ±1 on: scaled by a
brightness, contrast or saturation factor (at most 5 levels) or through the 8-bit HSV round trip of a hue
shift (at most 14 levels), at rare pixels.

The default CPU path (``draft=True``) decodes a JPEG at 1/2, 1/4 or 1/8 scale when the crop box is at least
twice the output side both ways; the device path never does. Where draft cannot apply the two are compared
directly (:func:`test_device_pixels_match_the_default_cpu_path_without_draft`).
"""

from __future__ import annotations

import dataclasses
import io
import random

import numpy as np
import pytest
import torch
from dataset_fixtures import class_image
from PIL import Image, ImageEnhance
from shard_fixtures import IMG, K, P, make_shards, stream

from dmltrain.config import load_config
from dmltrain.errors import ConfigError
from shards.config import AugmentConfig, resolve_decode
from shards.decode.device import DeviceDecoder, DeviceInput, _runs
from shards.decode.encoded import Encoded, EncodedImages, EncodedTransform
from shards.decode.pixel_ops import adjust, blend, luma, shift_hue
from shards.decode.transforms import IMAGENET_STD, PixelNorm, TrainTransform, _hue, normalize_batch

pytestmark = pytest.mark.usefixtures("one_torch_thread")

S = 32
CONFIGS = {
    "default": AugmentConfig(),
    "small crops": AugmentConfig(scale=(0.02, 0.3), ratio=(0.5, 2.0)),
    "resize frame": AugmentConfig(resize=[64, 64], scale=(0.5, 1.0)),
    "jitter": AugmentConfig(color_jitter=[0.4, 0.4, 0.4, 0.1]),
    "gray + erase": AugmentConfig(grayscale=3, erase=0.7),
    "one channel + jitter": AugmentConfig(grayscale=1, color_jitter=0.3),
}


def _jpeg(key: int, size: tuple[int, int], mode: str = "RGB") -> bytes:
    buf = io.BytesIO()
    img = class_image(key, 1, size)
    (img.convert("L") if mode == "L" else img).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


IMAGES = [_jpeg(k, (60 + 17 * k, 45 + 11 * k), mode="L" if k == 3 else "RGB") for k in range(10)] + [
    _jpeg(10 + k, size)
    for k, size in enumerate([(45, 80), (50, 97), (70, 120), (33, 61)])  # taller than wide
]


def _device_batch(aug: AugmentConfig, images=IMAGES) -> tuple[EncodedImages, list]:
    enc = EncodedTransform(TrainTransform(S, aug))
    items = [enc(data, random.Random(100 + i)) for i, data in enumerate(images)]
    return enc.collate(items), items


def test_loader_draws_the_cpu_records():
    """The same record (crop box, flip, jitter order and factors, erase, noise seed) as the CPU transform,
    and the slot generator left in the same state, for every image; the bytes handed over unchanged."""
    flips = 0
    for aug in [*CONFIGS.values(), AugmentConfig(noise=0.1, erase=0.5, color_jitter=[0.2, 0.2, 0.2, 0.05])]:
        cpu, enc = TrainTransform(S, aug), EncodedTransform(TrainTransform(S, aug))
        for i, data in enumerate(IMAGES):
            r1, r2 = random.Random(i), random.Random(i)
            item = enc(data, r1)
            assert isinstance(item, Encoded) and item.data == data
            assert item.params == cpu.draw(*Image.open(io.BytesIO(data)).size, r2)
            assert r1.random() == r2.random()
            flips += item.params.flip
    assert 0 < flips < 7 * len(IMAGES)  # both sides of the flip drawn


@pytest.mark.parametrize("name", list(CONFIGS))
def test_device_pixels_match_the_cpu_path(name):
    aug = CONFIGS[name]
    batch, _ = _device_batch(aug)
    assert batch.slots.tolist() == list(range(len(IMAGES))) and batch.pixel_slots.numel() == 0
    labels = torch.arange(len(IMAGES))
    got, got_labels = DeviceDecoder(aug, "cpu")(batch, labels)
    cpu = TrainTransform(S, aug, draft=False)
    ref = np.stack([cpu(data, random.Random(100 + i)) for i, data in enumerate(IMAGES)]).transpose(0, 3, 1, 2)
    want = normalize_batch(torch.from_numpy(np.ascontiguousarray(ref)))
    assert got.shape == (len(IMAGES), 3, S, S) and got.dtype == torch.float32 and torch.equal(got_labels, labels)
    levels = (got - want).abs() * (255 * torch.tensor(IMAGENET_STD).view(1, 3, 1, 1))  # back to 8-bit levels
    jitter = aug.color_jitter
    worst = 14.01 if jitter.hue else 5.01 if jitter.brightness + jitter.contrast + jitter.saturation else 1.01
    assert levels.max() <= worst and levels.mean() < 0.2 and (levels < 0.5).float().mean() > 0.8, (
        name,
        float(levels.max()),
    )
    wide = [i for i, data in enumerate(IMAGES) if np.subtract(*Image.open(io.BytesIO(data)).size) > 0]
    assert (levels[wide] < 0.5).float().mean() > 0.99  # the same pass order as the reference: (nearly) exact


def test_device_bicubic_and_the_backbones_normalization_match_the_cpu_path():
    """A timm ViT's input (bicubic resampling, mean and std 0.5): Pillow's bicubic coefficients (negative lobes,
    halves rounded away from zero) on the device give the CPU path's pixels as the bilinear ones do; erasing fills
    with that normalization's mean colour."""
    aug, norm = AugmentConfig(scale=(0.05, 1.0), erase=0.5), PixelNorm((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))
    enc = EncodedTransform(TrainTransform(S, aug, norm=norm, interpolation="bicubic"))
    batch = enc.collate([enc(data, random.Random(100 + i)) for i, data in enumerate(IMAGES)])
    got, _ = DeviceDecoder(aug, "cpu", norm=norm, interpolation="bicubic")(batch, torch.arange(len(IMAGES)))
    cpu = TrainTransform(S, aug, draft=False, norm=norm, interpolation="bicubic")
    ref = np.stack([cpu(data, random.Random(100 + i)) for i, data in enumerate(IMAGES)]).transpose(0, 3, 1, 2)
    levels = (got - normalize_batch(torch.from_numpy(np.ascontiguousarray(ref)), norm=norm)).abs() * (255 * 0.5)
    assert levels.max() <= 1.01 and levels.mean() < 0.2, float(levels.max())
    wide = [i for i, data in enumerate(IMAGES) if np.subtract(*Image.open(io.BytesIO(data)).size) > 0]
    assert (levels[wide] < 0.5).float().mean() > 0.99
    bilinear, _ = DeviceDecoder(aug, "cpu", norm=norm)(batch, torch.arange(len(IMAGES)))
    assert (bilinear - got).abs().max() > 0.05  # the filter matters
    assert any(p.erase is not None for p in batch.params)


def _levels(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """|Δ| of normalized images in 8-bit levels."""
    return (got - want).abs() * (255 * torch.tensor(IMAGENET_STD).view(1, 3, 1, 1))


@pytest.mark.parametrize("name", ["default", "gray + erase"])
def test_device_pixels_match_the_default_cpu_path_without_draft(name):
    """Against the CPU path as it runs by default (``draft=True``): where the crop box is narrower or lower than
    twice the output side, draft scaling cannot apply and the pixels are the same (wide images exactly, tall ones
    within the pass-order ±1 of the module docstring); where it applies they differ by more (stated in
    data.decode's description and docs/how-to/training.md)."""
    aug = CONFIGS[name]
    batch, items = _device_batch(aug)
    got, _ = DeviceDecoder(aug, "cpu")(batch, torch.arange(len(IMAGES)))
    cpu = TrainTransform(S, aug)
    assert cpu.draft
    ref = np.stack([cpu(data, random.Random(100 + i)) for i, data in enumerate(IMAGES)]).transpose(0, 3, 1, 2)
    levels = _levels(got, normalize_batch(torch.from_numpy(np.ascontiguousarray(ref))))
    sides = [(it.params.box[2] - it.params.box[0], it.params.box[3] - it.params.box[1]) for it in items]
    no_draft = [i for i, (w, h) in enumerate(sides) if min(w, h) < 2 * S]
    drafted = [i for i, (w, h) in enumerate(sides) if min(w, h) >= 2 * S]
    assert len(no_draft) >= 5 and drafted, sides  # both cases drawn
    for i in no_draft:
        width, height = Image.open(io.BytesIO(IMAGES[i])).size
        if width > height:
            assert torch.equal(levels[i].round(), torch.zeros_like(levels[i])), (name, i)
        else:
            assert levels[i].max() <= 1.01, (name, i)
    assert max(float(levels[i].max()) for i in drafted) > 2


def test_pixel_budget_changes_memory_not_results():
    """Runs of one image, of a few, or the whole batch at once: the same images and labels, with a PNG slot, an
    undecodable JPEG (borrowing an image and its label), jitter, erasing and noise in the batch."""
    png = io.BytesIO()
    class_image(5, 2, (50, 40)).save(png, format="PNG")
    cut = IMAGES[2][: IMAGES[2].find(b"\xff\xda") + 30]
    images = [*IMAGES[:5], png.getvalue(), cut, *IMAGES[5:]]
    aug = AugmentConfig(color_jitter=[0.4, 0.4, 0.4, 0.1], erase=0.5, noise=0.1)
    batch, _ = _device_batch(aug, images)
    labels = torch.arange(len(images)) + 100
    want, want_labels = DeviceDecoder(aug, "cpu")(batch, labels)
    pixels = batch.sizes.prod(1)
    for budget in (1, int(pixels.max()) * 3):
        dec = DeviceDecoder(aug, "cpu", pixel_budget=budget)
        got, got_labels = dec(batch, labels)
        assert torch.equal(got, want) and torch.equal(got_labels, want_labels) and dec.skipped == 1, budget
    with pytest.raises(ValueError, match="pixel_budget"):
        DeviceDecoder(aug, "cpu", pixel_budget=0)


def test_runs_stay_within_the_pixel_budget():
    """Consecutive runs covering every image; each within the budget (decoded pixels + run length × largest crop
    height × largest crop width) unless it is one image over the budget by itself, and its padded crops holding at
    most twice its crops' pixels; a run ends only where the next image would break one of the two."""
    rng = np.random.default_rng(0)
    decoded = rng.integers(100, 5000, 40)
    hc = rng.integers(8, 60, 40)
    wc = np.round(hc * rng.uniform(0.75, 1.34, 40)).astype(np.int64)  # RandomResizedCrop's aspect ratios
    order = np.argsort(-hc * wc, kind="stable")
    decoded, hc, wc = decoded[order], hc[order], wc[order]

    def fits(a: int, b: int, budget: int) -> bool:
        h, w = hc[a:b].max(), wc[a:b].max()
        padded = (b - a) * h * w
        return decoded[a:b].sum() + padded <= budget and padded <= 2 * (hc[a:b] * wc[a:b]).sum()

    for budget in (1, 3000, 20000, 10**9):
        runs = _runs(decoded, hc, wc, budget)
        assert [a for a, _ in runs] == [0, *(b for _, b in runs[:-1])] and runs[-1][1] == 40
        for a, b in runs:
            assert fits(a, b, budget) or b - a == 1, (budget, a, b)
            assert b == 40 or not fits(a, b + 1, budget), (budget, a, b)  # greedy
    assert len(_runs(decoded, hc, wc, 1)) == 40
    assert len(_runs(decoded, hc, wc, 10**9)) <= 6  # by size class: crop areas from about 60 to 4200


def test_noise_is_drawn_from_the_record_seed():
    """Gaussian noise of std σ on the normalized pixels, a function of each record's noise seed."""
    aug, plain = AugmentConfig(noise=0.2), AugmentConfig()
    batch, items = _device_batch(aug)
    noisy, _ = DeviceDecoder(aug, "cpu")(batch, torch.arange(len(IMAGES)))
    again, _ = DeviceDecoder(aug, "cpu")(batch, torch.arange(len(IMAGES)))
    assert torch.equal(noisy, again)
    clean_items = [dataclasses.replace(e, params=dataclasses.replace(e.params, noise_seed=None)) for e in items]
    clean, _ = DeviceDecoder(plain, "cpu")(
        EncodedTransform(TrainTransform(S, plain)).collate(clean_items), torch.arange(len(IMAGES))
    )
    diff = noisy - clean
    assert abs(float(diff.std()) - 0.2) < 0.01 and abs(float(diff.mean())) < 0.01
    reseeded = [
        dataclasses.replace(e, params=dataclasses.replace(e.params, noise_seed=e.params.noise_seed + 1)) for e in items
    ]
    other, _ = DeviceDecoder(aug, "cpu")(
        EncodedTransform(TrainTransform(S, aug)).collate(reseeded), torch.arange(len(IMAGES))
    )
    assert not torch.allclose(other, noisy)


def test_cpu_fallback_slots_and_undecodable_images():
    """A PNG and a rotated record are decoded in the loader; a JPEG whose scan is cut off takes another image
    of the batch with that image's label, and is counted."""
    png = io.BytesIO()
    class_image(5, 2, (50, 40)).save(png, format="PNG")
    sos = IMAGES[2].find(b"\xff\xda")
    cut = IMAGES[2][: sos + 30]  # the header parses, the entropy-coded data ends early
    images = [IMAGES[0], png.getvalue(), cut, IMAGES[1]]
    aug = AugmentConfig()
    batch, items = _device_batch(aug, images)
    assert [isinstance(x, Encoded) for x in items] == [True, False, True, True]
    assert batch.slots.tolist() == [0, 2, 3] and batch.pixel_slots.tolist() == [1]
    dec = DeviceDecoder(aug, "cpu", dtype=torch.bfloat16, channels_last=True)
    out, labels = dec(batch, torch.tensor([10, 11, 12, 13]))
    assert out.dtype == torch.bfloat16 and out.is_contiguous(memory_format=torch.channels_last)
    assert (
        dec.skipped == 1
        and labels[2] != 12
        and torch.equal(out[2], out[int((labels[:2] == labels[2]).nonzero()[0]) if labels[2] in labels[:2] else 3])
    )
    ref = TrainTransform(S, aug)(png.getvalue(), random.Random(101))
    want = normalize_batch(torch.from_numpy(np.ascontiguousarray(ref.transpose(2, 0, 1)))[None]).to(torch.bfloat16)
    assert torch.equal(out[1:2], want)
    rotated = EncodedTransform(TrainTransform(S, AugmentConfig(rotation=30)))(IMAGES[0], random.Random(0))
    assert isinstance(rotated, np.ndarray) and rotated.shape == (S, S, 3)


def test_pixel_ops_are_pils():
    """Enhance factors, luminance and the 8-bit HSV hue shift against PIL itself."""
    rng = np.random.default_rng(0)
    arr = rng.integers(0, 256, (4, 24, 20, 3), dtype=np.uint8)
    x = torch.from_numpy(arr).permute(0, 3, 1, 2).float()
    factors = torch.tensor([0.3, 0.9, 1.0, 1.6], dtype=torch.float64)
    enh = {"brightness": ImageEnhance.Brightness, "contrast": ImageEnhance.Contrast, "saturation": ImageEnhance.Color}
    for op, cls in enh.items():
        got = adjust(x, op, factors).permute(0, 2, 3, 1).numpy()
        want = np.stack([np.asarray(cls(Image.fromarray(a)).enhance(float(f))) for a, f in zip(arr, factors)])
        assert np.array_equal(got, want), op
    shifts = torch.tensor([-0.5, -0.07, 0.0, 0.33], dtype=torch.float64)
    got = shift_hue(x, shifts).permute(0, 2, 3, 1).numpy()
    want = np.stack([np.asarray(_hue(Image.fromarray(a), float(s))) for a, s in zip(arr, shifts)])
    assert np.array_equal(got, want)
    assert np.array_equal(luma(x)[:, 0].numpy(), np.stack([np.asarray(Image.fromarray(a).convert("L")) for a in arr]))
    assert torch.equal(
        blend(torch.zeros(1, 1, 1, 2), torch.tensor([[[[100.0, 200.0]]]]), torch.tensor([2.0])),
        torch.tensor([[[[200.0, 255.0]]]]),
    )


@pytest.fixture(scope="module")
def shard_dir(tmp_path_factory):
    return make_shards(tmp_path_factory.mktemp("device") / "shards")


def test_stream_hands_over_encoded_batches(shard_dir):
    """decode='device': the same labels and (within rounding) the same images as the CPU stream without draft
    decoding, the same batches whatever the loader processes, and a resumed epoch replays them."""
    aug = AugmentConfig(scale=(0.3, 1.0), color_jitter=[0.2, 0.2, 0.2, 0.0], erase=0.3)
    dev = list(stream(shard_dir, augment=aug, decode="device", normalize=False).epoch(1))
    cpu = list(stream(shard_dir, augment=aug, draft=False).epoch(1))
    assert len(dev) == len(cpu) and isinstance(dev[0][0], EncodedImages) and len(dev[0][0]) == P * K
    to_device = DeviceInput(aug, "cpu")
    for (enc, labels), (want, want_labels) in zip(dev, cpu):
        images, got_labels = to_device(enc, labels)
        assert torch.equal(got_labels, want_labels) and images.shape == (P * K, 3, IMG, IMG)
        levels = (images - want).abs() * (255 * torch.tensor(IMAGENET_STD).view(1, 3, 1, 1))
        assert levels.max() <= 5.01 and levels.mean() < 0.2  # see the module docstring
    par = list(
        stream(shard_dir, augment=aug, decode="device", normalize=False, loader_workers=2).epoch(1, start_batch=2)
    )
    for (a, la), (b, lb) in zip(dev[2:], par):
        assert torch.equal(la, lb) and torch.equal(a.data, b.data) and a.params == b.params
    with pytest.raises(ValueError, match="normalize=False"):
        stream(shard_dir, decode="device")


def test_decode_setting():
    assert resolve_decode("auto", "cpu", AugmentConfig()) == "cpu"
    assert resolve_decode("auto", "cuda", AugmentConfig()) == "device"
    assert resolve_decode("auto", "cuda", AugmentConfig(rotation=10)) == "cpu"
    assert resolve_decode("auto", "cuda", AugmentConfig(randaugment=2)) == "cpu"  # RandAugment: CPU decoding
    assert resolve_decode("device", "cpu", AugmentConfig()) == "device"
    assert load_config(None, ["data.decode=cpu"]).data.decode == "cpu"
    with pytest.raises(ConfigError, match=r"data.decode: device decoding does not apply data.augment.rotation"):
        load_config(None, ["data.decode=device", "data.augment.rotation=10"])
    with pytest.raises(ConfigError, match=r"data.decode: device decoding does not apply data.augment.randaugment"):
        load_config(None, ["data.decode=device", "data.augment.randaugment=[2,9]"])
