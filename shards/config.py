"""The ``data`` section of a run config: where the shards are, how batches are drawn, decoded and augmented.

:mod:`shards` owns these types, so that reading and decoding shards needs no run config and the import runs one
way: :mod:`dmltrain.config` builds the whole run config from them. :class:`Section` is the base of every config
section, here and there.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from shards.storage.location import RemoteSettings, check_storage_options

_REMOTE = RemoteSettings()
# torchvision's ImageNet normalization: the input of the torchvision backbones (timm models bring their own)
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
#: the largest side, in pixels, of a crop, a resize or a generated image: far above any recipe (224-518), and a
#: bound on what one decoded batch can ask of memory (a typo such as 1000000 would otherwise spin the loaders)
MAX_IMAGE_SIDE = 4096
#: the most classes (per split) and images (per split: classes x per_class) a synthetic set may have: a million
#: classes is the project's largest label space, and two million images per split take about 1.3 GB to plan
#: (each image is listed before any is drawn); ``classes=100000000`` would exhaust memory before the first image
MAX_SYNTHETIC_CLASSES = 1_000_000
MAX_SYNTHETIC_IMAGES = 2_000_000


class Section(BaseModel):
    """Base of every config section: unknown keys are errors, assignments are re-validated, and every
    number must be finite (``optim.lr=.inf`` or ``.nan`` is refused, never trained with)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


LABEL_NOISE_MODES = ("uniform", "family")


def synthetic_problem(
    classes: int, family_size: int, family_spread: float, label_noise: float, label_noise_mode: str
) -> tuple[str, str] | None:
    """The first problem of a synthetic build's size, family and noise options, as ``(option, message)`` (the
    option's snake-case name, which the CLI and the config spell their own way), or None when they are fine."""
    if classes > MAX_SYNTHETIC_CLASSES:
        return "classes", f"at most {MAX_SYNTHETIC_CLASSES:,} classes (per split), got {classes:,}"
    if not (isinstance(family_size, int) and family_size >= 1):
        return "family_size", f"must be a whole number of classes, at least 1, got {family_size}"
    if family_size > classes:
        return "family_size", f"{family_size} is more than the {classes} classes (a family groups classes of a split)"
    if not 0.0 <= family_spread <= 1.0:  # NaN fails both comparisons
        return "family_spread", f"must be in [0, 1] (0: siblings are the same object), got {family_spread}"
    if not 0.0 <= label_noise < 1.0:
        return "label_noise", f"must be in [0, 1) (the share of train images relabelled), got {label_noise}"
    if label_noise_mode not in LABEL_NOISE_MODES:
        return "label_noise_mode", f"must be one of {', '.join(LABEL_NOISE_MODES)}, got {label_noise_mode!r}"
    if label_noise > 0 and classes < 2:
        return "label_noise", "needs at least 2 classes (a label is flipped to another class)"
    if label_noise > 0 and label_noise_mode == "family":
        if family_size < 2:
            return "label_noise_mode", "family flips a label to a sibling class: needs a family size of at least 2"
        if classes % family_size == 1:
            return (
                "label_noise_mode",
                f"family: the last family of {classes} classes in families of {family_size} has one class, "
                "whose labels could not be flipped to a sibling (choose a family size that leaves no single class)",
            )
    return None


def synthetic_size_problem(classes: int, per_class: int, test_classes: int | None = None) -> tuple[str, str] | None:
    """``(option, message)`` when a split would hold more than :data:`MAX_SYNTHETIC_IMAGES` images, or
    ``test_classes`` (None: as many as ``classes``) is not 2 to :data:`MAX_SYNTHETIC_CLASSES`; else None."""
    if test_classes is not None:
        if not 2 <= test_classes <= MAX_SYNTHETIC_CLASSES:
            return "test_classes", f"must be 2 to {MAX_SYNTHETIC_CLASSES:,} classes, got {test_classes:,}"
        if test_classes * per_class > MAX_SYNTHETIC_IMAGES:
            return (
                "test_classes",
                f"{test_classes:,} test classes x {per_class:,} images = {test_classes * per_class:,} images, more "
                f"than the {MAX_SYNTHETIC_IMAGES:,} a synthetic split may have",
            )
    if classes * per_class > MAX_SYNTHETIC_IMAGES:
        return (
            "per_class",
            f"{classes:,} classes x {per_class:,} images = {classes * per_class:,} images per split, more than the "
            f"{MAX_SYNTHETIC_IMAGES:,} a synthetic set may have",
        )
    return None


class SyntheticData(Section):
    """Procedurally generated shards, built on first use when ``data.shards`` is missing."""

    classes: int = Field(
        200, ge=2, le=MAX_SYNTHETIC_CLASSES, description="train classes (the test classes are others: test_classes)"
    )
    per_class: int = Field(10, ge=1, le=MAX_SYNTHETIC_IMAGES, description="images per class")
    test_classes: int | None = Field(
        None,
        description="test classes (none: as many as train classes); fewer keep the evaluation of a large "
        "label space affordable (retrieval over the test split grows with its square), the same for every "
        "class count of a study",
    )
    image_size: int = Field(32, ge=8, le=MAX_IMAGE_SIDE)
    seed: int = 0
    shard_size: int = Field(2000, ge=1, description="samples per shard")
    family_size: int = Field(
        1,
        ge=1,
        description="classes per family: siblings share one object and differ slightly (1: every class its own "
        "object, the images of earlier versions); a split's last family is smaller when this does not divide classes",
    )
    family_spread: float = Field(
        0.5,
        ge=0.0,
        le=1.0,
        description="how different siblings are: 0 the same object, 1 clearly different colours, sizes, placement",
    )
    label_noise: float = Field(
        0.0, ge=0.0, lt=1.0, description="share of train images given another class's label (test labels never)"
    )
    label_noise_mode: Literal["uniform", "family"] = Field(
        "uniform", description="the wrong label: any other class (uniform), or another class of the same family"
    )

    @model_validator(mode="after")
    def _check(self) -> SyntheticData:
        problem = synthetic_problem(
            self.classes, self.family_size, self.family_spread, self.label_noise, self.label_noise_mode
        ) or synthetic_size_problem(self.classes, self.per_class, self.test_classes)
        if problem is not None:
            raise ValueError(f"data.synthetic.{problem[0]}: {problem[1]}")
        return self


class ColorJitter(Section):
    """torchvision's ``ColorJitter``: brightness, contrast and saturation factors uniform in
    [max(0, 1 - x), 1 + x], a hue shift uniform in [-hue, hue], applied in a random order.

    A number ``j`` stands for brightness = contrast = saturation = ``j``; a list for
    ``[brightness, contrast, saturation(, hue)]``.
    """

    brightness: float = Field(0.0, ge=0.0)
    contrast: float = Field(0.0, ge=0.0)
    saturation: float = Field(0.0, ge=0.0)
    hue: float = Field(0.0, ge=0.0, le=0.5)

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, v: Any) -> Any:
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return {"brightness": v, "contrast": v, "saturation": v}
        if isinstance(v, (list, tuple)) and len(v) in (3, 4):
            return dict(zip(("brightness", "contrast", "saturation", "hue"), v))
        return v


class RandomErasing(Section):
    """torchvision's ``RandomErasing`` (value 0: the mean colour after normalization); a number stands for ``p``."""

    p: float = Field(0.0, ge=0.0, le=1.0, description="probability of erasing a rectangle; 0 disables")
    scale: tuple[float, float] = Field((0.02, 0.33), description="area range of the rectangle, as a share of the image")
    ratio: tuple[float, float] = Field((0.3, 3.3), description="aspect ratio range of the rectangle")

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, v: Any) -> Any:
        return {"p": v} if isinstance(v, (int, float)) and not isinstance(v, bool) else v

    @model_validator(mode="after")
    def _check(self) -> RandomErasing:
        _check_range("data.augment.erase.scale", self.scale, upper=1.0)
        _check_range("data.augment.erase.ratio", self.ratio)
        return self


def _check_range(key: str, pair: tuple[float, float], upper: float | None = None) -> None:
    lo, hi = pair
    if not (0 < lo <= hi and (upper is None or hi <= upper)):
        bound = f" <= {upper:g}" if upper is not None else ""
        raise ValueError(f"{key}: need 0 < low <= high{bound}, got {list(pair)}")


class RandAugment(Section):
    """torchvision's ``RandAugment``: ``ops`` operations per image, each drawn uniformly from its 14 (identity,
    shear x/y, translate x/y, rotate, brightness, colour, contrast, sharpness, posterize, solarize, autocontrast,
    equalize) at ``magnitude`` out of ``bins`` levels, a signed operation's sign a coin flip, geometric ones filled
    black. A number ``n`` stands for ``ops = n`` at the default magnitude; ``[n, m]`` for ops and magnitude.
    """

    ops: int = Field(0, ge=0, le=8, description="operations per image; 0 disables (timm's rand-m9-n2: ops 2)")
    magnitude: int = Field(9, ge=0, description="strength, 0 .. bins - 1 (timm's rand-m9: 9)")
    bins: int = Field(31, ge=2, le=256, description="magnitude levels (torchvision's num_magnitude_bins)")

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, v: Any) -> Any:
        if isinstance(v, int) and not isinstance(v, bool):
            return {"ops": v}
        if isinstance(v, (list, tuple)) and len(v) == 2:
            return {"ops": v[0], "magnitude": v[1]}
        return v

    @model_validator(mode="after")
    def _check(self) -> RandAugment:
        if self.magnitude >= self.bins:
            raise ValueError(f"data.augment.randaugment.magnitude: {self.magnitude} is not below bins ({self.bins})")
        return self


class AugmentConfig(Section):
    """Training augmentation, with torchvision's names and semantics; evaluation only resizes and centre-crops
    (``data.eval_resize``, ``data.eval_crop``), converted to grayscale when ``grayscale`` is set.

    Order: ``resize`` (the frame the crop is drawn in) -> ``rotation`` -> RandomResizedCrop (``scale``,
    ``ratio``) to ``data.image_size`` -> ``flip`` -> ``randaugment`` -> ``color_jitter`` -> ``grayscale`` ->
    normalization -> ``erase`` -> ``noise``. Every random choice is drawn from (train.seed, epoch, step, the
    image's place in the step's global batch), whichever worker takes it.
    """

    resize: int | tuple[int, int] | None = Field(
        None, description="Resize before the crop: a number sets the shorter side, [h, w] the size (e.g. [256, 256])"
    )
    scale: tuple[float, float] = Field((0.08, 1.0), description="RandomResizedCrop area range")
    ratio: tuple[float, float] = Field((3 / 4, 4 / 3), description="RandomResizedCrop aspect ratio range")
    flip: float = Field(0.5, ge=0.0, le=1.0, description="horizontal flip probability")
    rotation: float | tuple[float, float] = Field(
        0.0, description="RandomRotation degrees: a number d for [-d, d], or [min, max]; 0 disables"
    )
    color_jitter: ColorJitter = Field(default_factory=ColorJitter)
    grayscale: Literal[0, 1, 3] = Field(
        0, description="0: colour; 1 or 3: luminance as 1 or 3 channels, in training and evaluation"
    )
    noise: float = Field(0.0, ge=0.0, description="std of Gaussian noise added to the normalized pixels; 0 disables")
    erase: RandomErasing = Field(default_factory=RandomErasing)
    randaugment: RandAugment = Field(
        default_factory=RandAugment,
        description="RandAugment after the crop and flip: {ops, magnitude, bins}, or ops alone; CPU decoding only",
    )

    @model_validator(mode="after")
    def _check(self) -> AugmentConfig:
        _check_range("data.augment.scale", self.scale, upper=1.0)
        _check_range("data.augment.ratio", self.ratio)
        sizes = (self.resize,) if isinstance(self.resize, int) else self.resize or ()
        if any(not 8 <= s <= MAX_IMAGE_SIDE for s in sizes):
            raise ValueError(f"data.augment.resize: sizes must be in [8, {MAX_IMAGE_SIDE}], got {self.resize}")
        lo, hi = self.rotation_range
        if not -180 <= lo <= hi <= 180:
            raise ValueError(f"data.augment.rotation: need -180 <= min <= max <= 180 degrees, got {self.rotation}")
        return self

    @property
    def rotation_range(self) -> tuple[float, float]:
        """(min, max) rotation in degrees, counter-clockwise."""
        r = self.rotation
        return (-abs(r), abs(r)) if isinstance(r, (int, float)) else (float(r[0]), float(r[1]))

    def cpu_only(self) -> str | None:
        """The option that the device path does not apply (``rotation``, ``randaugment``), or None."""
        if self.rotation_range != (0.0, 0.0):
            return "rotation"
        if self.randaugment.ops:
            return "randaugment"
        return None


class RemoteConfig(Section):
    """Reading shards from a URL (``data.shards`` = ``s3://``, ``gs://``, ``https://``, ...); local paths ignore it."""

    requests_in_flight: int = Field(
        _REMOTE.requests_in_flight, ge=1, le=1024, description="ranged GETs in flight per loader process"
    )
    request_mb: float = Field(
        _REMOTE.request_mb, gt=0, le=1024, description="largest ranged GET; with requests_in_flight, the memory bound"
    )
    timeout_s: float = Field(_REMOTE.timeout_s, gt=0, description="time limit of one request; past it, it is retried")
    retries: int = Field(
        _REMOTE.retries,
        ge=0,
        le=100,
        description="retries after a timeout, 5xx, throttling, dropped or truncated response",
    )
    cache: bool = Field(
        _REMOTE.cache, description="keep whole shards on local disk (remote URLs only; local paths are never cached)"
    )
    cache_dir: str = Field(_REMOTE.cache_dir, description="the shard cache, shared by the processes of a machine")
    cache_gb: float = Field(
        _REMOTE.cache_gb, gt=0, description="size bound of the cache; least recently used shards go first"
    )


class DataConfig(Section):
    shards: str = Field(
        "data/synthetic-200",
        description="folder holding manifest.json and the tar shards: a path or a URL (s3://, gs://, https://)",
    )
    storage_options: dict[str, Any] = Field(
        default_factory=dict,
        description="fsspec options of a URL: endpoint_url, anon, client_kwargs.region_name, ...; credentials come from the environment",
    )
    remote: RemoteConfig = Field(default_factory=RemoteConfig)
    train_split: str = "train"
    eval_splits: list[str] = Field(
        default_factory=lambda: ["test"], description="['test'], or ['query', 'gallery'] for In-Shop"
    )
    sampler: Literal["pk", "random"] = Field("pk", description="class-balanced P×K batches, or plain random batches")
    batch_size: int = Field(64, ge=1, description="global batch over all workers")
    classes_per_batch: int | None = Field(
        None, ge=1, description="P; derived as batch_size // samples_per_class when unset"
    )
    samples_per_class: int = Field(4, ge=1, description="K images of each class in a P×K batch")
    image_size: int = Field(
        224, ge=8, le=MAX_IMAGE_SIDE, description=f"train crop (RandomResizedCrop), at most {MAX_IMAGE_SIDE}"
    )
    augment: AugmentConfig = Field(default_factory=AugmentConfig)
    eval_resize: int = Field(256, ge=8, le=MAX_IMAGE_SIDE)
    eval_crop: int = Field(224, ge=8, le=MAX_IMAGE_SIDE)
    loader_workers: int = Field(2, ge=0, description="decoding processes per training worker")
    decode: Literal["auto", "cpu", "device"] = Field(
        "auto",
        description="train images: decoded and augmented in the loader processes (cpu), or handed over encoded and "
        "decoded on the worker's device (device: nvJPEG on GPUs); auto: device on GPU workers unless data.augment.rotation. "
        "Same crops, flips and factors either way; device always decodes at full resolution, while cpu decodes a JPEG "
        "at 1/2-1/8 scale (draft) when its crop box is at least twice data.image_size both ways, so those pixels differ "
        "by resampling detail",
    )
    eval_batch_size: int = Field(128, ge=1)
    mean: tuple[float, float, float] | None = Field(
        None,
        description="per-channel mean of the normalization, training and evaluation; None: the backbone's own "
        "(its pretrained config: timm's mean, ImageNet's for the torchvision backbones), filled in by the run config",
    )
    std: tuple[float, float, float] | None = Field(
        None, description="per-channel std of the normalization; None: the backbone's own, as data.mean"
    )
    interpolation: Literal["bilinear", "bicubic"] | None = Field(
        None,
        description="the resampling of crops and resizes (Pillow's, antialiased); None: the backbone's own "
        "(timm's pretrained config; bilinear for the torchvision backbones)",
    )
    synthetic: SyntheticData | None = Field(None, description="build synthetic shards at data.shards if missing")

    @model_validator(mode="before")
    @classmethod
    def _moved(cls, v: Any) -> Any:
        # keys of earlier versions: refused with their new home rather than kept as a second spelling
        for old, new in MOVED_DATA_KEYS.items():
            if isinstance(v, dict) and old in v:
                raise ValueError(f"data.{old}: moved to data.{new} (same meaning)")
        return v

    @field_validator("storage_options")
    @classmethod
    def _no_secrets(cls, v: dict[str, Any]) -> dict[str, Any]:
        return check_storage_options(v)

    @model_validator(mode="after")
    def _check(self) -> DataConfig:
        if self.eval_crop > self.eval_resize:
            raise ValueError(f"data.eval_crop: {self.eval_crop} is larger than data.eval_resize {self.eval_resize}")
        option = self.augment.cpu_only()
        if self.decode == "device" and option:
            raise ValueError(
                f"data.decode: device decoding does not apply data.augment.{option}; use data.decode=cpu or auto"
            )
        if self.std is not None and min(self.std) <= 0:
            raise ValueError(f"data.std: every channel's std must be positive, got {list(self.std)}")
        return self

    @property
    def P(self) -> int:
        """Classes per global batch (P of P×K)."""
        return self.classes_per_batch or self.batch_size // self.samples_per_class


MOVED_DATA_KEYS = {"crop_scale": "augment.scale", "color_jitter": "augment.color_jitter"}


def resolve_decode(setting: str, device: Any, augment: AugmentConfig) -> str:
    """``data.decode`` for a worker on ``device`` (a ``torch.device`` or its name): ``cpu`` or ``device`` as
    given; ``auto`` is ``device`` on a CUDA device unless the augmentation rotates or runs RandAugment (the
    device path does neither), else ``cpu``."""
    if setting in ("cpu", "device"):
        return setting
    if setting != "auto":
        raise ValueError(f"data.decode: unknown setting {setting!r} (auto, cpu or device)")
    return "device" if str(device).split(":")[0] == "cuda" and not augment.cpu_only() else "cpu"
