"""Plots for training logs and reports, written as PNG (matplotlib's Agg canvas, no pyplot state).

* :func:`plot_recall_at_k`: Recall@K against K (log axis), one line per run, and a dashed
  twin for a run's ``binary/`` values.
* :func:`plot_embedding_map`: a 2-D PCA or t-SNE map of a seeded sample of embeddings
  (a few classes), coloured by class.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from dmltrain.fileio import atomic_path

_RECALL = re.compile(r"^(binary/)?recall@(\d+)$")


def _figure(width: float, height: float) -> Any:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _save(fig: Any, path: str | os.PathLike[str]) -> Path:
    path = Path(path)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png")
    return path


def _recall_points(values: Mapping[Any, Any]) -> dict[str, dict[int, float]]:
    """``{"": {K: r}, "binary/": {K: r}}`` from ``recall@K`` keys (or bare K keys)."""
    out: dict[str, dict[int, float]] = {}
    for key, value in values.items():
        if isinstance(key, (int, np.integer)) or (isinstance(key, str) and key.isdigit()):
            prefix, k = "", int(key)
        else:
            m = _RECALL.match(str(key))
            if not m:
                continue  # map@r, nmi, counts, ...
            prefix, k = m.group(1) or "", int(m.group(2))
        out.setdefault(prefix, {})[k] = float(value)
    return out


def plot_recall_at_k(curves: Mapping[str, Mapping[Any, float]], path: str | os.PathLike[str]) -> Path:
    """Recall@K curves, one per entry of ``curves`` (``{run label: metrics dict}``), to a PNG.

    Each metrics dict contributes its ``recall@K`` keys (fractions, shown in %) and, as a
    dashed line, its ``binary/recall@K`` keys; other keys are ignored. ``ValueError`` when no
    curve has any recall value.
    """
    fig = _figure(6.4, 4.2)
    ax = fig.add_subplot()
    all_k: set[int] = set()
    lowest = 100.0
    colors = [f"C{i % 10}" for i in range(len(curves))]
    for (name, values), color in zip(curves.items(), colors):
        for prefix, points in sorted(_recall_points(values).items()):
            ks = sorted(points)
            all_k.update(ks)
            label = f"{name} (binary)" if prefix else str(name)
            ys = [100 * points[k] for k in ks]
            lowest = min(lowest, *ys)
            ax.plot(ks, ys, marker="o", mfc="white" if prefix else color, color=color, linestyle="--" if prefix else "-", label=label)
    if not all_k:
        raise ValueError("plot_recall_at_k: no recall@K values to plot")
    ax.set_xscale("log")
    ax.set_xticks(sorted(all_k))
    ax.set_xticklabels([str(k) for k in sorted(all_k)])
    ax.minorticks_off()
    ax.set_xlabel("K")
    ax.set_ylabel("Recall@K (%)")
    ax.set_ylim(max(0.0, 10 * math.floor((lowest - 2) / 10)), 100)  # zoom to the curves, on a round value
    ax.grid(True, alpha=0.3)
    ax.legend(loc="lower right", fontsize="small")
    return _save(fig, path)


def _sample(labels: np.ndarray, max_points: int, max_classes: int, rng: np.random.Generator) -> np.ndarray:
    classes = np.unique(labels)
    if len(classes) > max_classes:
        classes = rng.choice(classes, size=max_classes, replace=False)
    idx = np.flatnonzero(np.isin(labels, classes))
    if len(idx) > max_points:
        idx = np.sort(rng.choice(idx, size=max_points, replace=False))
    return idx


def plot_embedding_map(
    emb: np.ndarray,
    labels: np.ndarray,
    path: str | os.PathLike[str],
    method: str = "pca",
    max_points: int = 2000,
    max_classes: int = 20,
    seed: int = 0,
) -> Path:
    """A 2-D map of L2-normalized embeddings coloured by class, to a PNG.

    Up to ``max_classes`` classes are drawn at random (seeded), then up to ``max_points`` of
    their points. ``method``: ``pca`` (fast, linear) or ``tsne`` (scikit-learn, slower,
    shows local neighbourhoods). ``ValueError`` for fewer than 3 points or an unknown method.
    """
    if method not in ("pca", "tsne"):
        raise ValueError(f"plot_embedding_map: method must be 'pca' or 'tsne', got '{method}'")
    emb = np.asarray(emb, dtype=np.float32)
    labels = np.asarray(labels).reshape(-1)
    if emb.ndim != 2 or len(emb) != len(labels):
        raise ValueError(f"plot_embedding_map: {emb.shape} embeddings do not match {labels.shape} labels")
    rng = np.random.default_rng(seed)
    idx = _sample(labels, max_points, max_classes, rng)
    if len(idx) < 3:
        raise ValueError(f"plot_embedding_map: need at least 3 points to draw, got {len(idx)}")
    x = emb[idx].astype(np.float64)
    x /= np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)
    y = labels[idx]
    if method == "pca":
        x = x - x.mean(0)
        _, s, vt = np.linalg.svd(x, full_matrices=False)
        xy = x @ vt[:2].T if vt.shape[0] >= 2 else np.column_stack([x @ vt[0], np.zeros(len(x))])
        share = (s[:2] ** 2).sum() / max((s**2).sum(), 1e-30)
        title = f"PCA of {len(idx)} embeddings, {len(np.unique(y))} classes ({100 * share:.0f}% of variance)"
    else:
        from sklearn.manifold import TSNE
        from threadpoolctl import threadpool_limits

        perplexity = float(min(30.0, (len(idx) - 1) / 3))
        # One thread: scikit-learn's OpenMP loops spin-wait, and on a busy machine (training
        # workers beside it) a 2-thread t-SNE ran 30× slower than a 1-thread one.
        with threadpool_limits(1):
            xy = TSNE(n_components=2, init="pca", perplexity=perplexity, random_state=seed).fit_transform(x)
        title = f"t-SNE of {len(idx)} embeddings, {len(np.unique(y))} classes"
    fig = _figure(6.4, 5.6)
    ax = fig.add_subplot()
    classes = np.unique(y)
    import matplotlib

    cmap = matplotlib.colormaps["tab20"]
    for i, c in enumerate(classes):
        m = y == c
        ax.scatter(xy[m, 0], xy[m, 1], s=10, color=cmap(i % 20), label=str(c), alpha=0.8, linewidths=0)
    if len(classes) <= 20:
        ax.legend(title="class", fontsize="x-small", markerscale=1.5, loc="center left", bbox_to_anchor=(1.0, 0.5))
    ax.set_title(title, fontsize="medium")
    ax.set_xticks([])
    ax.set_yticks([])
    return _save(fig, path)
