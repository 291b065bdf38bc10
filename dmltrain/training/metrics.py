"""Training metrics between log points: step statistics averaged, named for MLflow, plus memory probes.

:meth:`TrainMetrics.add` is where the trainer reads a step's statistics (the objective's
loss parts, the learning rate) to the host; :meth:`TrainMetrics.summary` averages them
over the steps since the last log point.
"""

from __future__ import annotations

from collections.abc import Mapping

import psutil
import torch

from dmltrain.tracking.names import CLASSIFIER_MB, CUDA_PEAK_MB, EPOCH, IMAGES_PER_S, LOSS, LR, RSS_MB, TRAIN_PREFIX

# logged under their own names; every other statistic without a "/" goes under "train/"
TOP_LEVEL = (LR, EPOCH, IMAGES_PER_S, LOSS)


def mlflow_names(summary: Mapping[str, float]) -> dict[str, float]:
    """``summary`` with plain statistic names moved under ``train/`` (``active_pairs`` -> ``train/active_pairs``)."""
    return {k if "/" in k or k in TOP_LEVEL else f"{TRAIN_PREFIX}{k}": v for k, v in summary.items()}


class TrainMetrics:
    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.sums: dict[str, float] = {}
        self.steps = 0

    def add(self, stats: Mapping[str, float | torch.Tensor]) -> None:
        """One step's statistics (host floats, or 0-d tensors read back here)."""
        for k, v in stats.items():
            self.sums[k] = self.sums.get(k, 0.0) + float(v)
        self.steps += 1

    def summary(self) -> dict[str, float]:
        """The mean of each statistic since the last summary; starts a new window."""
        n = max(1, self.steps)
        out = {k: v / n for k, v in self.sums.items()}
        self.reset()
        return out


def memory_metrics(device: torch.device, classifier_mb: float | None) -> dict[str, float]:
    """This process's resident memory, its classifier shard (rows + row optimizer state) and the CUDA peak, in MB."""
    out = {RSS_MB: psutil.Process().memory_info().rss / 2**20}
    if classifier_mb is not None:
        out[CLASSIFIER_MB] = classifier_mb
    if device.type == "cuda":
        out[CUDA_PEAK_MB] = torch.cuda.max_memory_allocated(device) / 2**20
    return out
