"""Typed run configuration: pydantic models, loaded from YAML with ``extends`` and dotted overrides.

A config is one YAML mapping with the sections ``data``, ``model``, ``loss``, ``optim``,
``schedule``, ``train``, ``eval``, ``tracking`` and ``cluster``; every key has a default, so
an empty file is a valid (demo-sized) run. A file may name others under ``extends`` (a path
or a list, relative to the file); they are merged first, in order, and the file's own keys
win. Command-line overrides are ``dotted.key=value`` with the value read as YAML
(``optim.lr=0.01``, ``loss.instance.kind=ice``, ``eval.ks=[1,2,4]``, ``loss.instance=null``).

Everything is checked before anything starts: unknown keys, wrong types and impossible
combinations raise :class:`~dmltrain.errors.ConfigError` whose one-line message names the
dotted key and the reason.

One module past the usual size on purpose: the schema of a run is one concept, and every key,
its default, bounds and description are read in one place (the YAML tree handling lives in
:mod:`dmltrain.config_tree`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from dmltrain.config_tree import apply_overrides, flatten, read_tree
from dmltrain.errors import ConfigError
from shards.sampler import batch_shape
from shards.storage import RemoteSettings, check_storage_options

_REMOTE = RemoteSettings()

RUN_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]*$"  # a folder name: no separators, no leading dot


class Section(BaseModel):
    """Base of every config section: unknown keys are errors, assignments are re-validated, and every
    number must be finite (``optim.lr=.inf`` or ``.nan`` is refused, never trained with)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


class SyntheticData(Section):
    """Procedurally generated shards, built on first use when ``data.shards`` is missing."""

    classes: int = Field(200, ge=2, description="train classes; as many disjoint test classes")
    per_class: int = Field(10, ge=1, description="images per class")
    image_size: int = Field(32, ge=8)
    seed: int = 0
    shard_size: int = Field(2000, ge=1, description="samples per shard")


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


class AugmentConfig(Section):
    """Training augmentation, with torchvision's names and semantics; evaluation only resizes and centre-crops
    (``data.eval_resize``, ``data.eval_crop``), converted to grayscale when ``grayscale`` is set.

    Order: ``resize`` (the frame the crop is drawn in) -> ``rotation`` -> RandomResizedCrop (``scale``,
    ``ratio``) to ``data.image_size`` -> ``flip`` -> ``color_jitter`` -> ``grayscale`` -> normalization ->
    ``erase`` -> ``noise``. Every random choice is drawn from (train.seed, epoch, rank, batch, slot).
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

    @model_validator(mode="after")
    def _check(self) -> AugmentConfig:
        _check_range("data.augment.scale", self.scale, upper=1.0)
        _check_range("data.augment.ratio", self.ratio)
        sizes = (self.resize,) if isinstance(self.resize, int) else self.resize or ()
        if any(s < 8 for s in sizes):
            raise ValueError(f"data.augment.resize: sizes must be >= 8, got {self.resize}")
        lo, hi = self.rotation_range
        if not -180 <= lo <= hi <= 180:
            raise ValueError(f"data.augment.rotation: need -180 <= min <= max <= 180 degrees, got {self.rotation}")
        return self

    @property
    def rotation_range(self) -> tuple[float, float]:
        """(min, max) rotation in degrees, counter-clockwise."""
        r = self.rotation
        return (-abs(r), abs(r)) if isinstance(r, (int, float)) else (float(r[0]), float(r[1]))


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
    image_size: int = Field(224, ge=8, description="train crop (RandomResizedCrop)")
    augment: AugmentConfig = Field(default_factory=AugmentConfig)
    eval_resize: int = Field(256, ge=8)
    eval_crop: int = Field(224, ge=8)
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
        if self.decode == "device" and self.augment.rotation_range != (0.0, 0.0):
            raise ValueError(
                "data.decode: device decoding does not rotate (data.augment.rotation); use data.decode=cpu or auto"
            )
        return self

    @property
    def P(self) -> int:
        """Classes per global batch (P of P×K)."""
        return self.classes_per_batch or self.batch_size // self.samples_per_class


MOVED_DATA_KEYS = {"crop_scale": "augment.scale", "color_jitter": "augment.color_jitter"}


class ModelConfig(Section):
    backbone: str = Field("resnet50", description="resnet18/34/50/101, googlenet, or small_cnn")
    pretrained: str = Field("none", description="none, imagenet, or the path of a torchvision state dict")
    embedding_dim: int | None = Field(
        512, ge=64, le=4096, description="none: the pooled backbone features, unprojected"
    )
    head: Literal["layernorm", "batchnorm", "none"] = Field(
        "layernorm",
        description="layernorm: NormSoftmax head (LayerNorm, Linear, L2); batchnorm: CE head (BatchNorm1d); none: pooled features",
    )
    pooling: Literal["avg", "max", "avgmax"] = "avg"
    multilevel: list[str] | None = Field(None, description="backbone stages pooled, projected and concatenated")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="dropout on the classifier branch only")
    freeze_bn: bool = Field(False, description="keep BatchNorm running statistics fixed")
    sync_bn: bool = Field(
        False, description="BatchNorm statistics over the global batch (all workers), not each worker's part"
    )
    channels_last: bool = False


class ClassifierLoss(Section):
    """The class-sharded proxy classifier (model-parallel over workers)."""

    kind: str = Field("normsoftmax", description="normsoftmax, cosface, arcface or softmax_ce (dmltrain.losses.kinds)")
    weight: float = Field(1.0, ge=0.0)
    sample_ratio: float = Field(1.0, description="share of classes in each step's softmax, in (0, 1]")
    params: dict[str, float] = Field(default_factory=dict, description="temperature, scale, margin, smoothing")
    logits_budget_mb: float = Field(
        256.0, gt=0, description="CPU path: beyond this the classifier works in class chunks"
    )
    precision: Literal["auto", "fp32", "tf32", "bf16"] = Field(
        "auto",
        description="products of the fused CUDA kernels (fp32 accumulation); auto: bf16 on CUDA, fp32 on the CPU",
    )
    weight_storage: Literal["fp32", "bf16"] = Field(
        "fp32", description="bf16 halves the weight and its gradient (CUDA; fp32 optimizer state, stochastic rounding)"
    )
    deterministic: bool = Field(
        False,
        description="CUDA: bit-identical classifier gradients run to run (two backward kernels, one more product); "
        "the default's single backward kernel adds with atomics, equal to fp32 rounding",
    )
    init_std: float | None = Field(
        None,
        gt=0,
        description="std of the initial class weights (normalised kinds); None: 1/sqrt(D). The rows are "
        "normalised in the loss, so their norm sets how fast the class directions move (a step turns a row by about "
        "lr·|g|/|w|²); pytorch-metric-learning's NormalizedSoftmaxLoss starts at 1",
    )

    @field_validator("sample_ratio")
    @classmethod
    def _ratio(cls, v: float) -> float:
        if not 0.0 < v <= 1.0:
            raise ValueError(f"must be in (0, 1], got {v}")
        return v


class InstanceLoss(Section):
    """A loss over the embeddings all-gathered from every worker.

    Pair losses (ICE, ranked list, ...) follow ``mode``. A proxy loss named here (proxy_nca,
    center, ...) keeps its class weights replicated on every worker and is computed whole on
    the gathered batch (mode ``full``); for large label spaces use ``loss.classifier``.
    """

    kind: str = "ice"
    weight: float = Field(1.0, ge=0.0)
    params: dict[str, Any] = Field(default_factory=dict, description="the loss's keyword arguments")
    mode: Literal["local_anchors", "full"] = Field(
        "local_anchors", description="each worker computes its own anchors, or every worker the whole global loss"
    )


class LossConfig(Section):
    classifier: ClassifierLoss | None = Field(default_factory=ClassifierLoss)
    instance: InstanceLoss | None = None

    @model_validator(mode="after")
    def _check(self) -> LossConfig:
        if self.classifier is None and self.instance is None:
            raise ValueError("loss: needs a classifier part, an instance part, or both")
        # imports torch: only when a config is checked
        from dmltrain.losses.kinds import check_classifier
        from dmltrain.losses.registry import check_values

        problems = {
            "classifier": None
            if self.classifier is None
            else check_classifier(self.classifier.kind, self.classifier.params),
            "instance": None if self.instance is None else check_values(self.instance.kind, self.instance.params),
        }
        for part, problem in problems.items():
            if problem:
                raise ValueError(f"loss.{part}.{problem}")
        return self


class OptimConfig(Section):
    name: Literal["sgd", "adamw"] = "sgd"
    lr: float = Field(0.01, gt=0)
    momentum: float = Field(0.9, ge=0, lt=1)
    nesterov: bool = False
    weight_decay: float = Field(1e-4, ge=0)
    decay_norm_and_bias: bool = Field(True, description="False: no weight decay on biases and norm parameters")
    betas: tuple[float, float] = (0.9, 0.999)
    new_param_lr_mult: float = Field(1.0, gt=0, description="lr multiplier of the head and the classifier")

    @model_validator(mode="after")
    def _check(self) -> OptimConfig:
        if self.nesterov and self.momentum == 0:
            raise ValueError("optim.nesterov: needs optim.momentum > 0")
        return self


class ScheduleConfig(Section):
    kind: Literal["constant", "step", "cosine"] = "constant"
    unit: Literal["epoch", "step"] = Field("epoch", description="unit of milestones, warmup and head_only")
    milestones: list[int] = Field(default_factory=list, description="step decay points")
    gamma: float = Field(0.1, gt=0)
    warmup: int = Field(0, ge=0, description="linear learning-rate warm-up length")
    head_only: int = Field(0, ge=0, description="length of the start during which only new parameters train")
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="cosine floor as a share of the base lr")


class TrainConfig(Section):
    epochs: int | None = Field(10, ge=1)
    max_steps: int | None = Field(None, ge=1, description="stop after this many steps (wins over epochs)")
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    zero_stage: int = Field(1, ge=0, le=3)
    grad_clip: float | None = Field(None, gt=0)
    deepspeed_config: str | None = Field(None, description="a DeepSpeed JSON whose keys override the generated ones")
    seed: int = 0
    run_name: str | None = Field(
        None,
        pattern=RUN_NAME_PATTERN,
        max_length=200,
        description="re-running with the same name resumes that run (letters, digits, _ . -)",
    )
    output_dir: str = "runs"
    checkpoint_every: int = Field(0, ge=0, description="steps between checkpoints; 0: at each epoch end")
    keep_checkpoints: int = Field(
        2, ge=1, description="most recent training checkpoints kept (the best model is kept apart)"
    )
    log_every: int = Field(10, ge=1)

    @model_validator(mode="after")
    def _check(self) -> TrainConfig:
        if self.epochs is None and self.max_steps is None:
            raise ValueError("train.epochs: set train.epochs or train.max_steps")
        return self


class EvalConfig(Section):
    every: int = Field(1, ge=0, description="evaluate every N units (0: only at the end)")
    unit: Literal["epoch", "step"] = "epoch"
    metric: str = Field("recall@1", description="the metric that picks the best checkpoint")
    ks: list[int] = Field(default_factory=lambda: [1, 2, 4, 8])
    nmi: bool = True
    map_at_r: bool = True
    binary: bool = False
    before_training: bool = Field(True, description="also evaluate the untrained model")
    plots: bool = True
    mode: Literal["inline", "async"] = Field(
        "inline",
        description="inline: the workers evaluate and training waits; async: each evaluation point saves a "
        "checkpoint that a Ray task evaluates while training goes on (Ray Train's checkpoint validation)",
    )
    async_cpus: float = Field(1.0, gt=0, description="CPUs of an asynchronous evaluation task")
    async_gpus: float = Field(
        0.0,
        ge=0,
        description="GPUs of an asynchronous evaluation task (0: it evaluates on the CPU; a GPU that training leaves free, or the task waits)",
    )

    @field_validator("ks")
    @classmethod
    def _ks(cls, v: list[int]) -> list[int]:
        if not v or any(k < 1 for k in v):
            raise ValueError(f"need positive integers, got {v}")
        return sorted(set(v))

    def metric_names(self) -> list[str]:
        """Metric names an evaluation with this config reports (as in ``eval/<name>``)."""
        names = [f"recall@{k}" for k in self.ks]
        if self.map_at_r:
            names += ["map@r", "r_precision"]
        if self.binary:
            names += [f"binary/{n}" for n in names]
        if self.nmi:
            names.append("nmi")
        return names

    @model_validator(mode="after")
    def _check(self) -> EvalConfig:
        if self.metric not in self.metric_names():
            raise ValueError(
                f"eval.metric: '{self.metric}' is not reported by this evaluation (choose from {', '.join(self.metric_names())})"
            )
        return self


class TrackingConfig(Section):
    enabled: bool = True
    uri: str | None = Field(None, description="MLflow tracking URI; default sqlite:///<cwd>/mlflow.db")
    experiment: str = "dmltrain"
    system_metrics: bool = True
    log_models: bool = Field(
        True,
        description="register the best and final models in MLflow's Models view (pt2 through "
        "torch.export, a few seconds each on rank 0); their files are logged as artifacts either way",
    )

    def resolved_uri(self) -> str:
        """The tracking URI with the default filled in as an absolute SQLite path (Ray workers change directory)."""
        if self.uri:
            return self.uri
        return "sqlite:///" + str(Path(os.getcwd(), "mlflow.db").resolve())


class ClusterConfig(Section):
    address: str | None = Field(None, description="Ray address to join; none starts a local Ray")
    num_workers: int = Field(2, ge=1)
    use_gpu: bool = False
    cpus_per_worker: float = Field(1.0, gt=0, description="fractional values let several workers share a core")
    max_failures: int = Field(0, ge=-1, description="worker-group restarts allowed (-1: unlimited)")
    storage_path: str | None = Field(None, description="Ray Train storage; default train.output_dir")


class Config(Section):
    data: DataConfig = Field(default_factory=DataConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    loss: LossConfig = Field(default_factory=LossConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    schedule: ScheduleConfig = Field(default_factory=ScheduleConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)

    @model_validator(mode="after")
    def _check(self) -> Config:
        d, w = self.data, self.cluster.num_workers
        batch_shape(
            d.sampler, d.batch_size, d.samples_per_class, w, d.classes_per_batch
        )  # ValueError: the one-line message
        if self.loss.instance is not None:
            if d.sampler != "pk":
                raise ValueError("data.sampler: instance losses need positives in every batch; use data.sampler=pk")
            if d.samples_per_class < 2:
                raise ValueError(
                    f"data.samples_per_class: instance loss '{self.loss.instance.kind}' needs K >= 2 positives per class, "
                    f"got {d.samples_per_class}"
                )
        if self.train.precision == "fp16" and not self.cluster.use_gpu:
            raise ValueError("train.precision: fp16 needs GPUs (DeepSpeed's CPU backend has no fp16); use bf16 or fp32")
        c = self.loss.classifier
        if c is not None and not self.cluster.use_gpu:  # the fused kernels run on CUDA only; refuse here, not at step 1
            if c.precision in ("tf32", "bf16"):
                raise ValueError(
                    f"loss.classifier.precision: {c.precision} needs GPUs (cluster.use_gpu); CPU workers compute in fp32"
                )
            if c.weight_storage == "bf16":
                raise ValueError(
                    "loss.classifier.weight_storage: bf16 needs GPUs (cluster.use_gpu); CPU workers keep an fp32 weight"
                )
        if self.schedule.unit == "step" and self.train.max_steps is None and self.schedule.kind == "cosine":
            raise ValueError("schedule.unit: a cosine schedule in steps needs train.max_steps")
        return self

    # -- views -------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict of the resolved config (tuples become lists)."""
        return self.model_dump(mode="json")

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=None)

    def flat(self) -> dict[str, Any]:
        """Dotted keys to scalar values (lists rendered as strings): MLflow params, report diffs."""
        return flatten(self.to_dict())


# ------------------------------------------------------------------------------------------
# loading


def _format_validation_error(err: ValidationError, source: str) -> str:
    first = err.errors()[0]
    loc = ".".join(str(p) for p in first["loc"])
    msg = first["msg"]
    if first["type"] == "extra_forbidden":
        msg = "unknown key"
    elif msg.startswith("Value error, "):
        msg = msg[len("Value error, ") :]
    if (
        first["type"] not in ("extra_forbidden", "missing")
        and "input" in first
        and not isinstance(first["input"], dict)
    ):
        msg = f"{msg} (got {first['input']!r})"
    text = f"{loc}: {msg}" if loc and not msg.startswith(loc) else msg
    more = len(err.errors()) - 1
    return f"{source}: {text}" + (f" (and {more} more problem{'s' * (more > 1)})" if more else "")


def build_config(tree: dict[str, Any], source: str = "config") -> Config:
    """Validate a raw tree into a :class:`Config`, raising a one-line :class:`ConfigError`."""
    try:
        return Config.model_validate(tree)
    except ValidationError as e:
        raise ConfigError(_format_validation_error(e, source)) from None


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Load ``path`` (or the embedded defaults when None), apply overrides, validate."""
    tree = read_tree(path) if path is not None else {}
    tree = apply_overrides(tree, list(overrides or []))
    return build_config(tree, source=str(path) if path is not None else "defaults")
