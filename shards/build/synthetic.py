"""Procedurally generated, learnable images with disjoint train and test classes.

A class is an *object*: two or three coloured parts (disc, square, triangle, star, cross,
ring, diamond, half-disc) with fixed shapes, colours, sizes and relative placement, all
drawn from a generator seeded by (seed, class). Each image shows the object at a random
position, scale and rotation, with per-part jitter, over a random two-colour gradient
background with random distractor shapes, then global brightness change, Gaussian noise
and JPEG compression. The class lives in the configuration of parts, not in low-level
colour statistics, so an untrained network retrieves poorly and a trained one learns it.

Train classes are numbered ``0..C-1`` and test classes ``C..2C-1`` (as many as train, the
same images per class); images are pure functions of (seed, class, image), so a build is
reproducible and generation parallelises trivially. About 0.3 ms per 64-px image on one
core: SOP scale (11,318 classes × 5 images, twice) takes a couple of minutes on two cores.

*Class families* (``family_size`` F > 1) make classes confusable: consecutive classes of a split
form families of F (the last one smaller when F does not divide C; test families are their own,
disjoint from the train ones). A family's classes (*siblings*) share one base object, the object
class ``c0`` would have on its own (``c0`` the family's first class), and each sibling nudges
every part of it: colour, centre, size, aspect and angle move by an offset whose direction is
drawn from (seed, class) and whose size is ``family_spread`` times :data:`NUDGE` (per attribute,
root mean square), so every sibling lies as far from the base as any other. Per-image jitter
(colour σ 12, centre σ 0.06, size ±10 %, angle σ 0.1) is about a third of a spread-1 nudge:
spread 1 is an easy fine-grained task, 0.5 (the default) a hard one, 0 makes siblings the same object.
F = 1 gives every class its own object: the images of builds before families existed.

*Label noise* (``label_noise`` p) gives round(p·N) of the N train images, drawn without
replacement from the seed, the label of another class: uniformly among all other train classes
(``uniform``), or among the other classes of the image's family (``family``). The image is still
drawn from its true class; its metadata holds the ``clean_label``, and the manifest lists the
relabelled samples (:attr:`shards.manifest.SplitInfo.clean_labels`). Test labels are never noisy.
"""

from __future__ import annotations

import functools
import io
import math
import os
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageDraw

from dmltrain.errors import UserError
from shards.build.builder import build_shards
from shards.build.layouts import Entry, Layout
from shards.config import MAX_IMAGE_SIDE, SyntheticData, synthetic_problem, synthetic_size_problem
from shards.manifest import Manifest

JPEG_QUALITY = 90
#: a spread-1 sibling's nudge of each part, per attribute (root mean square over siblings): RGB colour per
#: channel, centre per axis in object units (the object spans about [-1, 1]), size and aspect as log factors,
#: angle in radians
NUDGE = {"color": 40.0, "center": 0.15, "size": 0.15, "aspect": 0.15, "angle": 0.3}


def _unit_polygon(kind: str) -> np.ndarray:
    """Vertices (n×2) of a shape inscribed in the unit disc."""
    t = np.linspace(0, 2 * np.pi, 24, endpoint=False)
    if kind in ("disc", "ring"):
        return np.stack([np.cos(t), np.sin(t)], 1)
    if kind == "half":
        a = np.linspace(0, np.pi, 13)
        return np.stack([np.cos(a), np.sin(a) - 0.3], 1)
    if kind == "square":
        return np.array([[-1, -1], [1, -1], [1, 1], [-1, 1]], float) * 0.8
    if kind == "diamond":
        return np.array([[0, -1], [0.6, 0], [0, 1], [-0.6, 0]], float)
    if kind == "triangle":
        a = np.pi / 2 + np.arange(3) * 2 * np.pi / 3
        return np.stack([np.cos(a), np.sin(a)], 1)
    if kind == "star":
        a = np.pi / 2 + np.arange(10) * np.pi / 5
        r = np.where(np.arange(10) % 2 == 0, 1.0, 0.42)
        return np.stack([r * np.cos(a), r * np.sin(a)], 1)
    if kind == "cross":
        w = 0.33
        return np.array(
            [
                [-w, -1],
                [w, -1],
                [w, -w],
                [1, -w],
                [1, w],
                [w, w],
                [w, 1],
                [-w, 1],
                [-w, w],
                [-1, w],
                [-1, -w],
                [-w, -w],
            ],
            float,
        )
    raise ValueError(kind)


SHAPES = ("disc", "ring", "half", "square", "diamond", "triangle", "star", "cross")
_POLYGONS = {k: _unit_polygon(k) for k in SHAPES}


def _hsv_to_rgb(h: float, s: float, v: float) -> np.ndarray:
    i = int(h * 6) % 6
    f = h * 6 - int(h * 6)
    p, q, t = v * (1 - s), v * (1 - f * s), v * (1 - (1 - f) * s)
    return np.array([(v, t, p), (q, v, p), (p, v, t), (p, q, v), (t, p, v), (v, p, q)][i]) * 255


@dataclass(frozen=True)
class Part:
    shape: str
    color: np.ndarray  # RGB 0..255
    center: np.ndarray  # in object units (the object spans about [-1, 1])
    size: float
    aspect: float
    angle: float


@functools.lru_cache(maxsize=4096)
def class_parts(seed: int, class_index: int) -> tuple[Part, ...]:
    """The object that defines class ``class_index`` (a pure function of the seed and the class)."""
    rng = np.random.default_rng([seed, class_index, 0xC1A55])
    n = int(rng.integers(2, 4))
    parts = []
    for k in range(n):
        color = _hsv_to_rgb(rng.random(), rng.uniform(0.55, 1.0), rng.uniform(0.55, 1.0))
        center = rng.uniform(-0.55, 0.55, 2) if k else rng.uniform(-0.15, 0.15, 2)
        shape = SHAPES[int(rng.integers(len(SHAPES)))]
        parts.append(
            Part(
                shape,
                color,
                center,
                float(rng.uniform(0.3, 0.6)),
                float(rng.uniform(0.6, 1.5)),
                float(rng.uniform(0, 2 * np.pi)),
            )
        )
    return tuple(parts)


@functools.lru_cache(maxsize=4096)
def sibling_parts(seed: int, class_index: int, family_base: int, spread: float) -> tuple[Part, ...]:
    """The object of class ``class_index`` in the family whose base object is ``class_parts(seed, family_base)``:
    every part nudged by ``spread`` × :data:`NUDGE` in a direction drawn from (seed, class)."""
    rng = np.random.default_rng([seed, class_index, 0xFA311])
    parts = []
    for p in class_parts(seed, family_base):
        g = rng.standard_normal(8)
        u = g * (np.sqrt(len(g)) / np.linalg.norm(g)) * spread  # a fixed length: every sibling as far from the base
        parts.append(
            Part(
                p.shape,
                np.clip(p.color + NUDGE["color"] * u[:3], 0, 255),
                p.center + NUDGE["center"] * u[3:5],
                p.size * math.exp(NUDGE["size"] * u[5]),
                p.aspect * math.exp(NUDGE["aspect"] * u[6]),
                p.angle + NUDGE["angle"] * u[7],
            )
        )
    return tuple(parts)


@dataclass(frozen=True)
class Families:
    """How ``classes`` train classes (``0..C-1``) and ``test_classes`` test classes (``C..C+T-1``; None: as many
    as train) group into families of ``size``: consecutive classes of a split, the last family of each split
    smaller when ``size`` does not divide the split's classes."""

    classes: int
    size: int = 1
    test_classes: int | None = None

    @property
    def tests(self) -> int:
        return self.classes if self.test_classes is None else self.test_classes

    @property
    def per_split(self) -> int:
        return -(-self.classes // self.size)

    def family(self, class_index: int) -> int:
        """Family id: train families are ``0..n-1``, test families ``n..2n-1`` (n = :attr:`per_split`)."""
        if class_index < self.classes:
            return class_index // self.size
        return self.per_split + (class_index - self.classes) // self.size

    def members(self, class_index: int) -> range:
        """The classes of ``class_index``'s family, itself included."""
        first, n = (0, self.classes) if class_index < self.classes else (self.classes, self.tests)
        start = first + (class_index - first) // self.size * self.size
        return range(start, min(start + self.size, first + n))


def object_parts(seed: int, class_index: int, family_base: int | None = None, spread: float = 0.0) -> tuple[Part, ...]:
    """A class's object: its own (``family_base`` None), or its family's base object nudged (:func:`sibling_parts`)."""
    if family_base is None:
        return class_parts(seed, class_index)
    return sibling_parts(seed, class_index, family_base, spread)


def _transform(poly: np.ndarray, center, scale: float, aspect: float, angle: float) -> np.ndarray:
    c, s = math.cos(angle), math.sin(angle)
    p = poly * np.array([scale * aspect, scale / aspect])
    return p @ np.array([[c, s], [-s, c]]) + center


@functools.lru_cache(maxsize=8)
def _ramp(size: int) -> np.ndarray:
    return np.linspace(-1, 1, size, dtype=np.float32)


@functools.lru_cache(maxsize=8)
def _noise(size: int) -> np.ndarray:
    """Gaussian noise (sigma 6) on a field twice the image size; images take random windows of it."""
    return np.random.default_rng(size).standard_normal((2 * size, 2 * size, 3), dtype=np.float32) * np.float32(6)


def render(
    seed: int, class_index: int, image_index: int, size: int, family_base: int | None = None, spread: float = 0.0
) -> Image.Image:
    """One RGB image of class ``class_index`` (a pure function of its arguments); ``family_base`` and ``spread``
    make it a sibling of a family (:func:`object_parts`)."""
    parts = object_parts(seed, class_index, family_base, spread)
    rng = np.random.default_rng([seed, class_index, image_index, 0x1A6E])
    # background: a random two-colour linear gradient
    c1 = np.minimum(np.maximum(rng.uniform(30, 225) + rng.normal(0, 18, 3), 0), 255).astype(np.float32)
    c2 = np.minimum(np.maximum(rng.uniform(30, 225) + rng.normal(0, 18, 3), 0), 255).astype(np.float32)
    a = rng.uniform(0, 2 * np.pi)
    ramp = _ramp(size)
    ca, sa = np.cos(a), np.sin(a)
    g = (np.float32(ca) * ramp[None, :] + np.float32(sa) * ramp[:, None]) * np.float32(
        0.5 / (abs(ca) + abs(sa))
    ) + np.float32(0.5)
    img = Image.fromarray((c1 + (c2 - c1) * g[..., None]).astype(np.uint8), "RGB")  # in [0, 255] by construction
    draw = ImageDraw.Draw(img)
    width = max(1, round(size * 0.05))
    # distractors: small outlined shapes in random colours, behind the object
    for _ in range(int(rng.integers(0, 3))):
        kind = SHAPES[int(rng.integers(len(SHAPES)))]
        pts = _transform(
            _POLYGONS[kind], rng.uniform(0, size, 2), size * rng.uniform(0.05, 0.12), 1.0, rng.uniform(0, 2 * np.pi)
        )
        draw.polygon([tuple(p) for p in pts], outline=tuple(int(v) for v in rng.uniform(0, 255, 3)), width=1)
    # the object, with a random similarity transform and per-part jitter
    center = size / 2 + rng.normal(0, 0.07 * size, 2)
    scale = size * 0.33 * rng.uniform(0.85, 1.15)
    rot = rng.normal(0, 0.3)
    cr, sr = math.cos(rot), math.sin(rot)
    R = np.array([[cr, sr], [-sr, cr]])
    for part in parts:
        pc = (part.center + rng.normal(0, 0.06, 2)) @ R * scale + center
        size_jitter, angle_jitter = rng.uniform(0.9, 1.1), rng.normal(0, 0.1)
        pts = _transform(
            _POLYGONS[part.shape], pc, scale * part.size * size_jitter, part.aspect, part.angle + rot + angle_jitter
        )
        color = tuple(int(v) for v in np.clip(part.color + rng.normal(0, 12, 3), 0, 255))
        xy = [tuple(p) for p in pts]
        if part.shape == "ring":
            draw.polygon(xy, outline=color, width=width)
        else:
            draw.polygon(xy, fill=color)
    arr = np.asarray(img, dtype=np.float32) * np.float32(rng.uniform(0.8, 1.2))
    oy, ox = rng.integers(0, size, 2)
    arr += _noise(size)[oy : oy + size, ox : ox + size]  # a random window of a fixed noise field: cheap
    np.maximum(arr, 0, out=arr)
    np.minimum(arr, 255, out=arr)
    return Image.fromarray(arr.astype(np.uint8), "RGB")


Job = tuple[int, int, int, int, int | None, float]


def render_jpeg(job: Job) -> tuple[bytes, str]:
    """``(seed, class, image, size, family base, spread) -> (JPEG bytes, 'jpg')``: the build's per-image job."""
    out = io.BytesIO()
    render(*job).save(out, format="JPEG", quality=JPEG_QUALITY)
    return out.getvalue(), "jpg"


def noisy_labels(
    seed: int, families: Families, per_class: int, label_noise: float, mode: str = "uniform"
) -> dict[int, int]:
    """Train sample number (``class * per_class + image``) -> the wrong class it is labelled with.

    round(p·N) of the N train samples, drawn without replacement; each gets another class drawn uniformly
    among all train classes but its own (``uniform``) or among its family's other classes (``family``)."""
    n = families.classes * per_class
    flips = round(label_noise * n)
    if flips == 0:
        return {}
    rng = np.random.default_rng([seed, 0x401CE])
    chosen = np.sort(rng.choice(n, flips, replace=False))
    true = chosen // per_class
    if mode == "uniform":
        other = rng.integers(0, families.classes - 1, flips)
        other += other >= true  # skips the true class: uniform over the C - 1 others
    else:
        other = np.empty_like(true)
        draws = rng.random(flips)
        for k, (c, u) in enumerate(zip(true.tolist(), draws.tolist())):
            siblings = [m for m in families.members(c) if m != c]  # never empty: synthetic_problem refuses that
            other[k] = siblings[int(u * len(siblings))]
    return dict(zip(chosen.tolist(), other.tolist()))


def synthetic_layout(
    classes: int,
    per_class: int,
    image_size: int,
    seed: int,
    *,
    family_size: int = 1,
    family_spread: float = 0.5,
    label_noise: float = 0.0,
    label_noise_mode: str = "uniform",
    test_classes: int | None = None,
) -> tuple[Layout, dict[str, list[Job]]]:
    """The layout (train classes ``0..C-1``, test ``C..C+T-1`` with T = ``test_classes`` or C, their families,
    the noisy train labels) and each entry's render job."""
    families = Families(classes, family_size, test_classes)
    wrong = noisy_labels(seed, families, per_class, label_noise, label_noise_mode) if label_noise > 0 else None
    splits, jobs = {}, {}
    for split, first, n in (("train", 0, classes), ("test", classes, families.tests)):
        entries, js = [], []
        for c in range(first, first + n):
            base = families.members(c).start if family_size > 1 else None
            for i in range(per_class):
                rel = f"synthetic/{c:06d}/{i:04d}.jpg"
                if wrong is None or split != "train":
                    entries.append(Entry(rel, str(c), rel))
                else:
                    entries.append(Entry(rel, str(wrong.get(c * per_class + i, c)), rel, clean_class_id=str(c)))
                js.append((seed, c, i, image_size, base, float(family_spread) if base is not None else 0.0))
        splits[split], jobs[split] = entries, js
    by_class = {str(c): families.family(c) for c in range(classes + families.tests)} if family_size > 1 else None
    return Layout("synthetic", "synthetic", splits, families=by_class), jobs


def family_options(family_size: int, family_spread: float, label_noise: float, label_noise_mode: str) -> dict:
    """The family and noise options as a manifest records them (``options.synthetic``): only those that change
    the build (without families and noise, none: the manifest of builds before they existed)."""
    out: dict = {}
    if family_size > 1:
        out.update(family_size=family_size, family_spread=family_spread)
    if label_noise > 0:
        out.update(label_noise=label_noise, label_noise_mode=label_noise_mode)
    return out


def check_built_as(manifest: Manifest, s: SyntheticData) -> None:
    """Refuse synthetic shards built with another test class count, other families or label noise than
    ``data.synthetic`` asks for.

    Shards are built only when missing, so changing ``data.synthetic.family_size`` (say) over an existing folder
    would otherwise train on the old task unawares. A manifest without these options was built without them. An
    unset ``test_classes`` asks for as many test classes as the shards' own train classes (what a build without
    it makes; a study's other class counts are builds of their own)."""
    recorded = manifest.data.get("options", {}).get("synthetic")
    if manifest.layout != "synthetic" or not isinstance(recorded, dict):
        return
    train = recorded.get("classes")
    built = recorded.get("test_classes", train)
    if built != (train if s.test_classes is None else s.test_classes):
        asked = f"unset, as many as its {train} train classes" if s.test_classes is None else s.test_classes
        raise UserError(
            f"data.synthetic: {manifest.root} holds synthetic shards built with test_classes={built} (asked: "
            f"{asked}); shards are built only when missing: remove the folder or point data.shards elsewhere"
        )
    asked = s.model_dump(include={"family_size", "family_spread", "label_noise", "label_noise_mode"})
    built = {"family_size": 1, "label_noise": 0.0} | {k: recorded[k] for k in asked if k in recorded}
    want, have = family_options(**asked), family_options(**{**asked, **built})
    if have != want:
        differ = ", ".join(  # a key the build did not record (a spread without families) is implied by another
            f"{k}={built[k]} (asked: {asked[k]})"
            for k in asked
            if have.get(k) != want.get(k) and k in built and built[k] != asked[k]
        )
        raise UserError(
            f"data.synthetic: {manifest.root} holds synthetic shards built with {differ}; shards are built only when "
            "missing: remove the folder or point data.shards elsewhere"
        )


def build_from_config(
    out_dir: str | os.PathLike[str], s: SyntheticData, *, classes: int | None = None, progress: bool = True
):
    """Build the shards ``data.synthetic`` describes in ``out_dir`` (``classes``: another train class count, as
    a study's ``--classes`` asks; the test classes stay ``s.test_classes``); see :func:`build_synthetic_shards`."""
    return build_synthetic_shards(
        out_dir,
        classes=s.classes if classes is None else classes,
        per_class=s.per_class,
        image_size=s.image_size,
        seed=s.seed,
        shard_size=s.shard_size,
        overwrite=False,
        progress=progress,
        family_size=s.family_size,
        family_spread=s.family_spread,
        label_noise=s.label_noise,
        label_noise_mode=s.label_noise_mode,
        test_classes=s.test_classes,
    )


def build_synthetic_shards(
    out_dir: str | os.PathLike[str],
    classes: int,
    per_class: int,
    image_size: int,
    seed: int,
    shard_size: int = 2000,
    overwrite: bool = False,
    *,
    workers: int | None = None,
    progress: bool = True,
    resume: bool = False,
    storage_options: dict | None = None,
    family_size: int = 1,
    family_spread: float = 0.5,
    label_noise: float = 0.0,
    label_noise_mode: str = "uniform",
    exclude: str | os.PathLike[str] | None = None,
    test_classes: int | None = None,
):
    """Write synthetic train and test shards (``classes`` train classes and ``test_classes`` disjoint test
    classes, as many when None; ``per_class`` images per class),
    in families of ``family_size`` classes ``family_spread`` apart, with ``label_noise`` of the train labels wrong,
    without the images whose paths ``exclude`` lists (:mod:`shards.build.exclude`).

    Same as ``dmltrain shards build --layout synthetic``; returns the :class:`~shards.build.builder.BuildResult`.
    A bad value is a :class:`UserError` naming the command-line option.
    """

    for name, value, low in (("--classes", classes, 1), ("--per-class", per_class, 1), ("--image-size", image_size, 8)):
        if value is None or value < low:
            raise UserError(f"{name}: must be at least {low} for --layout synthetic, got {value}")
    if image_size > MAX_IMAGE_SIDE:
        raise UserError(f"--image-size: at most {MAX_IMAGE_SIDE} pixels, got {image_size}")
    problem = synthetic_problem(classes, family_size, family_spread, label_noise, label_noise_mode)
    problem = problem or synthetic_size_problem(classes, per_class, test_classes)
    if problem is not None:
        raise UserError(f"--{problem[0].replace('_', '-')}: {problem[1]}")
    options = {"classes": classes, "per_class": per_class, "image_size": image_size, "seed": seed}
    if test_classes is not None and test_classes != classes:  # builds without it hold as many test classes
        options["test_classes"] = test_classes
    options.update(family_options(family_size, family_spread, label_noise, label_noise_mode))
    layout, jobs = synthetic_layout(
        classes,
        per_class,
        image_size,
        seed,
        family_size=family_size,
        family_spread=family_spread,
        label_noise=label_noise,
        label_noise_mode=label_noise_mode,
        test_classes=test_classes,
    )
    if label_noise > 0:
        options["relabelled"] = sum(e.clean_class_id != e.class_id for e in layout.splits["train"])
    return build_shards(
        out_dir,
        layout,
        load=render_jpeg,
        args=jobs,
        shard_size=shard_size,
        seed=seed,
        workers=workers,
        overwrite=overwrite,
        progress=progress,
        resume=resume,
        storage_options=storage_options,
        options={"synthetic": options},
        exclude=exclude,
    )
