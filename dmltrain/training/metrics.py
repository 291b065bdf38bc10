"""Training metrics between log points: step statistics averaged, named for MLflow, plus memory probes.

:meth:`TrainMetrics.add` takes a step's statistics (the objective's loss parts, the learning
rate) as they are: device scalars are summed on the device, without waiting for them, and
:meth:`TrainMetrics.summary` reads the sums back once per log point (one sync) and averages
them over the steps since the last one.
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
        self.sums: dict[str, float | torch.Tensor] = {}
        self.steps = 0

    def add(self, stats: Mapping[str, float | torch.Tensor]) -> None:
        """One step's statistics: host floats, or 0-d tensors kept where they are (no sync)."""
        for k, v in stats.items():
            if isinstance(v, torch.Tensor):
                v = v.detach().double()
            self.sums[k] = self.sums.get(k, 0.0) + v
        self.steps += 1

    def summary(self) -> dict[str, float]:
        """The mean of each statistic since the last summary (device sums read back here); starts a new window."""
        n = max(1, self.steps)
        host = {k: float(v) for k, v in self.sums.items() if not isinstance(v, torch.Tensor)}
        on_device = [k for k, v in self.sums.items() if isinstance(v, torch.Tensor)]
        by_device: dict[torch.device, list[str]] = {}
        for k in on_device:
            by_device.setdefault(self.sums[k].device, []).append(k)
        for keys in by_device.values():  # one read per device
            host.update(zip(keys, torch.stack([self.sums[k] for k in keys]).tolist()))
        out = {k: host[k] / n for k in self.sums}
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
