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
import reprlib
from pathlib import Path
from typing import Any, Literal, get_args

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from dmltrain.backbone_facts import TORCHVISION_BACKBONES, backbone_input, check_timm_model, timm_facts
from dmltrain.config_tree import apply_overrides, flatten, read_tree
from dmltrain.errors import ConfigError, UserError
from dmltrain.redact import redact
from dmltrain.text import clip
from shards.config import DataConfig, Section
from shards.read.sampler import batch_shape

RUN_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]*$"  # a folder name: no separators, no leading dot
PRETRAINED_KEYWORDS = ("", "none", "imagenet", "timm")  # model.pretrained values that are not files
HF_PREFIX = "hf-hub:"  # model.pretrained=hf-hub:ORG/NAME: a Hugging Face repository in the local cache
#: ``train.precision``: the autocast of the model's forward pass
TrainPrecision = Literal["fp32", "bf16", "fp16"]
#: ``loss.classifier.precision``: the products of the fused classifier kernels (fp32 accumulation);
#: ``auto`` is bf16 on CUDA and fp32 elsewhere
ProductPrecision = Literal["auto", "fp32", "tf32", "bf16"]
#: ``loss.classifier.weight_storage``: the classifier weight's dtype in memory
WeightStorage = Literal["fp32", "bf16"]
#: ``loss.classifier.sampling``: the class draw's modes below ratio 1: uniform others, nearest others, a share of
#: each, or others drawn in proportion to the exponential of their nearness's logit
ClassSampling = Literal["uniform", "hard", "mixed", "proportional"]
#: ``loss.classifier.nearest_to``: what the nearest classes are nearest to: the batch's classes' rows or its embeddings
NearestTo = Literal["classes", "samples"]
TRAIN_PRECISIONS, PRODUCT_PRECISIONS, WEIGHT_STORAGES, SAMPLING_MODES, NEAREST_TO = (
    get_args(t) for t in (TrainPrecision, ProductPrecision, WeightStorage, ClassSampling, NearestTo)
)

#: ``model.compile``: torch.compile's mode, or False for eager
CompileMode = Literal[False, "default", "max-autotune"]
#: ``model.compile_scope``: the parts of the step that ``model.compile`` compiles
CompileScope = Literal["backbone", "head", "instance_loss"]
COMPILE_SCOPES = get_args(CompileScope)

#: settings only GPU workers honour, by key, with what a CPU worker does instead
GPU_ONLY = {
    "train.precision": ({"fp16"}, "DeepSpeed's CPU backend has no fp16; use bf16 or fp32"),
    "loss.classifier.precision": ({"tf32", "bf16"}, "CPU workers compute the classifier in fp32"),
    "loss.classifier.weight_storage": ({"bf16"}, "CPU workers keep an fp32 weight"),
}


def gpu_only(key: str, value: str) -> str | None:
    """The one-line reason ``key = value`` needs a GPU, or None when a CPU honours it too."""
    values, instead = GPU_ONLY[key]
    return f"{key}: {value} needs GPUs (cluster.use_gpu); {instead}" if value in values else None


class ModelConfig(Section):
    backbone: str = Field(
        "resnet50",
        description="resnet18/34/50/101/152, resnext50_32x4d, wide_resnet50_2, googlenet, small_cnn (torchvision), "
        "or any timm model name (vit_small_patch16_224, vit_base_patch14_dinov2, vit_base_patch16_clip_224, "
        "convnext_base, ...; a pretrained tag may follow a dot; timm:NAME for timm's model of one of the former names)",
    )
    pretrained: str = Field(
        "none",
        description="none; imagenet (torchvision's weights; for a timm model its default pretrained tag); timm (the "
        "timm model's pretrained weights from the local Hugging Face cache); hf-hub:ORG/NAME (a Hugging Face repository "
        "from the local cache); or a file: safetensors or a torch state dict (read weights-only)",
    )
    pretrained_download: bool = Field(
        False,
        description="allow downloading timm / Hugging Face weights missing from the local cache (default: never "
        "downloaded at training time)",
    )
    image_size: int | None = Field(
        None,
        ge=8,
        description="input side a timm model is built for (a ViT's position embeddings, resampled from the "
        "pretrained ones); None: data.image_size (filled in); convolutional models ignore it",
    )
    features: Literal["auto", "pooled", "cls", "patches"] = Field(
        "auto",
        description="timm models: pooled (auto: the model's own pooled features as pretrained, the class token of a "
        "ViT), cls (the class token), patches (patch tokens or a convnet's last map, pooled by model.pooling); "
        "torchvision backbones: their last feature map",
    )
    drop_path: float = Field(
        0.0, ge=0.0, lt=1.0, description="stochastic depth rate of a timm model (timm's drop_path_rate)"
    )
    grad_checkpointing: bool = Field(
        False,
        description="recompute activations in the backward pass (timm's set_grad_checkpointing; each stage of a "
        "torchvision backbone under torch.utils.checkpoint): less memory, about a third more compute",
    )
    embedding_dim: int | None = Field(
        512, ge=64, le=4096, description="none: the pooled backbone features, unprojected"
    )
    head: Literal["layernorm", "batchnorm", "none"] = Field(
        "layernorm",
        description="layernorm: NormSoftmax head (LayerNorm, Linear, L2); batchnorm: CE head (BatchNorm1d); none: pooled features",
    )
    pooling: Literal["avg", "max", "avgmax", "gem"] = Field(
        "avg", description="global pooling of the feature maps: avg, max, (avg + max) / 2, or GeM (model.gem_p)"
    )
    gem_p: float = Field(3.0, ge=1.0, le=16.0, description="exponent of GeM pooling (generalised mean)")
    multilevel: list[str] | None = Field(
        None,
        description="backbone stages pooled, projected and concatenated (timm: feature points such as blocks.8 or "
        "stages.2, and output)",
    )
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="dropout on the classifier branch only")
    freeze_bn: bool = Field(False, description="keep BatchNorm running statistics fixed")
    sync_bn: bool = Field(
        False, description="BatchNorm statistics over the global batch (all workers), not each worker's part"
    )
    channels_last: bool = Field(False, description="channels_last memory format (convolutional backbones only)")
    compile: CompileMode = Field(
        False,
        description="torch.compile (inductor) the parts of model.compile_scope, as timm's and open_clip's "
        "--torchcompile: false, default, or max-autotune (tuned kernels, a longer compile); static shapes; the "
        "compile time and graph breaks are logged once (a CPU worker needs a C++ compiler)",
    )
    compile_scope: list[CompileScope] = Field(
        ["backbone", "head"],
        min_length=1,
        description="what model.compile compiles: backbone, head, instance_loss (the loss over the gathered batch, "
        "not the gather); the sharded classifier is never compiled (its own kernels)",
    )

    def pretrained_is_file(self) -> bool:
        """Whether ``pretrained`` names a file (a path to make absolute), not a keyword or an ``hf-hub:`` repository."""
        return self.pretrained not in PRETRAINED_KEYWORDS and not self.pretrained.startswith(HF_PREFIX)


class ClassifierLoss(Section):
    """The class-sharded proxy classifier (model-parallel over workers)."""

    kind: str = Field("normsoftmax", description="normsoftmax, cosface, arcface or softmax_ce (dmltrain.losses.kinds)")
    weight: float = Field(1.0, ge=0.0)
    sample_ratio: float = Field(1.0, description="share of classes in each step's softmax, in (0, 1]")
    params: dict[str, float] = Field(default_factory=dict, description="temperature, scale, margin, smoothing")
    logits_budget_mb: float = Field(
        256.0, gt=0, description="CPU path: beyond this the classifier works in class chunks"
    )
    precision: ProductPrecision = Field(
        "auto",
        description="products of the fused CUDA kernels (fp32 accumulation); auto: bf16 on CUDA, fp32 on the CPU",
    )
    weight_storage: WeightStorage = Field(
        "fp32", description="bf16 halves the weight and its gradient (CUDA; fp32 optimizer state, stochastic rounding)"
    )
    deterministic: bool = Field(
        False,
        description="CUDA: fixed (untuned) kernel tiles, so classifier gradients are bit-identical run to run; the "
        "backward is atomic-free either way, and only the forward's tuned tiles may differ between ranks and runs",
    )
    init_std: float | None = Field(
        None,
        gt=0,
        description="std of the initial class weights (normalised kinds); None: 1/sqrt(D). The rows are "
        "normalised in the loss, so their norm sets how fast the class directions move (a step turns a row by about "
        "lr·|g|/|w|²); pytorch-metric-learning's NormalizedSoftmaxLoss starts at 1",
    )

    sampling: ClassSampling = Field(
        "uniform",
        description="with sample_ratio < 1, the classes besides the batch's: uniform (NormSoftmax's draw), hard (those "
        "whose rows are nearest the batch, see nearest_to, from an index refreshed every refresh_every steps) or mixed "
        "(nearest_share of them nearest, the rest uniform) or proportional (drawn in proportion to exp of the logit their "
        "nearness makes, each with the log of its inclusion probability subtracted from its logit: the sampled loss "
        "then estimates the full softmax's; runs the torch backend)",
    )
    nearest_to: NearestTo = Field(
        "classes",
        description="sampling hard/mixed/proportional: rank the classes by their best cosine to the rows of the batch's classes "
        "(classes) or to the batch's embeddings (samples: the classes its samples score highest)",
    )
    nearest_share: float = Field(
        0.5, ge=0.0, le=1.0, description="sampling mixed: the share of the drawn others taken by nearness"
    )
    refresh_every: int = Field(
        100,
        ge=1,
        description="sampling hard/mixed/proportional: steps between two snapshots of the rows in the nearness index",
    )
    nearest_after: int = Field(
        0,
        ge=0,
        description="sampling hard/mixed/proportional: draw uniformly before this step (the nearness index is first "
        "built at it): a schedule that turns hard once the rows have spread; 0: from the first step",
    )
    sampling_correction: bool = Field(
        False,
        description="log-Q correction of the uniformly drawn classes' logits (uniform, mixed; proportional always "
        "corrects): the sampled loss then estimates the "
        "full softmax's (consistently); runs the torch backend",
    )
    probe_every: int = Field(
        0,
        ge=0,
        description="every so many steps, the full softmax's loss and embedding gradient for the same batch, nothing "
        "updated: logged as softmax/probe/ (gradient cosine, norm ratio, loss gap; with hard, mixed or proportional "
        "draws also a uniform draw's loss gap on the same model); 0: off",
    )
    drop_after: int | None = Field(
        None,
        ge=0,
        description="with params.subcenters >= 2: from this step on, samples farther than drop_angle from their "
        "class's dominant sub-center are left out of the loss (sub-center ArcFace's noisy-label recipe); null: never",
    )
    drop_angle: float = Field(75.0, gt=0.0, lt=180.0, description="drop_after: the angle in degrees")

    @field_validator("sample_ratio")
    @classmethod
    def _ratio(cls, v: float) -> float:
        if not 0.0 < v <= 1.0:
            raise ValueError(f"must be in (0, 1], got {v}")
        return v

    @model_validator(mode="after")
    def _torch_only(self) -> ClassifierLoss:
        subcenters = self.params.get("subcenters", 1)
        if self.drop_after is not None and not (isinstance(subcenters, int | float) and subcenters >= 2):
            raise ValueError(
                "loss.classifier.drop_after: drops samples far from their class's dominant sub-center; it needs params.subcenters >= 2"
            )
        fallback = None
        if subcenters != 1:
            fallback = "sub-centers"
        elif self.sampling_correction or self.sampling == "proportional":
            fallback = "log-Q correction"
        if fallback:  # the torch backend computes in fp32 with an fp32 weight
            if self.weight_storage != "fp32":
                raise ValueError(
                    f"loss.classifier.weight_storage: {self.weight_storage} needs the fused kernels, which take no {fallback}; use fp32"
                )
            if self.precision not in ("auto", "fp32"):
                raise ValueError(
                    f"loss.classifier.precision: with {fallback} the classifier runs the torch backend, in fp32; use precision "
                    "auto or fp32"
                )
        return self


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
    decay_norm_and_bias: bool = Field(
        True,
        description="False: no weight decay on biases, norm parameters and those a timm model's no_weight_decay() "
        "names (a ViT's class token and position embeddings)",
    )
    betas: tuple[float, float] = (0.9, 0.999)
    new_param_lr_mult: float = Field(1.0, gt=0, description="lr multiplier of the head and the classifier")
    layer_decay: float | None = Field(
        None,
        gt=0,
        le=1,
        description="layer-wise lr decay: a backbone parameter of layer i (0 at the input, L the last) trains at "
        "lr × layer_decay^(L - i) (timm's grouping: stem, then each block, the final norm with the last; "
        "torchvision: stem, then each stage); "
        "None: off",
    )

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
    precision: TrainPrecision = "fp32"
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
    checkpoint_every_s: float | None = Field(
        None,
        gt=0,
        description="also checkpoint at the first step boundary this many seconds after the last checkpoint (rank "
        "0's clock, shared with the others); None: by train.checkpoint_every alone",
    )
    keep_checkpoints: int = Field(
        2, ge=1, description="most recent training checkpoints kept (the best model is kept apart)"
    )
    log_every: int = Field(10, ge=1)
    grad_accum: int = Field(
        1,
        ge=1,
        le=1024,
        description="micro-batches of data.batch_size per optimizer step (DeepSpeed's gradient_accumulation_steps; "
        "the classifier rows step once per step). Exact for the classifier loss (a mean over samples): its gradients, "
        "the rows' and the backbone's, equal those of one batch of grad_accum × data.batch_size (with sample_ratio < 1 "
        "each micro-batch's softmax holds its own classes plus the step's draw). An instance loss sees each "
        "micro-batch's gathered embeddings only (a mean of per-micro-batch losses). Steps, not micro-batches, are "
        "what train.max_steps, the schedule and checkpoints count",
    )
    ema_decay: float | None = Field(
        None,
        gt=0,
        lt=1,
        description="keep an exponential moving average of the model's weights (backbone and embedding head), "
        "ema = d·ema + (1 − d)·w after each optimizer step, and evaluate and export it; None: off",
    )
    ema_warmup: bool = Field(
        True,
        description="warm the average up (timm's ModelEmaV3 use_warmup): the t-th update uses "
        "d_t = min(train.ema_decay, 1 − t^(−2/3)), the first copying the weights; false: train.ema_decay from the "
        "first update, so (ema_decay)^steps of the weights as built stay in the average",
    )

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
    num_workers: int | tuple[int, int] = Field(
        2,
        description="training workers: N, or [min, max] for an elastic run (Ray Train's elastic scaling) that starts "
        "with what the cluster has, goes on with fewer workers when a node is lost and grows back when it returns; "
        "a step's global batch stays data.batch_size × train.grad_accum at every worker count",
    )
    use_gpu: bool = False
    cpus_per_worker: float = Field(1.0, gt=0, description="fractional values let several workers share a core")
    max_failures: int = Field(
        0,
        ge=-1,
        description="worker-group restarts allowed (-1: unlimited); a lost node or worker is one, and an elastic run "
        "needs at least one",
    )
    resize_interval_s: float = Field(
        60.0,
        gt=0,
        description="elastic runs: how often Ray Train checks whether more workers fit, to grow the group "
        "(ScalingConfig.elastic_resize_monitor_interval_s)",
    )
    storage_path: str | None = Field(None, description="Ray Train storage; default train.output_dir")

    @field_validator("num_workers", mode="before")
    @classmethod
    def _workers(cls, v: Any) -> int | tuple[int, int]:
        pair = isinstance(v, (list, tuple)) and len(v) == 2
        values = list(v) if pair else [v]
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in values):
            raise ValueError("must be a worker count N, or [min, max] for an elastic run")
        if values[0] < 1 or values[-1] < values[0]:
            raise ValueError("must be >= 1, or [min, max] with 1 <= min <= max")
        return (values[0], values[1]) if pair else values[0]

    @property
    def elastic(self) -> bool:
        """Whether the worker count is a range (Ray Train's elastic scaling)."""
        return isinstance(self.num_workers, tuple)

    @property
    def min_workers(self) -> int:
        return self.num_workers[0] if isinstance(self.num_workers, tuple) else self.num_workers

    @property
    def max_workers(self) -> int:
        return self.num_workers[1] if isinstance(self.num_workers, tuple) else self.num_workers

    def worker_counts(self) -> range:
        """Every worker count the run may train at."""
        return range(self.min_workers, self.max_workers + 1)

    def workers_text(self) -> str:
        """``1 worker``, ``4 workers``, or ``1-3 workers (elastic)``."""
        if self.elastic:
            return f"{self.min_workers}-{self.max_workers} workers (elastic)"
        return f"{self.num_workers} worker{'s' * (self.num_workers != 1)}"


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
        d, c = self.data, self.cluster
        unsplit = []  # worker counts of an elastic range that cannot split a step
        for w in reversed(c.worker_counts()):  # ValueError: the one-line message
            try:
                batch_shape(
                    d.sampler,
                    d.batch_size,
                    d.samples_per_class,
                    w,
                    d.classes_per_batch,
                    grad_accum=self.train.grad_accum,
                    max_world=c.max_workers,
                )
            except ValueError as e:
                if w == c.max_workers or not str(e).startswith("cluster.num_workers: at "):
                    raise
                unsplit.append((w, str(e)))
        if unsplit:
            counts = " or ".join(str(w) for w, _ in reversed(unsplit))
            raise ValueError(unsplit[-1][1].replace(f"at {unsplit[-1][0]} workers", f"at {counts} workers", 1))
        if c.elastic and c.max_failures == 0:
            raise ValueError(
                f"cluster.max_failures: an elastic run (cluster.num_workers {list(c.num_workers)}) goes on after a lost "
                "node by restarting its workers; allow restarts (-1: unlimited)"
            )
        if self.loss.instance is not None:
            if d.sampler != "pk":
                raise ValueError("data.sampler: instance losses need positives in every batch; use data.sampler=pk")
            if d.samples_per_class < 2:
                raise ValueError(
                    f"data.samples_per_class: instance loss '{self.loss.instance.kind}' needs K >= 2 positives per class, "
                    f"got {d.samples_per_class}"
                )
        if not self.cluster.use_gpu:  # refused here, not at step 1 on every worker
            c = self.loss.classifier
            settings = [("train.precision", self.train.precision)]
            if c is not None:
                settings += [
                    ("loss.classifier.precision", c.precision),
                    ("loss.classifier.weight_storage", c.weight_storage),
                ]
            for key, value in settings:
                if reason := gpu_only(key, value):
                    raise ValueError(reason)
        if self.schedule.unit == "step" and self.train.max_steps is None and self.schedule.kind == "cosine":
            raise ValueError("schedule.unit: a cosine schedule in steps needs train.max_steps")
        if self.train.ema_decay is not None and self.train.zero_stage >= 3:
            raise ValueError("train.ema_decay: needs whole parameters on every worker; use train.zero_stage <= 2")
        if self.model.grad_checkpointing and self.model.sync_bn:
            raise ValueError(
                "model.grad_checkpointing: not with model.sync_bn (recomputation would repeat its collectives)"
            )
        try:
            self._resolve_backbone()
        except UserError as e:
            raise ValueError(str(e)) from None
        return self

    def _resolve_backbone(self) -> None:
        """Fill in what comes from the backbone (``data.mean``, ``.std``, ``.interpolation``, ``model.image_size``)
        and refuse what it cannot take."""
        m, d = self.model, self.data
        mean, std, interpolation = backbone_input(m.backbone)  # refuses an unknown name first
        if m.backbone in TORCHVISION_BACKBONES:
            if m.drop_path:
                raise UserError(
                    f"model.drop_path: {m.backbone} (torchvision) has no stochastic depth; use 0, or a timm backbone "
                    f"(e.g. timm:{m.backbone})"
                )
            if m.features not in ("auto", "patches"):
                raise UserError(
                    f"model.features: {m.features} is for timm models; {m.backbone} gives its last feature map"
                )
        else:
            facts = timm_facts(m.backbone)
            if m.channels_last and not facts.convolutional:
                raise UserError(
                    f"model.channels_last: {m.backbone} is a transformer over patch tokens; channels_last helps "
                    f"convolutional models only"
                )
            if m.image_size is not None and m.image_size != d.image_size and facts.takes_image_size:
                raise UserError(
                    f"model.image_size: {m.image_size} differs from data.image_size {d.image_size}; "
                    f"{m.backbone} is built for the size it is trained at"
                )
            check_timm_model(m.backbone, m.features, m.pooling, d.image_size, d.eval_crop)
        if m.image_size is None:
            m.image_size = d.image_size
        if d.mean is None:
            d.mean = mean
        if d.std is None:
            d.std = std
        if d.interpolation is None:
            d.interpolation = interpolation

    # -- views -------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict of the resolved config (tuples become lists).

        What the backbone fills in (``data.mean``, ``data.std``, ``data.interpolation``, ``model.image_size``) is
        written as null where it is the backbone's own, so that the dict, validated again (by a worker, a Tune
        trial that changes the backbone, a file written from ``config show``), follows the backbone it then names;
        :meth:`flat` (the MLflow params) holds the values in use.
        """
        out = self.model_dump(mode="json")
        data, model = out["data"], out["model"]
        for key, own in zip(("mean", "std", "interpolation"), backbone_input(self.model.backbone)):
            if data[key] == (list(own) if isinstance(own, tuple) else own):
                data[key] = None
        if model["image_size"] == self.data.image_size:
            model["image_size"] = None
        return out

    def to_yaml(self) -> str:
        """The config as YAML to print or write (``config show``, the ``config.yaml`` artifact, a search's best
        config), redacted (:func:`dmltrain.redact.redact`): URL userinfo and storage options outside the
        allow-list are ``<redacted>``. What runs is :meth:`to_dict`, whole."""
        return yaml.safe_dump(redact(self.to_dict()), sort_keys=False, default_flow_style=None)

    def flat(self) -> dict[str, Any]:
        """Dotted keys to scalar values (lists rendered as strings), those filled in from the backbone included:
        MLflow params, report diffs."""
        return flatten(self.model_dump(mode="json"))


# ------------------------------------------------------------------------------------------
# loading


def _short_repr(value: Any) -> str:
    """``repr`` of a value as a message quotes it: nested containers cut short (a billion-laughs file's value,
    a billion strings through YAML aliases, would otherwise be printed whole), and the whole clipped."""
    short = reprlib.Repr()
    short.maxlevel, short.maxlist, short.maxdict, short.maxstring, short.maxother = 2, 4, 4, 80, 80
    return clip(short.repr(value), 200)


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
        msg = f"{msg} (got {_short_repr(first['input'])})"
    text = f"{loc}: {msg}" if loc and not msg.startswith(loc) else msg
    more = len(err.errors()) - 1
    return f"{source}: {text}" + (f" (and {more} more problem{'s' * (more > 1)})" if more else "")


MAX_TREE_VALUES = 100_000  # far beyond any config (a few hundred values): past it, a YAML alias bomb


def _check_tree(tree: Any, source: str) -> None:
    """Refuse, in one line, a config holding a NUL byte in a string (no path, URL or name can hold one: the OS
    would refuse it later, with a traceback) or more than :data:`MAX_TREE_VALUES` values once its YAML aliases are
    expanded (a billion-laughs file names one list a billion times; validating or printing it would never end)."""
    count = 0
    stack: list[tuple[str, Any]] = [("", tree)]
    while stack:
        key, value = stack.pop()
        count += 1
        if count > MAX_TREE_VALUES:
            raise ConfigError(
                f"{source}: more than {MAX_TREE_VALUES:,} values once its YAML aliases are expanded "
                "(an alias bomb?); a config holds a few hundred"
            )
        if isinstance(value, str) and "\0" in value:
            raise ConfigError(f"{source}: {key}: contains a NUL byte (\\0), which no path, URL or name may hold")
        if isinstance(value, dict):
            for k, v in value.items():
                name = f"{key}.{k}" if key else str(k)
                if "\0" in str(k):
                    raise ConfigError(f"{source}: {name}: a key with a NUL byte (\\0)")
                stack.append((name, v))
        elif isinstance(value, (list, tuple)):
            stack.extend((f"{key}[{i}]", v) for i, v in enumerate(value))


def build_config(tree: dict[str, Any], source: str = "config") -> Config:
    """Validate a raw tree into a :class:`Config`, raising a one-line :class:`ConfigError` (first
    :func:`_check_tree`: no NUL byte, no alias bomb)."""
    _check_tree(tree, source)
    try:
        return Config.model_validate(tree)
    except ValidationError as e:
        raise ConfigError(_format_validation_error(e, source)) from None


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Load ``path`` (or the embedded defaults when None), apply overrides, validate."""
    tree = read_tree(path) if path is not None else {}
    tree = apply_overrides(tree, list(overrides or []))
    return build_config(tree, source=str(path) if path is not None else "defaults")
