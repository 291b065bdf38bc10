"""Every plot dmltrain draws, written as PNG: one matplotlib setup (an Agg canvas per figure, no
pyplot state, so threads and Ray workers can draw at once), each file written atomically.

* :func:`plot_recall_at_k`: Recall@K against K (log axis), one line per run, and a dashed
  twin for a run's ``binary/`` values (training, ``dmltrain eval``).
* :func:`plot_embedding_map`: a 2-D PCA or t-SNE map of a seeded sample of embeddings
  (a few classes), coloured by class (training, ``dmltrain eval``).
* :func:`plot_curves`: several runs' curves against the step, overlaid (``dmltrain report``).
* :func:`plot_panels`: a grid of panels of labelled lines (with error bars, a reference line,
  honest y axes) against a log x axis ticked at the measured values (``dmltrain study``).
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib
import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import FixedLocator, MaxNLocator, NullLocator
from threadpoolctl import threadpool_limits

from dmltrain.fileio import atomic_path

_RECALL = re.compile(r"^(binary/)?recall@(\d+)$")
DPI = 110


def _figure(width: float, height: float) -> Figure:
    fig = Figure(figsize=(width, height), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _save(fig: Figure, path: str | os.PathLike[str]) -> Path:
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
            ax.plot(
                ks,
                ys,
                marker="o",
                mfc="white" if prefix else color,
                color=color,
                linestyle="--" if prefix else "-",
                label=label,
            )
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
        perplexity = float(min(30.0, (len(idx) - 1) / 3))
        # One thread: scikit-learn's OpenMP loops spin-wait, and on a busy machine (training
        # workers beside it) a 2-thread t-SNE ran 30× slower than a 1-thread one.
        from sklearn.manifold import TSNE  # here: scikit-learn is about a second of a training worker's start-up

        with threadpool_limits(1):
            xy = TSNE(n_components=2, init="pca", perplexity=perplexity, random_state=seed).fit_transform(x)
        title = f"t-SNE of {len(idx)} embeddings, {len(np.unique(y))} classes"
    fig = _figure(6.4, 5.6)
    ax = fig.add_subplot()
    classes = np.unique(y)
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


def run_colors(names: Sequence[str]) -> dict[str, Any]:
    """One colour per run name, in order (tab10, or tab20 beyond ten runs), so several plots agree."""
    cmap = matplotlib.colormaps["tab10" if len(names) <= 10 else "tab20"]
    return {name: cmap(i % cmap.N) for i, name in enumerate(names)}


def plot_curves(
    data: Mapping[str, tuple[Sequence[int], Sequence[float]]],
    path: str | os.PathLike[str],
    ylabel: str,
    title: str,
    colors: Mapping[str, Any],
    ylim: tuple[float, float] | None = None,
    *,
    zero: bool = False,
    levels: Mapping[str, float] | None = None,
) -> Path | None:
    """Each run's ``(steps, values)`` overlaid against the step in one PNG; None (and no file) when ``data`` is empty.

    Points are marked on curves of at most 30 points; beyond 4 runs the legend moves beside the axes.
    ``ylim``: a fixed y range (e.g. 0 to 1 for a cosine), else matplotlib's; ``zero``: the y axis starts at 0
    (values that are all positive: a loss, whose small changes would otherwise fill the figure); ``levels``:
    dashed horizontal lines, each labelled in the legend (a loss's chance level).
    """
    if not data:
        return None
    fig = _figure(8, 4.5)
    ax = fig.add_subplot()
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    for name, (steps, values) in data.items():
        ax.plot(
            steps,
            values,
            label=name,
            color=colors[name],
            linewidth=1.4,
            marker="o" if len(steps) <= 30 else None,
            markersize=3,
        )
    for i, (label, y) in enumerate((levels or {}).items()):
        ax.axhline(y, color="0.35", linestyle=("--", ":", "-.")[i % 3], linewidth=0.9, label=label)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    values = [v for _, ys in data.values() for v in ys if v == v]  # NaN (a skipped point) left out
    if ylim is not None:
        ax.set_ylim(*ylim)
    elif zero and all(v >= 0 for v in values):
        top = max([*values, *(levels or {}).values(), 0.0])
        ax.set_ylim(0, top * 1.1 or 1.0)  # room above the highest curve or level, and for the legend
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if len(data) <= 4:
        ax.legend(fontsize=8)
    else:  # beside the axes, where it hides no curve
        ax.legend(fontsize=8 if len(data) <= 12 else 6, loc="center left", bbox_to_anchor=(1.01, 0.5))
    return _save(fig, path)


@dataclass
class Panel:
    """One panel of :func:`plot_panels`: ``lines`` maps a label to its ``(xs, ys)``; the log x axis is
    ticked at ``ticks`` only, written plainly (0.01, not 10^-2).

    ``errors``: per line, the half-height of an error bar at each point (a spread; NaN for none);
    ``baseline``: a dashed horizontal line the values are read against (0 for a change, 1 for a
    factor), always within the y range; ``zero``: the y axis starts at 0 (or ends there, for negative
    values); ``values``: each point's value written beside it, in this format (e.g. ``"{:.2f}×"``) or by this
    function (a change whose decimals depend on its size).
    """

    ylabel: str
    lines: dict[str, tuple[Sequence[float], Sequence[float]]]
    ticks: Sequence[float]
    title: str | None = None
    errors: dict[str, Sequence[float]] | None = None
    baseline: float | None = None
    zero: bool = False
    values: str | Callable[[float], str] | None = None


def _log_x(ax: Any, values: Sequence[float]) -> None:
    ticks = sorted({float(v) for v in values})
    ax.set_xscale("log")
    ax.xaxis.set_major_locator(FixedLocator(ticks))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xticklabels([f"{t:g}" for t in ticks])
    if len(ticks) == 1:
        ax.set_xlim(ticks[0] / 2, ticks[0] * 2)
    else:  # room for the end points' markers and labels
        ax.set_xlim(ticks[0] / 1.5, ticks[-1] * 1.5)


def _draw_panel(ax: Any, panel: Panel, colors: Mapping[str, Any]) -> None:
    for label, (xs, ys) in panel.lines.items():
        if not len(xs):
            continue
        err = (panel.errors or {}).get(label)
        yerr = None if err is None else [0.0 if e != e else e for e in err]
        ax.errorbar(xs, ys, yerr=yerr, marker="o", capsize=3, label=label, color=colors[label])
        if panel.values:
            for x, y in zip(xs, ys):
                if panel.baseline is not None and abs(y - panel.baseline) < 1e-9:
                    continue  # the reference itself: its value is the line's
                ax.annotate(
                    panel.values(y) if callable(panel.values) else panel.values.format(y),
                    (x, y),
                    textcoords="offset points",
                    xytext=(5, 5),
                    fontsize=7,
                    color=colors[label],
                )
    if panel.baseline is not None:
        ax.axhline(panel.baseline, color="0.35", linestyle="--", linewidth=0.9)
    lo, hi = ax.get_ylim()
    if panel.zero:
        lo, hi = min(lo, 0.0), max(hi, 0.0)
    if panel.baseline is not None:
        lo, hi = min(lo, panel.baseline), max(hi, panel.baseline)
    pad = 0.08 * (hi - lo or 1.0)
    ax.set_ylim(lo if panel.zero and lo == 0 else lo - pad, hi if panel.zero and hi == 0 else hi + pad)


def plot_panels(
    panels: Sequence[Panel],
    path: str | os.PathLike[str],
    *,
    xlabel: str,
    title: str,
    cols: int,
    panel_size: tuple[float, float],
    note: str | None = None,
) -> Path:
    """``panels`` in a grid of ``cols`` columns (``panel_size`` inches each), every line marked at its
    points (with its error bars) over a log x axis; lines without points are left out. A line keeps its
    colour across panels, and one legend names them all (none over the data);
    ``note`` is printed with it (e.g. what was not plotted and why): both go in a free panel of the grid
    when there is one, else the legend below the panels and the note under the title."""
    rows = math.ceil(len(panels) / cols)
    fig = _figure(panel_size[0] * cols, panel_size[1] * rows + 0.4)
    axes = fig.subplots(rows, cols, squeeze=False)
    labels = list(dict.fromkeys(label for p in panels for label, (xs, _) in p.lines.items() if len(xs)))
    colors = {label: f"C{i % 10}" for i, label in enumerate(labels)}
    for ax, panel in zip(axes.flat, panels):
        _draw_panel(ax, panel, colors)
        _log_x(ax, panel.ticks)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(panel.ylabel)
        if panel.title:
            ax.set_title(panel.title, fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
    spare = list(axes.flat)[len(panels) :]
    for ax in spare:
        ax.axis("off")
    handles = {}
    for ax in axes.flat:
        for h, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, h)
    if spare:  # the legend and the note in the free panel, where they crowd nothing
        if handles:
            spare[0].legend(handles.values(), handles.keys(), loc="upper left", fontsize=9, frameon=False)
        if note:
            spare[0].text(0.02, 0.02, note, ha="left", va="bottom", fontsize=8.5, color="0.25", wrap=True)
    else:
        if handles:
            fig.legend(
                handles.values(), handles.keys(), loc="outside lower center", ncols=min(6, len(handles)), fontsize=8
            )
        if note:
            title = f"{title}\n{note}"
    fig.suptitle(title)
    return _save(fig, path)
