"""Decoding and augmentation: torchvision's semantics for every option, records drawn then applied,
reproducible from the slot generator, off by default where they were off before."""

from __future__ import annotations

import dataclasses
import io
import random

import numpy as np
import pytest
import torch
from dataset_fixtures import class_image
from PIL import Image
from torchvision.transforms import CenterCrop, Resize
from torchvision.transforms import functional as F

from dmltrain.config import load_config
from dmltrain.errors import ConfigError
from shards.config import AugmentConfig
from shards.decode.augment import (
    RANDAUGMENT_OPS,
    AugmentParams,
    draw_params,
    randaugment_magnitude,
    random_resized_crop_params,
)
from shards.decode.transforms import (
    ERASE_RGB,
    IMAGENET_STD,
    EvalTransform,
    PixelNorm,
    TrainTransform,
    _randaugment,
    normalize_batch,
)
from shards.read.datasets import slot_rngs


def test_transforms_match_torchvision():
    img = class_image(7, 1, (120, 90))
    png, jpg = io.BytesIO(), io.BytesIO()
    img.save(png, format="PNG")
    img.save(jpg, format="JPEG", quality=95)
    t = TrainTransform(32, AugmentConfig(scale=(0.3, 1.0), flip=0), draft=False)
    ours = t(png.getvalue(), random.Random(4))
    top, left, h, w = random_resized_crop_params(120, 90, (0.3, 1.0), (3 / 4, 4 / 3), random.Random(4))
    ref = np.asarray(F.resized_crop(img, top, left, h, w, [32, 32], F.InterpolationMode.BILINEAR))
    # identical inside; the outermost pixels differ a little because a box resize filters with the
    # real neighbours outside the crop where crop-then-resize repeats the crop's edge
    assert np.array_equal(ours[2:-2, 2:-2], ref[2:-2, 2:-2]) and np.abs(ours.astype(int) - ref).mean() < 0.5
    ev = EvalTransform(64, 56, draft=False)(png.getvalue())
    ref = np.asarray(CenterCrop(56)(Resize(64)(img))).astype(float)
    assert np.abs(ev.astype(float) - ref).mean() < 4
    # draft decoding of a JPEG stays close to the full decode
    big = io.BytesIO()
    class_image(9, 2, (480, 400)).resize((480, 400), Image.BILINEAR).save(big, format="JPEG", quality=95)
    full = EvalTransform(64, 56, draft=False)(big.getvalue()).astype(float)
    fast = EvalTransform(64, 56, draft=True)(big.getvalue()).astype(float)
    assert np.abs(full - fast).mean() < 4
    for _ in range(20):  # torchvision's fallback and ranges
        top, left, h, w = random_resized_crop_params(50, 10, (0.08, 1.0), (3 / 4, 4 / 3), random.Random(_))
        assert 0 <= top and top + h <= 10 and 0 <= left and left + w <= 50


W, H, S = 120, 90, 32


def _png(size=(W, H), key=7) -> tuple[Image.Image, bytes]:
    img = class_image(key, 1, size)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return img, buf.getvalue()


def _box_params(p: AugmentParams) -> tuple[int, int, int, int]:
    """(top, left, h, w) of an integer crop box (no resize frame)."""
    left, top, right, bottom = p.box
    assert all(float(v).is_integer() for v in p.box)
    return int(top), int(left), int(bottom - top), int(right - left)


def test_defaults_are_crop_and_flip_as_before():
    """Off by default where they were off before: the default record is a RandomResizedCrop (scale 0.08-1,
    ratio 3/4-4/3) and a flip with p = 0.5, drawn in the same order as before, and nothing else."""
    img, png = _png()
    t = TrainTransform(S, draft=False)
    assert (t.channels, t.dtype) == (3, np.uint8)
    flips = 0
    for seed in range(12):
        p = t.draw(W, H, random.Random(seed))
        assert (p.angle, p.jitter, p.erase, p.noise_seed) == (0.0, (), None, None)
        rng = random.Random(seed)  # the reference draws: crop parameters, then the flip
        top, left, h, w = random_resized_crop_params(W, H, (0.08, 1.0), (3 / 4, 4 / 3), rng)
        flip = rng.random() < 0.5
        assert _box_params(p) == (top, left, h, w) and p.flip == flip
        flips += flip
        ref = F.resized_crop(img, top, left, h, w, [S, S], F.InterpolationMode.BILINEAR)
        ref = np.asarray(F.hflip(ref) if flip else ref)
        ours = t(png, random.Random(seed))
        assert ours.dtype == np.uint8 and ours.shape == (S, S, 3)
        assert np.abs(ours[2:-2, 2:-2].astype(int) - ref[2:-2, 2:-2]).max() <= 1
    assert 0 < flips < 12
    a = AugmentConfig()
    assert (a.resize, a.rotation_range, a.grayscale, a.noise, a.erase.p) == (None, (0.0, 0.0), 0, 0.0, 0.0)
    assert a.color_jitter.model_dump() == {"brightness": 0.0, "contrast": 0.0, "saturation": 0.0, "hue": 0.0}


def test_records_are_functions_of_the_generator():
    aug = AugmentConfig(
        resize=[64, 64], rotation=20, color_jitter=[0.4, 0.4, 0.4, 0.1], grayscale=3, noise=0.1, erase=0.5, flip=0.5
    )
    recs = [draw_params(aug, W, H, S, random.Random(s)) for s in range(30)]
    assert recs == [draw_params(aug, W, H, S, random.Random(s)) for s in range(30)]
    assert len({r.box for r in recs}) == 30 and len({r.angle for r in recs}) == 30
    assert {r.flip for r in recs} == {True, False} and {r.erase is None for r in recs} == {True, False}
    assert all(sorted(op for op, _ in r.jitter) == ["brightness", "contrast", "hue", "saturation"] for r in recs)
    assert len({tuple(op for op, _ in r.jitter) for r in recs}) > 1, "a random order of the jitter operations"
    assert all(r.noise_seed is not None for r in recs) and len({r.noise_seed for r in recs}) == 30


# each option alone (the crop fixed to the whole image unless the option is the crop), and the part of the
# record it draws; grayscale and resize draw nothing of their own, so they are checked for equality only
_FIXED = {"scale": (1.0, 1.0), "ratio": (W / H, W / H), "flip": 0.0}
_OPTIONS = {
    "crop": ({"scale": (0.2, 1.0), "ratio": (0.5, 2.0), "flip": 0.0}, lambda p: p.box),
    "resize": ({"resize": [48, 48], "flip": 0.0}, lambda p: p.box),
    "flip": ({**_FIXED, "flip": 0.5}, lambda p: p.flip),
    "rotation": ({**_FIXED, "rotation": 30}, lambda p: p.angle),
    "color_jitter": ({**_FIXED, "color_jitter": [0.4, 0.4, 0.4, 0.1]}, lambda p: p.jitter),
    "grayscale": ({**_FIXED, "grayscale": 1}, None),
    "noise": ({**_FIXED, "noise": 0.1}, lambda p: p.noise_seed),
    "erase": ({**_FIXED, "erase": 0.5}, lambda p: p.erase),
    "randaugment": ({**_FIXED, "randaugment": [2, 9]}, lambda p: p.randaugment),
}


@pytest.mark.parametrize("option", list(_OPTIONS))
def test_every_option_is_reproducible_from_seed_epoch_step_slot(option):
    """Records and pixels are functions of (seed, epoch, step, place in the step) through the slot generators: the
    same key gives the same records and the same pixels, changing any one of its parts gives other draws."""
    _, png = _png()
    kwargs, drawn = _OPTIONS[option]
    t = TrainTransform(S, AugmentConfig(**kwargs), draft=False)
    slots = 16
    key = (3, 1, 1, 5)  # seed, epoch, step, first slot (of a step of 4 × 16 images)

    def batch(seed, epoch, step, first):
        rngs = slot_rngs(seed, epoch, step, first, slots, 4 * slots)
        records = [t.draw(W, H, r) for r in slot_rngs(seed, epoch, step, first, slots, 4 * slots)]
        return records, [t(png, r) for r in rngs]

    records, pixels = batch(*key)
    again, pixels2 = batch(*key)
    assert records == again and all(np.array_equal(a, b) for a, b in zip(pixels, pixels2))
    assert pixels[0].shape == (S, S, t.channels)
    if drawn is None:  # deterministic: the same whatever the key
        other, other_pixels = batch(4, 2, 0, 6)
        assert other == records and all(np.array_equal(a, b) for a, b in zip(pixels, other_pixels))
        return
    assert len({repr(drawn(r)) for r in records}) > 1, "the slots of one batch draw differently"
    for part in range(4):
        changed = list(key)
        changed[part] += 1
        other, other_pixels = batch(*changed)
        assert [drawn(r) for r in other] != [drawn(r) for r in records], (option, "seed epoch step slot".split()[part])
        assert any(not np.array_equal(a, b) for a, b in zip(pixels, other_pixels))


def test_config_defaults_are_crop_and_flip():
    """A config that names no augmentation gets the defaults above; options are off unless set."""
    assert load_config(None, []).data.augment == AugmentConfig()
    a = load_config(None, ["data.augment.rotation=15"]).data.augment
    assert (a.rotation_range, a.flip, a.scale, a.noise, a.erase.p, a.grayscale) == (
        (-15, 15),
        0.5,
        (0.08, 1.0),
        0.0,
        0.0,
        0,
    )
    assert a.color_jitter == AugmentConfig().color_jitter


def test_flip_probability():
    _, png = _png()
    for p, expect in ((0.0, (0, 0)), (1.0, (60, 60)), (0.3, (8, 28))):
        t = TrainTransform(S, AugmentConfig(flip=p))
        n = sum(t.draw(W, H, random.Random(s)).flip for s in range(60))
        assert expect[0] <= n <= expect[1], (p, n)
    t = TrainTransform(S, AugmentConfig(flip=1.0, scale=(1, 1), ratio=(W / H, W / H)), draft=False)
    plain = TrainTransform(S, AugmentConfig(flip=0.0, scale=(1, 1), ratio=(W / H, W / H)), draft=False)
    assert np.array_equal(t(png, random.Random(0)), plain(png, random.Random(0))[:, ::-1])


def test_resize_frame_gives_random_crop_of_resized_image():
    """resize [256, 256] + a fixed area (224/256)² + ratio 1 is torchvision's Resize((256, 256)) + RandomCrop(224)."""
    img, png = _png()
    aug = AugmentConfig(resize=[64, 64], scale=((56 / 64) ** 2,) * 2, ratio=(1, 1), flip=0)
    t = TrainTransform(56, aug, draft=False)
    for seed in range(5):
        p = t.draw(W, H, random.Random(seed))
        left, top = p.box[0] * 64 / W, p.box[1] * 64 / H
        assert p.box[2] - p.box[0] == pytest.approx(56 * W / 64) and p.box[3] - p.box[1] == pytest.approx(56 * H / 64)
        assert (
            left == pytest.approx(round(left)) and top == pytest.approx(round(top)) and 0 <= left <= 8 and 0 <= top <= 8
        )
        ref = np.asarray(F.crop(F.resize(img, [64, 64]), round(top), round(left), 56, 56)).astype(float)
        ours = t(png, random.Random(seed)).astype(float)
        assert np.abs(ours[2:-2, 2:-2] - ref[2:-2, 2:-2]).mean() < 3  # one resample here, two there
    # a shorter-side resize keeps the aspect ratio: the crop's size is as without it (its position is drawn in another range)
    p1 = draw_params(AugmentConfig(resize=256), 300, 200, S, random.Random(1))
    p2 = draw_params(AugmentConfig(), 300, 200, S, random.Random(1))
    size = lambda b: np.array([b[2] - b[0], b[3] - b[1]])  # noqa: E731
    assert np.allclose(size(p1.box), size(p2.box), rtol=0.02)


def test_rotation_as_torchvision_rotate_then_crop():
    img, png = _png((96, 96))
    aug = AugmentConfig(rotation=[25, 25], scale=(0.5, 0.5), ratio=(1, 1), flip=0)
    t = TrainTransform(S, aug, draft=False)
    p = t.draw(96, 96, random.Random(3))
    assert p.angle == 25
    top, left, h, w = _box_params(p)
    ref = np.asarray(F.resized_crop(F.rotate(img, 25, F.InterpolationMode.BILINEAR), top, left, h, w, [S, S])).astype(
        float
    )
    ours = t(png, random.Random(3)).astype(float)
    unrotated = TrainTransform(S, aug.model_copy(update={"rotation": 0.0}), draft=False).apply(
        Image.open(io.BytesIO(png)), dataclasses.replace(p, angle=0.0)
    )
    assert np.abs(ours - ref).mean() < 6 < np.abs(unrotated.astype(float) - ref).mean()
    lo, hi = AugmentConfig(rotation=10).rotation_range
    angles = [draw_params(AugmentConfig(rotation=10), W, H, S, random.Random(s)).angle for s in range(50)]
    assert (lo, hi) == (-10, 10) and all(-10 <= a <= 10 for a in angles) and min(angles) < -5 and max(angles) > 5


def test_color_jitter_and_grayscale_as_torchvision():
    img, png = _png()
    aug = AugmentConfig(color_jitter=[0.4, 0.4, 0.4, 0.2], flip=0)
    t = TrainTransform(S, aug, draft=False)
    plain = TrainTransform(S, AugmentConfig(flip=0), draft=False)
    adjust = {
        "brightness": F.adjust_brightness,
        "contrast": F.adjust_contrast,
        "saturation": F.adjust_saturation,
        "hue": F.adjust_hue,
    }
    for seed in range(4):
        p = t.draw(W, H, random.Random(seed))
        ref = Image.fromarray(plain.apply(Image.open(io.BytesIO(png)), dataclasses.replace(p, jitter=())))
        for op, factor in p.jitter:
            lo, hi = (-0.2, 0.2) if op == "hue" else (0.6, 1.4)
            assert lo <= factor <= hi
            ref = adjust[op](ref, factor)
        assert np.array_equal(t(png, random.Random(seed)), np.asarray(ref))
    crop = plain(png, random.Random(0))
    for channels in (1, 3):
        g = TrainTransform(S, AugmentConfig(flip=0, grayscale=channels), draft=False)
        assert g.channels == channels
        ours = g(png, random.Random(0))
        ref = np.asarray(F.rgb_to_grayscale(Image.fromarray(crop), channels))
        assert ours.shape == (S, S, channels) and np.array_equal(ours, ref.reshape(S, S, channels))
        ev = EvalTransform(40, S, draft=False, grayscale=channels)
        assert ev.channels == channels and ev(png).shape == (S, S, channels)


def test_erase_as_torchvision_random_erasing():
    _, png = _png()
    aug = AugmentConfig(erase={"p": 1.0, "scale": [0.1, 0.2], "ratio": [0.5, 2.0]}, flip=0)
    t, plain = TrainTransform(S, aug, draft=False), TrainTransform(S, AugmentConfig(flip=0), draft=False)
    for seed in range(10):
        p = t.draw(W, H, random.Random(seed))
        top, left, h, w = p.erase
        assert 0.1 * S * S - 2 * S <= h * w <= 0.2 * S * S + 2 * S and 0.4 <= h / w <= 2.5
        assert 0 <= top <= S - h and 0 <= left <= S - w
        ours, clean = (
            t(png, random.Random(seed)),
            plain.apply(Image.open(io.BytesIO(png)), dataclasses.replace(p, erase=None)),
        )
        mask = np.zeros((S, S), bool)
        mask[top : top + h, left : left + w] = True
        assert (ours[mask] == ERASE_RGB).all() and np.array_equal(ours[~mask], clean[~mask])
    # value 0 after normalization: the mean colour, to within half a grey level
    filled = normalize_batch(torch.from_numpy(np.broadcast_to(ERASE_RGB, (1, 1, 1, 3)).transpose(0, 3, 1, 2).copy()))
    assert filled.abs().max() < 0.5 / 255 / min(IMAGENET_STD) + 1e-6
    assert sum(
        TrainTransform(S, AugmentConfig(erase=0.5)).draw(W, H, random.Random(s)).erase is not None for s in range(60)
    ) in range(15, 46)


def test_noise_is_gaussian_on_normalized_pixels():
    _, png = _png()
    sigma = 0.2
    t = TrainTransform(S, AugmentConfig(noise=sigma, flip=0, grayscale=1), draft=False)
    plain = TrainTransform(S, AugmentConfig(flip=0, grayscale=1), draft=False)
    assert (t.channels, t.dtype) == (3, np.float32)
    noisy, clean = t(png, random.Random(5)), plain(png, random.Random(5))
    assert noisy.dtype == np.float32 and noisy.shape == (S, S, 3) and np.array_equal(noisy, t(png, random.Random(5)))
    to_t = lambda a: torch.from_numpy(a.transpose(2, 0, 1).copy())[None]  # noqa: E731
    diff = (normalize_batch(to_t(noisy)) - normalize_batch(to_t(clean))).flatten(1)
    assert abs(float(diff.mean())) < 0.02 and float(diff.std()) == pytest.approx(sigma, rel=0.05)
    assert normalize_batch(to_t(clean)).shape == (1, 3, S, S), "a grayscale channel broadcast to three"
    assert not np.array_equal(noisy, t(png, random.Random(6)))


def test_augment_config_keys():
    cfg = load_config(
        None, ["data.augment.color_jitter=0.4", "data.augment.erase=0.25", "data.augment.rotation=[-5, 10]"]
    )
    a = cfg.data.augment
    assert (a.color_jitter.brightness, a.color_jitter.saturation, a.color_jitter.hue, a.erase.p, a.rotation_range) == (
        0.4,
        0.4,
        0.0,
        0.25,
        (-5, 10),
    )
    for override, text in (
        ("data.crop_scale=[0.5, 1]", "data.crop_scale: moved to data.augment.scale"),
        ("data.color_jitter=0.4", "data.color_jitter: moved to data.augment.color_jitter"),
        ("data.augment.scale=[0, 1]", "data.augment.scale: need 0 < low <= high <= 1"),
        ("data.augment.erase.ratio=[2, 1]", "data.augment.erase.ratio: need 0 < low <= high"),
        ("data.augment.grayscale=2", "data.augment.grayscale"),
        ("data.augment.flip=1.5", "data.augment.flip"),
        ("data.augment.shear=3", "data.augment.shear: unknown key"),
    ):
        with pytest.raises(ConfigError) as e:
            load_config(None, [override])
        assert text in str(e.value) and "\n" not in str(e.value), (override, str(e.value))


def test_bicubic_and_the_backbones_normalization_as_torchvision():
    """``data.interpolation=bicubic`` is torchvision's BICUBIC (Pillow's, antialiased) in training and evaluation;
    the backbone's mean and std normalize (here timm's ViT: 0.5, 0.5), and erasing fills with its mean colour."""
    img, png = _png()
    norm = PixelNorm((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))
    t = TrainTransform(S, AugmentConfig(scale=(0.3, 1.0), flip=0), draft=False, norm=norm, interpolation="bicubic")
    ours = t(png, random.Random(4))
    top, left, h, w = random_resized_crop_params(W, H, (0.3, 1.0), (3 / 4, 4 / 3), random.Random(4))
    ref = np.asarray(F.resized_crop(img, top, left, h, w, [S, S], F.InterpolationMode.BICUBIC))
    bilinear = np.asarray(F.resized_crop(img, top, left, h, w, [S, S], F.InterpolationMode.BILINEAR))
    assert np.array_equal(ours[4:-4, 4:-4], ref[4:-4, 4:-4]) and not np.array_equal(ours, bilinear)
    ev = EvalTransform(64, 56, draft=False, interpolation="bicubic")(png)
    ref = np.asarray(CenterCrop(56)(Resize(64, interpolation=F.InterpolationMode.BICUBIC)(img))).astype(float)
    assert np.abs(ev.astype(float) - ref).mean() < 4
    x = torch.from_numpy(ours.transpose(2, 0, 1)[None].copy())
    torch.testing.assert_close(normalize_batch(x, norm=norm), (x.float() / 255 - 0.5) / 0.5, rtol=0, atol=1e-6)
    erasing = TrainTransform(S, AugmentConfig(erase=1.0, flip=0), draft=False, norm=norm)
    p = erasing.draw(W, H, random.Random(1))
    top, left, h, w = p.erase
    assert (erasing.apply(Image.open(io.BytesIO(png)), p)[top : top + h, left : left + w] == 128).all()


_TORCHVISION_RANDAUGMENT = {
    "Identity": "identity", "ShearX": "shear_x", "ShearY": "shear_y", "TranslateX": "translate_x",
    "TranslateY": "translate_y", "Rotate": "rotate", "Brightness": "brightness", "Color": "color",
    "Contrast": "contrast", "Sharpness": "sharpness", "Posterize": "posterize", "Solarize": "solarize",
    "AutoContrast": "autocontrast", "Equalize": "equalize",
}  # fmt: skip


def test_randaugment_as_torchvision():
    """torchvision's RandAugment: its 14 operations in its order (the draw indexes them), its magnitude table, its
    ``_apply_op`` on PIL images (the same pixels), two operations per image, both signs drawn; the other draws
    of the record are those of the same options without RandAugment."""
    from torchvision.transforms import InterpolationMode, RandAugment
    from torchvision.transforms.autoaugment import _apply_op

    space = RandAugment(num_ops=2, magnitude=9, num_magnitude_bins=31)._augmentation_space(31, (S, S))
    assert [_TORCHVISION_RANDAUGMENT[k] for k in space] == list(RANDAUGMENT_OPS)
    img = class_image(3, 1, (S, S))
    for name, op in _TORCHVISION_RANDAUGMENT.items():
        magnitudes, signed = space[name]
        for level in (0, 9, 30):
            m, ours_signed = randaugment_magnitude(op, level, 31, S)
            want = float(magnitudes[level]) if magnitudes.ndim > 0 else 0.0
            assert ours_signed == signed and m == pytest.approx(want, rel=1e-6, abs=1e-5), (op, level)
        m = randaugment_magnitude(op, 9, 31, S)[0]
        for value in (m, -m) if signed else (m,):
            ref = _apply_op(img, name, value, interpolation=InterpolationMode.NEAREST, fill=None)
            assert np.array_equal(np.asarray(_randaugment(img, op, value)), np.asarray(ref)), (op, value)
    aug, plain = AugmentConfig(randaugment=[2, 9], flip=0.5), AugmentConfig(flip=0.5)
    recs = [draw_params(aug, W, H, S, random.Random(s)) for s in range(200)]
    assert all(len(r.randaugment) == 2 for r in recs)
    assert {op for r in recs for op, _ in r.randaugment} == set(RANDAUGMENT_OPS)
    assert {m > 0 for r in recs for op, m in r.randaugment if op == "rotate"} == {True, False}
    assert [dataclasses.replace(r, randaugment=()) for r in recs] == [
        draw_params(plain, W, H, S, random.Random(s)) for s in range(200)
    ]
    _, png = _png()
    t, base = TrainTransform(S, aug, draft=False), TrainTransform(S, plain, draft=False)
    for seed in range(5):
        p = t.draw(W, H, random.Random(seed))
        want = Image.fromarray(base.apply(Image.open(io.BytesIO(png)), dataclasses.replace(p, randaugment=())))
        for o, m in p.randaugment:
            tv = next(k for k, v in _TORCHVISION_RANDAUGMENT.items() if v == o)
            want = _apply_op(want, tv, m, interpolation=InterpolationMode.NEAREST, fill=None)
        assert np.array_equal(t(png, random.Random(seed)), np.asarray(want))
    assert load_config(None, ["data.augment.randaugment=2"]).data.augment.randaugment.ops == 2
    with pytest.raises(ConfigError, match="data.augment.randaugment.magnitude: 31 is not below bins"):
        load_config(None, ["data.augment.randaugment=[2, 31]"])


def test_an_image_too_large_to_decode_is_refused_before_decoding():
    """A decompression bomb in a shard (built elsewhere) is refused from its header by every decoding path, and
    the loader notes one line naming the shard member; a large real image still decodes."""
    from dataset_fixtures import bomb_png

    from shards.decode.encoded import EncodedTransform
    from shards.decode.rgb import MAX_IMAGE_PIXELS, ImageTooLarge
    from shards.read.datasets import _decode

    train = TrainTransform(S, AugmentConfig())
    for side in (10_000, 30_000):  # above our bound; above PIL's own hard limit
        bomb = bomb_png(side, side)
        for transform in (EvalTransform(64, 56), train, EncodedTransform(train)):
            with pytest.raises(ImageTooLarge, match="too large to decode"):
                transform(bomb, random.Random(0))

    class Shard:  # one member, the bomb
        def sample(self, g, pos):
            return ("00000007", "png", bomb_png(10_000, 10_000))

        def shard_name(self, g):
            return "train-000003.tar"

    notes: list[str] = []
    assert _decode(Shard(), 0, 0, train, random.Random(0), notes, set()) is None
    assert notes == [
        "train-000003.tar:00000007.png: cannot decode (ImageTooLarge: too large to decode: 10000 x 10000 = "
        f"100,000,000 pixels, more than the {MAX_IMAGE_PIXELS:,} any image may have (a decompression bomb?))"
    ]
    _, ok = _png((1200, 900))
    assert EvalTransform(64, 56)(ok).shape == (56, 56, 3)
