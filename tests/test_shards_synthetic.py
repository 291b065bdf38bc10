"""The synthetic layout is learnable: a tiny CNN trained briefly on its train classes retrieves
unseen test classes clearly better than the same network untrained. Class families make siblings alike
but distinct; label noise relabels exactly the stated share of train images and records the truth."""

from __future__ import annotations

import hashlib
import json
import math
import tarfile
import time
from collections import Counter

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from dmltrain.errors import UserError
from shards.build.synthetic import (
    Families,
    build_synthetic_shards,
    class_parts,
    noisy_labels,
    render,
    render_jpeg,
    synthetic_layout,
)
from shards.config import AugmentConfig
from shards.manifest import Manifest
from shards.read.stream import TrainStream, eval_batches

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CLASSES, PER_CLASS, SIZE = 40, 10, 32


class TinyCNN(nn.Module):
    def __init__(self, dim: int = 64):
        super().__init__()
        layers, c = [], 3
        for width in (16, 32, 64):
            layers += [nn.Conv2d(c, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(), nn.MaxPool2d(2)]
            c = width
        self.features = nn.Sequential(*layers[:-1], nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.features(x)


def recall_at_1(model: nn.Module, shard_dir) -> float:
    model.eval()
    embs, labels = [], []
    with torch.no_grad():
        for images, y, _ in eval_batches(
            shard_dir, "test", rank=0, world_size=1, batch_size=200, resize=36, crop=SIZE, loader_workers=0
        ):
            embs.append(F.normalize(model(images), dim=1))
            labels.append(y)
    e, y = torch.cat(embs), torch.cat(labels)
    sim = e @ e.T
    sim.fill_diagonal_(-float("inf"))  # the query itself is excluded
    return (y[sim.argmax(1)] == y).float().mean().item()


def test_images_are_pure_functions_of_their_ids():
    a, b = render(3, 5, 1, 24), render(3, 5, 1, 24)
    assert np.array_equal(np.asarray(a), np.asarray(b))
    assert not np.array_equal(np.asarray(a), np.asarray(render(3, 5, 2, 24)))
    assert [p.shape for p in class_parts(3, 5)] == [p.shape for p in class_parts(3, 5)]


def test_synthetic_is_learnable(tmp_path):
    torch.manual_seed(0)
    out = tmp_path / "synthetic"
    build_synthetic_shards(out, CLASSES, PER_CLASS, SIZE, seed=1, shard_size=100, workers=1, progress=False)
    m = Manifest.load(out)
    assert not set(m.split("train").classes) & set(m.split("test").classes)
    model = TinyCNN()
    untrained = recall_at_1(model, out)
    classifier = nn.Linear(64, CLASSES)
    opt = torch.optim.Adam([*model.parameters(), *classifier.parameters()], lr=3e-3)
    ts = TrainStream(
        out,
        rank=0,
        world_size=1,
        sampler="pk",
        batch_size=64,
        samples_per_class=4,
        seed=0,
        image_size=SIZE,
        augment=AugmentConfig(scale=(0.5, 1.0)),
        loader_workers=1,
    )
    steps, t0, epoch = 0, time.perf_counter(), 0
    while steps < 80:
        for images, labels in ts.epoch(epoch):
            model.train()
            loss = F.cross_entropy(classifier(model(images)), labels)
            opt.zero_grad()
            loss.backward()
            opt.step()
            steps += 1
        epoch += 1
    trained = recall_at_1(model, out)
    print(
        f"synthetic R@1: untrained {untrained:.3f}, trained {trained:.3f} after {steps} steps ({time.perf_counter() - t0:.1f}s)"
    )
    assert trained > untrained + 0.2 and trained > 2 * untrained, (untrained, trained)


# -- class families and label noise ------------------------------------------------------------------------------


def test_a_family_of_one_is_the_image_of_builds_before_families():
    """family_size 1 renders exactly what the generator rendered before families existed: the SHA-256 of these
    pixels was taken from that code (numpy's PCG64 and Pillow's polygon fill are stable; a Pillow that rasterised
    polygons differently would move it, and the build's shards with it)."""
    h = hashlib.sha256()
    for seed, c, i, s in [(0, 0, 0, 32), (0, 7, 3, 32), (1, 123, 5, 24), (3, 5, 1, 64), (0, 199, 19, 32)]:
        h.update(np.asarray(render(seed, c, i, s)).tobytes())
    assert h.hexdigest() == "3bce52046d1035847a4c1803516858ca5b9f31576c73f3118c7a32eac988832c"
    layout, jobs = synthetic_layout(7, 2, 24, 3, family_size=1)
    assert layout.families is None and all(j[4] is None for js in jobs.values() for j in js)


def _hue_value_histogram(image) -> np.ndarray:
    """A simple colour feature: a 12 × 4 hue × value histogram of the saturated (object) pixels; the gradient
    backgrounds are grey enough to stay out."""
    hsv = np.asarray(image.convert("HSV"), np.float32)
    sat = hsv[..., 1] > 120
    hist, _, _ = np.histogram2d(hsv[..., 0][sat], hsv[..., 2][sat], bins=(12, 4), range=((0, 256), (0, 256)))
    return hist.ravel()


def _family_distances(spread: float, feature, families=6, size=4, images=40):
    """Mean RMS distance between class means (each from half of a class's images, the other half on the other
    side): a class to itself, to its siblings, to the classes of other families."""
    fam = Families(families * size, size)
    feats = {
        c: np.stack([feature(render(0, c, i, 24, fam.members(c).start, spread)) for i in range(images)])
        for c in range(families * size)
    }
    a = np.stack([f[: images // 2].mean(0) for f in feats.values()])
    b = np.stack([f[images // 2 :].mean(0) for f in feats.values()])
    d = np.sqrt(((a[:, None] - b[None]) ** 2).mean(-1))
    fid = np.array([fam.family(c) for c in feats])
    same, eye = fid[:, None] == fid[None], np.eye(len(fid), dtype=bool)
    return d[eye].mean(), d[same & ~eye].mean(), d[~same].mean()


def test_siblings_are_alike_but_distinct():
    """At the default spread (0.5) a class's siblings are much closer to it than other families' classes are
    (ratio below 0.8 both in a hue-value histogram and in raw pixels; measured 0.51-0.69 and 0.66-0.72 over seeds
    0-4), yet farther than the class is from itself (above 1.4×; measured 1.6-2.1: learnable); spread 0 makes
    siblings the same object, and spread 1 sets them farther apart than 0.5."""
    within, sibling, other = _family_distances(0.5, _hue_value_histogram)
    assert sibling < 0.8 * other and sibling > 1.4 * within, (within, sibling, other)
    _, pix_sibling, pix_other = _family_distances(0.5, lambda im: np.asarray(im, np.float32).ravel())
    assert pix_sibling < 0.8 * pix_other, (pix_sibling, pix_other)
    within0, sibling0, _ = _family_distances(0.0, _hue_value_histogram)
    assert sibling0 < 1.2 * within0, (within0, sibling0)
    within1, sibling1, _ = _family_distances(1.0, _hue_value_histogram)
    assert sibling1 / within1 > 1.2 * sibling / within, (sibling / within, sibling1 / within1)


def test_families_group_consecutive_classes_per_split():
    fam = Families(10, 4)  # train 0-3, 4-7, 8-9 (the last one smaller); test 10-13, 14-17, 18-19
    assert [fam.family(c) for c in range(20)] == [0] * 4 + [1] * 4 + [2] * 2 + [3] * 4 + [4] * 4 + [5] * 2
    assert fam.members(9) == range(8, 10) and fam.members(10) == range(10, 14) and fam.members(19) == range(18, 20)
    assert [len(Families(10, 1).members(c)) for c in range(20)] == [1] * 20


def _chi2_critical(df: int, z: float = 3.09) -> float:
    """The chi-square quantile at the normal quantile ``z`` (3.09: p = 0.001), Wilson-Hilferty's approximation."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@pytest.mark.parametrize("mode", ["uniform", "family"])
def test_label_noise_counts_distribution_and_determinism(mode):
    """round(p·N) train samples relabelled, never to their own class; uniform: every other class equally likely,
    family: every sibling equally likely (a chi-square test of the (true, wrong) pair counts at p = 0.001); the
    flips spread over the classes (each within 10 % of p × its images, about 4.7 standard deviations). The same
    seed draws the same flips, another seed others."""
    fam = Families(6, 3)
    per_class, p = 1500, 0.55
    wrong = noisy_labels(4, fam, per_class, p, mode)
    assert len(wrong) == round(p * 6 * per_class) == 4950
    assert wrong == noisy_labels(4, fam, per_class, p, mode) and wrong != noisy_labels(5, fam, per_class, p, mode)
    assert all(0 <= s < 6 * per_class for s in wrong)
    pairs = Counter((s // per_class, w) for s, w in wrong.items())
    allowed = {(c, w) for c in range(6) for w in (range(6) if mode == "uniform" else fam.members(c)) if w != c}
    assert set(pairs) == allowed
    expected = len(wrong) / len(allowed)
    chi2 = sum((n - expected) ** 2 / expected for n in pairs.values())
    assert chi2 < _chi2_critical(len(allowed) - 1), (chi2, pairs)
    flipped_per_class = Counter(s // per_class for s in wrong)
    assert all(abs(n - p * per_class) < 0.1 * p * per_class for n in flipped_per_class.values()), flipped_per_class


def _samples(shard_dir, split):
    """(json metadata, image bytes) of every sample of a split, in split order, read straight from the tars."""
    m = Manifest.load(shard_dir)
    out = []
    for sh in m.split(split).shards:
        with tarfile.open(sh.path) as tar:
            members = {t.name: tar.extractfile(t).read() for t in tar.getmembers()}
        for key in sorted({n.split(".")[0] for n in members}):
            out.append((json.loads(members[f"{key}.json"]), members[f"{key}.jpg"]))
    return out


def test_noisy_build_records_the_truth(tmp_path):
    """A build with families of 3 (the last one of 2) and 30 % label noise: the manifest lists every label's family
    and exactly round(0.3·N) relabelled train samples with their true labels; each sample's metadata agrees, its
    image is its true class's, and the test split has its own families and no noise."""
    out = tmp_path / "noisy"
    C, K = 8, 5
    build_synthetic_shards(
        out, C, K, 16, seed=2, shard_size=12, workers=1, progress=False, family_size=3, label_noise=0.3
    )
    m = Manifest.load(out)
    train, test = m.split("train"), m.split("test")
    assert train.families == [0, 0, 0, 1, 1, 1, 2, 2] and test.families == [3, 3, 3, 4, 4, 4, 5, 5]
    assert len(train.clean_labels) == round(0.3 * C * K) == 12 and test.clean_labels == {}
    opts = m.data["options"]["synthetic"]
    assert opts["family_size"] == 3 and opts["family_spread"] == 0.5 and opts["label_noise"] == 0.3
    assert opts["label_noise_mode"] == "uniform" and opts["relabelled"] == 12
    flipped = 0
    for meta, jpg in _samples(out, "train"):
        true = int(meta["path"].split("/")[1])  # synthetic/<true class>/<image>.jpg
        assert meta["clean_label"] == true and meta["clean_class_id"] == str(true)
        assert train.clean_labels.get(meta["index"], meta["label"]) == true
        flipped += meta["label"] != true
        base = Families(C, 3).members(true).start
        assert jpg == render_jpeg((2, true, int(meta["path"][-8:-4]), 16, base, 0.5))[0]
    assert flipped == 12
    for meta, jpg in _samples(out, "test"):
        c = int(meta["path"].split("/")[1])
        assert "clean_label" not in meta and meta["class_id"] == str(c) and meta["label"] == c - C
        assert jpg == render_jpeg((2, c, int(meta["path"][-8:-4]), 16, Families(C, 3).members(c).start, 0.5))[0]
    wrong = noisy_labels(2, Families(C, 3), K, 0.3)
    assert sorted(train.clean_labels.values()) == sorted(s // K for s in wrong)


def test_cli_and_config_build_the_same_shards(tmp_path, capsys):
    """`shards build --layout synthetic --family-size ... --label-noise ...` and `data.synthetic` with the same
    keys write the same manifest options and byte-identical shards; a config asking for other families or noise
    over the built folder is refused in one line (shards are built only when missing)."""
    from cluster.launch import prepare_data
    from dmltrain.cli import main
    from dmltrain.config import load_config

    flags = ["--classes", "6", "--per-class", "4", "--image-size", "16", "--seed", "3", "--shard-size", "10"]
    flags += ["--family-size", "3", "--family-spread", "0.7", "--label-noise", "0.25", "--label-noise-mode", "family"]
    assert main(["shards", "build", "--layout", "synthetic", "--out", str(tmp_path / "cli"), "--quiet", *flags]) == 0
    keys = "classes: 6, per_class: 4, image_size: 16, seed: 3, shard_size: 10, family_size: 3, family_spread: 0.7"
    keys += ", label_noise: 0.25, label_noise_mode: family"
    cfg = load_config(None, [f"data.shards={tmp_path / 'cfg'}", f"data.synthetic={{{keys}}}"])
    prepare_data(cfg)
    a, b = Manifest.load(tmp_path / "cli"), Manifest.load(tmp_path / "cfg")
    assert a.data["options"] == b.data["options"] and a.data["options"]["synthetic"]["label_noise_mode"] == "family"
    for split in ("train", "test"):
        assert [s.sha256 for s in a.split(split).shards] == [s.sha256 for s in b.split(split).shards]
    assert len(a.split("train").clean_labels) == round(0.25 * 24)
    capsys.readouterr()
    other = load_config(
        None, [f"data.shards={tmp_path / 'cli'}", f"data.synthetic={{{keys}}}", "data.synthetic.family_size=2"]
    )
    with pytest.raises(UserError) as err:
        prepare_data(other)
    msg = str(err.value)
    assert "\n" not in msg and "family_size=3 (asked: 2)" in msg and "data.synthetic" in msg, msg


@pytest.mark.parametrize(
    "flags, line",
    [
        (["--family-size", "0"], "--family-size: must be a whole number of classes, at least 1"),
        (["--family-size", "7"], "--family-size: 7 is more than the 6 classes"),
        (["--family-size", "2", "--family-spread", "1.5"], "--family-spread: must be in [0, 1]"),
        (["--family-spread", "nan"], "--family-spread: must be in [0, 1]"),
        (["--label-noise", "1"], "--label-noise: must be in [0, 1)"),
        (["--label-noise", "-0.1"], "--label-noise: must be in [0, 1)"),
        (
            ["--label-noise", "0.1", "--label-noise-mode", "sibling"],
            "--label-noise-mode: must be one of uniform, family",
        ),
        (["--label-noise", "0.1", "--label-noise-mode", "family"], "--label-noise-mode: family flips a label"),
        (
            ["--family-size", "5", "--label-noise", "0.1", "--label-noise-mode", "family"],
            "the last family of 6 classes in families of 5 has one class",
        ),
    ],
)
def test_bad_family_and_noise_options_are_one_line(tmp_path, capsys, flags, line):
    from dmltrain.cli import main

    argv = ["shards", "build", "--layout", "synthetic", "--out", str(tmp_path / "out"), "--classes", "6"]
    assert main([*argv, "--per-class", "2", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("dmltrain: error: ") and line in err[0], err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "override, line",
    [
        ("data.synthetic.family_size=0", "data.synthetic.family_size"),
        ("data.synthetic.family_size=300", "data.synthetic.family_size: 300 is more than the 200 classes"),
        ("data.synthetic.family_spread=2", "data.synthetic.family_spread"),
        ("data.synthetic.label_noise=1.0", "data.synthetic.label_noise"),
        ("data.synthetic.label_noise_mode=sibling", "data.synthetic.label_noise_mode"),
        ("data.synthetic={label_noise: 0.2, label_noise_mode: family}", "data.synthetic.label_noise_mode: family"),
    ],
)
def test_bad_data_synthetic_keys_name_the_key(override, line):
    from dmltrain.config import load_config
    from dmltrain.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        load_config(None, ["data.synthetic={}", override])
    assert "\n" not in str(err.value) and line in str(err.value), str(err.value)


def test_a_synthetic_sets_size_is_bounded_where_it_is_given(tmp_path, capsys):
    """``data.synthetic.classes=100000000`` (a SystemError after a minute, or memory exhausted) and a product of
    classes and images per class beyond the bound are one line and exit 2, from the config and from the command,
    before anything is written."""
    from pathlib import Path

    from dmltrain.cli import main
    from shards.config import MAX_SYNTHETIC_CLASSES, MAX_SYNTHETIC_IMAGES

    demo = str(Path(__file__).resolve().parents[1] / "configs/demo.yaml")
    for override, words in [
        ("data.synthetic.classes=100000000", "data.synthetic.classes"),
        (f"data.synthetic.per_class={MAX_SYNTHETIC_IMAGES + 1}", "data.synthetic.per_class"),
        ("data.synthetic={classes: 1000000, per_class: 3}", "data.synthetic.per_class: 1,000,000 classes x 3 images"),
    ]:
        assert main(["config", "show", demo, override]) == 2, override
        err = capsys.readouterr().err.strip()
        assert err.startswith("dmltrain: error: ") and "\n" not in err and words in err, err
    build = ["shards", "build", "--layout", "synthetic", "--out", str(tmp_path / "s"), "--quiet"]
    assert main([*build, "--classes", "100000000", "--per-class", "1"]) == 2
    assert (
        f"--classes: at most {MAX_SYNTHETIC_CLASSES:,} classes (per split), got 100,000,000" in capsys.readouterr().err
    )
    assert main([*build, "--classes", "1000000", "--per-class", "3"]) == 2
    err = capsys.readouterr().err
    assert (
        f"--per-class: 1,000,000 classes x 3 images = 3,000,000 images per split, more than the {MAX_SYNTHETIC_IMAGES:,}"
        in err
    )
    assert not (tmp_path / "s").exists()


def test_fewer_test_classes_keep_the_train_split_and_its_families(tmp_path, capsys):
    """``--test-classes 3`` beside 5 train classes in families of 2: the train split is the build without it
    (byte-identical shards), the test split holds classes 5-7 in their own families (5-6, 7), each image its
    class's, and the manifest records the count; ``data.synthetic.test_classes`` builds the same shards, asking
    for another count over them is refused in one line, leaving it unset too (as many as their 5 train classes),
    and a count below 2 or beyond the image bound is one line before anything is written."""
    from cluster.launch import prepare_data
    from dmltrain.cli import main
    from dmltrain.config import load_config
    from dmltrain.errors import ConfigError
    from shards.config import MAX_SYNTHETIC_CLASSES, MAX_SYNTHETIC_IMAGES

    fam = Families(5, 2, test_classes=3)
    assert [fam.family(c) for c in range(8)] == [0, 0, 1, 1, 2, 3, 3, 4]
    assert fam.members(6) == range(5, 7) and fam.members(7) == range(7, 8) and fam.members(4) == range(4, 5)
    common = dict(image_size=16, seed=1, shard_size=4, workers=1, progress=False, family_size=2)
    build_synthetic_shards(tmp_path / "all", 5, 2, **common)
    build_synthetic_shards(tmp_path / "few", 5, 2, **common, test_classes=3)
    a, b = Manifest.load(tmp_path / "all"), Manifest.load(tmp_path / "few")
    assert [s.sha256 for s in a.split("train").shards] == [s.sha256 for s in b.split("train").shards]
    test = b.split("test")
    assert test.num_classes == 3 and test.num_images == 6 and test.families == [3, 3, 4]
    assert b.data["options"]["synthetic"]["test_classes"] == 3 and "test_classes" not in a.data["options"]["synthetic"]
    seen = set()
    for meta, jpg in _samples(tmp_path / "few", "test"):
        c, i = int(meta["path"].split("/")[1]), int(meta["path"][-8:-4])
        assert meta["label"] == c - 5 and jpg == render_jpeg((1, c, i, 16, fam.members(c).start, 0.5))[0]
        seen.add(c)
    assert seen == {5, 6, 7}

    keys = "classes: 5, per_class: 2, image_size: 16, seed: 1, shard_size: 4, family_size: 2, test_classes: 3"
    prepare_data(load_config(None, [f"data.shards={tmp_path / 'cfg'}", f"data.synthetic={{{keys}}}"]))
    c = Manifest.load(tmp_path / "cfg")
    assert c.data["options"] == b.data["options"]
    assert [s.sha256 for s in c.split("test").shards] == [s.sha256 for s in test.shards]
    other = load_config(
        None, [f"data.shards={tmp_path / 'few'}", f"data.synthetic={{{keys}}}", "data.synthetic.test_classes=4"]
    )
    with pytest.raises(UserError) as err:
        prepare_data(other)
    assert "\n" not in str(err.value) and "test_classes=3 (asked: 4)" in str(err.value), str(err.value)
    unset = keys.replace(", test_classes: 3", "")  # as many test classes as the shards' 5 train classes
    with pytest.raises(UserError) as err:
        prepare_data(load_config(None, [f"data.shards={tmp_path / 'few'}", f"data.synthetic={{{unset}}}"]))
    message = str(err.value)
    assert "\n" not in message and str(tmp_path / "few") in message, message
    assert "test_classes=3 (asked: unset, as many as its 5 train classes)" in message, message
    prepare_data(load_config(None, [f"data.shards={tmp_path / 'all'}", f"data.synthetic={{{unset}}}"]))
    # a study's other class count (7 here) builds a folder of its own: its test classes are its own train count's
    prepare_data(
        load_config(None, [f"data.shards={tmp_path / 'all'}", f"data.synthetic={{{unset.replace('5', '7', 1)}}}"])
    )

    with pytest.raises(ConfigError) as err:
        load_config(None, ["data.synthetic={}", "data.synthetic.test_classes=1"])
    assert "\n" not in str(err.value) and "data.synthetic.test_classes: must be 2 to" in str(err.value)
    capsys.readouterr()
    build = ["shards", "build", "--layout", "synthetic", "--out", str(tmp_path / "bad"), "--quiet", "--classes", "4"]
    assert main([*build, "--per-class", "1", "--test-classes", "1"]) == 2
    assert "--test-classes: must be 2 to" in capsys.readouterr().err
    per_class = MAX_SYNTHETIC_IMAGES // MAX_SYNTHETIC_CLASSES + 1
    assert main([*build, "--per-class", str(per_class), "--test-classes", str(MAX_SYNTHETIC_CLASSES)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--test-classes:" in err and f"test classes x {per_class} images" in err, err
    assert not (tmp_path / "bad").exists()
