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
from pydantic import Field, ValidationError, field_validator, model_validator

from dmltrain.config_tree import apply_overrides, flatten, read_tree
from dmltrain.errors import ConfigError
from shards.config import DataConfig, Section
from shards.read.sampler import batch_shape

RUN_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]*$"  # a folder name: no separators, no leading dot


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


class RerankParams(Section):
    """Parameters of ``eval.rerank`` (:mod:`dmltrain.evaluate.rerank`)."""

    candidates: int = Field(100, ge=2, le=10000, description="each query's top candidates that are re-ranked")
    qe_k: int = Field(2, ge=1, description="qe: nearest candidates averaged into the query")
    qe_alpha: float = Field(
        0.0, ge=0.0, description="qe: 0 averages them (AQE); α > 0 weights each by its cosine to the power α (αQE)"
    )
    kr_k1: int = Field(20, ge=1, description="kr: k1, the k of the k-reciprocal neighbours")
    kr_k2: int = Field(6, ge=1, description="kr: k2, neighbours of the local query expansion (1: none)")
    kr_lambda: float = Field(0.3, ge=0.0, le=1.0, description="kr: weight of the original distance in the final one")

    @model_validator(mode="after")
    def _check(self) -> RerankParams:
        for key in ("qe_k", "kr_k1", "kr_k2"):
            if getattr(self, key) > self.candidates + (key == "kr_k2"):
                raise ValueError(
                    f"eval.rerank_params.{key}: {getattr(self, key)} exceeds the {self.candidates} candidates"
                )
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

    rerank: Literal["none", "qe", "kr"] = Field(
        "none",
        description="re-rank each query's top candidates after the exact search: qe (query expansion) or kr "
        "(k-reciprocal); reported as rerank/<metric> next to the plain metrics",
    )
    rerank_params: RerankParams = Field(default_factory=RerankParams)

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
        plain = list(names)
        if self.binary:
            names += [f"binary/{n}" for n in plain]
        if self.rerank != "none":
            names += [f"rerank/{n}" for n in plain]
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
