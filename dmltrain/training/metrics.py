"""Training metrics between log points: step statistics averaged, named for MLflow, plus memory probes.

:meth:`TrainMetrics.add` takes a step's statistics (the objective's loss parts, the learning
rate) as they are: device scalars are summed on the device, without waiting for them, and
:meth:`TrainMetrics.summary` reads the sums back once per log point (one sync) and averages
them over the steps since the last one. :func:`mlflow_names` gives them their MLflow keys
(:mod:`dmltrain.tracking.names`, where the order MLflow shows them in is explained), leaving out
the statistics that do not change while a run trains (the classifier's active classes and rows):
those are run facts, averaged over the whole run by :meth:`TrainMetrics.facts` and logged as tags.
"""

from __future__ import annotations

from collections.abc import Mapping

import psutil
import torch

from dmltrain.tracking.names import (
    CLASSIFIER_FACTS,
    CLASSIFIER_PREFIX,
    CUDA_PEAK_MB,
    EPOCH,
    IMAGES_PER_S,
    LOSS,
    LR,
    RSS_MB,
    TRAIN_PREFIX,
)

# the trainer's and the objective's statistic names (Objective.stats) that have MLflow keys of their own
STAT_LOSS, STAT_LR = "loss", "lr"
_RENAMED = {STAT_LOSS: LOSS, STAT_LR: LR}
_OBJECTIVE_CLASSIFIER = "classifier/"  # the objective's prefix for the sharded classifier's statistics


def mlflow_names(summary: Mapping[str, float]) -> dict[str, float]:
    """``summary`` under MLflow keys: ``loss`` -> ``batch/loss``, ``lr`` -> ``batch/lr``, ``classifier/<s>``
    -> ``softmax/<s>``, other names with a ``/`` (``instance/``, ``time/``, ``memory/``, ``data/``) and
    ``epoch``, ``images_per_s`` as they are, plain others under ``train/``; the run facts are left out."""
    out = {}
    for k, v in summary.items():
        if k in CLASSIFIER_FACTS:
            continue
        if k in _RENAMED:
            k = _RENAMED[k]
        elif k.startswith(_OBJECTIVE_CLASSIFIER):
            k = CLASSIFIER_PREFIX + k[len(_OBJECTIVE_CLASSIFIER) :]
        elif "/" not in k and k not in (EPOCH, IMAGES_PER_S):
            k = TRAIN_PREFIX + k
        out[k] = v
    return out


class TrainMetrics:
    def __init__(self) -> None:
        self.reset()
        self._fact_sums: dict[str, float] = {}
        self._fact_steps: dict[str, int] = {}

    def reset(self) -> None:
        self.sums: dict[str, float | torch.Tensor] = {}
        self.counts: dict[str, int] = {}  # the steps that reported each statistic
        self.steps = 0

    def add(self, stats: Mapping[str, float | torch.Tensor]) -> None:
        """One step's statistics: host floats, or 0-d tensors kept where they are (no sync). A statistic
        some steps do not report (the classifier's probe) is averaged over the steps that do."""
        for k, v in stats.items():
            if isinstance(v, torch.Tensor):
                v = v.detach().double()
            self.sums[k] = self.sums.get(k, 0.0) + v
            self.counts[k] = self.counts.get(k, 0) + 1
        self.steps += 1

    def summary(self) -> dict[str, float]:
        """The mean of each statistic since the last summary over the steps that reported it (device sums
        read back here); starts a new window."""
        host = {k: float(v) for k, v in self.sums.items() if not isinstance(v, torch.Tensor)}
        on_device = [k for k, v in self.sums.items() if isinstance(v, torch.Tensor)]
        by_device: dict[torch.device, list[str]] = {}
        for k in on_device:
            by_device.setdefault(self.sums[k].device, []).append(k)
        for keys in by_device.values():  # one read per device
            host.update(zip(keys, torch.stack([self.sums[k] for k in keys]).tolist()))
        out = {k: host[k] / max(1, self.counts[k]) for k in self.sums}
        for k in CLASSIFIER_FACTS:
            if k in host:
                self._fact_sums[k] = self._fact_sums.get(k, 0.0) + host[k]
                self._fact_steps[k] = self._fact_steps.get(k, 0) + self.counts[k]
        self.reset()
        return out

    def facts(self) -> dict[str, float]:
        """The run facts as tags: each classifier fact's mean over every step summarised so far (this process)."""
        return {CLASSIFIER_FACTS[k]: v / max(1, self._fact_steps[k]) for k, v in self._fact_sums.items()}


def memory_metrics(device: torch.device) -> dict[str, float]:
    """This process's resident memory and, on a GPU, its CUDA peak, in MB."""
    out = {RSS_MB: psutil.Process().memory_info().rss / 2**20}
    if device.type == "cuda":
        out[CUDA_PEAK_MB] = torch.cuda.max_memory_allocated(device) / 2**20
    return out
