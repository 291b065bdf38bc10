"""One measured run of ``dmltrain bench classifier``: the job a parent writes and a child process reads.

``dmltrain bench classifier`` and ``make gpu-check`` (:mod:`dmltrain.gpu_check`) build jobs, the child
(:mod:`~dmltrain.distributed.bench_runs`) reads them: both through :class:`ClassifierJob`, so a job cannot
miss a key the child reads, and a JSON with an unknown or missing key is refused in one line before
anything runs. Nothing here imports torch.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

ROLES = ("ours", "peer")
DEVICES = ("cpu", "cuda")
#: the CUDA peers: job name -> (package that must be installed, printed name)
CUDA_PEERS = {
    "cce": ("cut_cross_entropy", "Cut Cross-Entropy (bf16, its default gradient filter)"),
    "cce_exact": ("cut_cross_entropy", "Cut Cross-Entropy exact (bf16, no gradient filter)"),
    "liger": ("liger_kernel", "Liger fused linear cross-entropy (bf16)"),
    "naive": ("torch", "naive torch bf16 (logits held)"),
    "pml": ("pytorch_metric_learning", "pytorch-metric-learning NormalizedSoftmaxLoss (fp32)"),
}
SAMPLINGS = ("uniform", "hard", "mixed", "proportional")


@dataclass(frozen=True)
class ClassifierJob:
    """``N`` classes of width ``D``, global batch ``B`` over ``W`` workers, share ``R`` of the classes per step;
    ``steps`` timed steps after one warm-up step.

    ``role`` ``ours`` measures the sharded classifier (its forward, backward and optimizer step apart), ``peer``
    the peer ``peer`` (CUDA: a name of :data:`CUDA_PEERS`; CPU: pytorch-metric-learning) at ``R`` = 1.
    ``budget`` is the CPU path's logits budget in MB; ``precision``, ``storage`` and ``deterministic`` apply on
    CUDA only (the CPU computes in fp32)."""

    role: str
    device: str
    N: int
    D: int
    B: int
    steps: int = 3
    W: int = 1
    R: float = 1.0
    kind: str = "normsoftmax"
    optimizer: str = "sgd"
    budget: float = 256.0
    precision: str = "auto"
    storage: str = "fp32"
    deterministic: bool = False
    sampling: str = "uniform"
    probe: bool = False
    peer: str = ""

    def __post_init__(self) -> None:
        problem = self.problem()
        if problem:
            raise ValueError(f"classifier job: {problem}")

    def problem(self) -> str:
        """What is wrong with this job, or ''."""
        if self.role not in ROLES:
            return f"role {self.role!r} is not one of {', '.join(ROLES)}"
        if self.device not in DEVICES:
            return f"device {self.device!r} is not one of {', '.join(DEVICES)}"
        if min(self.N, self.D, self.B, self.W, self.steps) < 1:
            return "N, D, B, W and steps must be positive"
        if self.B % self.W:
            return f"B = {self.B} is not divisible by W = {self.W}"
        if not 0 < self.R <= 1:
            return f"R = {self.R} is not in (0, 1]"
        if self.sampling not in SAMPLINGS:
            return f"sampling {self.sampling!r} is not one of {', '.join(SAMPLINGS)}"
        if self.role == "peer" and self.device == "cuda" and self.peer not in CUDA_PEERS:
            return f"peer {self.peer!r} is not one of {', '.join(CUDA_PEERS)}"
        return ""

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    def replace(self, **changes: Any) -> ClassifierJob:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_json(cls, text: str) -> ClassifierJob:
        """The job in ``text``; a ValueError names an unknown key, a missing one or a value of the wrong type."""
        try:
            data = json.loads(text)
        except ValueError as e:
            raise ValueError(f"classifier job: not JSON ({e})") from None
        if not isinstance(data, dict):
            raise ValueError("classifier job: expected a JSON object")
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - set(fields))
        if unknown:
            raise ValueError(f"classifier job: unknown key {unknown[0]!r} (known: {', '.join(fields)})")
        missing = [n for n, f in fields.items() if f.default is dataclasses.MISSING and n not in data]
        if missing:
            raise ValueError(f"classifier job: missing key {missing[0]!r}")
        for name, value in data.items():
            want = {"int": int, "float": (int, float), "bool": bool, "str": str}[fields[name].type]
            if not isinstance(value, want) or (want is int and isinstance(value, bool)):
                raise ValueError(f"classifier job: {name} = {value!r} is not a {fields[name].type}")
        return cls(**data)
