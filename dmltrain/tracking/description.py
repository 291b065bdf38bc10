"""A run's description: the Markdown MLflow shows on the run's page (its note, ``mlflow.note.content``).

Written by rank 0 when a run starts (:func:`describe_run`: a title line, then the Results, then the
Setup: what is trained, on what data, with which losses and for how many steps) and completed after
every evaluation (:func:`describe_results`, placed by :func:`with_results` under the ``### Results``
heading, whose section it replaces): the latest and the best value of ``eval.metric`` with their
steps against the untrained model's, and Recall@1 the same way when the metric is another one. The
Results come first because MLflow shows the first lines of a long description only. After the final
evaluation the description says how the run ended. A study's parent run has one too
(:mod:`cluster.study`).

The text is plain Markdown (bullets and bold), which MLflow's note renders as it is; what in it comes from the
shards' manifest (the folder's name, the layout, split names and counts) is made inert first (:mod:`dmltrain.text`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dmltrain.text import md_code, md_text

RESULTS_HEADING = "### Results"
SETUP_HEADING = "### Setup"


def _count(n: Any) -> str:
    return f"{int(n):,}" if isinstance(n, (int, float)) else str(n)


def _params(params: Mapping[str, Any]) -> str:
    return (
        f" ({', '.join(f'{k} {v:g}' if isinstance(v, float) else f'{k} {v}' for k, v in params.items())})"
        if params
        else ""
    )


def _share(ratio: float) -> str:
    return "every class" if ratio >= 1 else f"{100 * ratio:g}% of the classes"


def data_line(summary: Mapping[str, Any], train_split: str, eval_splits: list[str]) -> str:
    """``synthetic-demo`` (layout synthetic): train 100 classes, 2,000 images; test 100 classes, 2,000 images.

    The folder's name and the manifest's fields are anyone's text: the name goes in a code span that nothing in it
    can close (:func:`~dmltrain.text.md_code`), the rest through :func:`~dmltrain.text.md_text` (no link, image or
    markup of their own, no control characters)."""
    splits = summary.get("splits") or {}
    path = str(summary.get("path") or "").rstrip("/")
    name = path.rsplit("/", 1)[-1] or path
    parts = []
    for split in [train_split, *eval_splits]:
        s = splits.get(split)
        if isinstance(s, Mapping) and s:
            parts.append(
                f"{md_text(split)} {md_text(_count(s.get('classes')))} classes, {md_text(_count(s.get('images')))} images"
            )
    return f"{md_code(name)} ({md_text(summary.get('layout') or 'unknown')} layout): " + "; ".join(parts)


def loss_line(cfg: Any, share: bool = True) -> str:
    """The objective: each loss with its weight, parameters and, for the classifier, its share of classes
    (not with ``share`` false: a study sets it per point)."""
    parts = []
    c, i = cfg.loss.classifier, cfg.loss.instance
    if c is not None:
        parts.append(
            f"classifier {c.kind}{_params(c.params)} ×{c.weight:g}"
            + (f", each step's softmax over {_share(c.sample_ratio)}" if share else "")
            + (f" ({c.sampling} draws)" if share and c.sample_ratio < 1 and c.sampling != "uniform" else "")
        )
    if i is not None:
        parts.append(f"instance {i.kind}{_params(i.params)} ×{i.weight:g}")
    return "; ".join(parts) or "none"


def title(cfg: Any, total_steps: int) -> str:
    """One line: ``normsoftmax (50% of the classes) + ice on small_cnn → 64-d, 93 steps``."""
    c, i = cfg.loss.classifier, cfg.loss.instance
    losses = []
    if c is not None:
        losses.append(c.kind + (f" ({100 * c.sample_ratio:g}% of the classes)" if c.sample_ratio < 1 else ""))
    if i is not None:
        losses.append(i.kind)
    dim = f" → {cfg.model.embedding_dim}-d" if cfg.model.embedding_dim else ""
    return f"**{' + '.join(losses) or 'no loss'} on {cfg.model.backbone}{dim}, {_count(total_steps)} steps**"


def describe_run(cfg: Any, manifest_summary: Mapping[str, Any], total_steps: int, steps_per_epoch: int) -> str:
    """The description of a run about to train (``cfg``: its :class:`~dmltrain.config.Config`), with an
    empty Results section that :func:`with_results` fills in."""
    d, m, o, t, e = cfg.data, cfg.model, cfg.optim, cfg.train, cfg.eval
    epochs = total_steps / max(1, steps_per_epoch)
    batch = f"{d.batch_size} images" + (f" ({d.P} classes × {d.samples_per_class})" if d.sampler == "pk" else "")
    pretrained = "no pretrained weights" if m.pretrained == "none" else f"pretrained: {m.pretrained}"
    what = [f"Recall@{'/'.join(str(k) for k in e.ks)}"]
    what += [name for name, on in (("MAP@R", e.map_at_r), ("NMI", e.nmi), ("binary", e.binary)) if on]
    when = f"every {e.every} {e.unit}{'s' * (e.every != 1)}" if e.every else "at the end"
    lines = [
        title(cfg, total_steps),
        "",
        RESULTS_HEADING,
        "",
        "Training: no evaluation yet.",
        "",
        SETUP_HEADING,
        "",
        f"- **Data**: {data_line(manifest_summary, d.train_split, list(d.eval_splits))}",
        f"- **Model**: {m.backbone}, {m.embedding_dim or 'backbone'}-d embedding ({m.head} head), {pretrained}",
        f"- **Losses**: {loss_line(cfg)}",
        f"- **Training**: {_count(total_steps)} steps = {epochs:.3g} epochs of {batch}, {o.name} lr {o.lr:g} "
        f"({cfg.schedule.kind}), {t.precision}, {cfg.cluster.workers_text()}, "
        f"seed {t.seed}",
        f"- **Evaluation**: {', '.join(what)} on {' → '.join(d.eval_splits)}, {when}"
        + (", and the untrained model at step 0" if e.before_training else ""),
    ]
    return "\n".join(lines)


def _metric_line(name: str, initial: Mapping, last: Mapping, best: Mapping, best_step, step, finished: bool) -> str:
    if name not in last:
        return ""
    head = f"**{name} {last[name]:.4f}** at step {step}" + (" (final)" if finished else " (latest)")
    if best and name in best and best_step is not None and best_step != step:
        head += f"; best {best[name]:.4f} at step {best_step}"
    if name in initial:
        top = max(last[name], best.get(name, last[name]) if best else last[name])
        head += f"; untrained {initial[name]:.4f}: **{100 * (top - initial[name]):+.1f} points**"
    return head


def describe_results(
    metric: str,
    initial: Mapping[str, float],
    last: Mapping[str, float],
    best: Mapping[str, float],
    best_step: int | None,
    step: int,
    total_steps: int | None = None,
    finished: bool = False,
) -> str:
    """The Results section's body: ``metric`` (the one that picks the best model) and Recall@1, each as
    latest or final value and step, best value and step when another, and the gain over the untrained
    model in points (from the better of the two)."""
    if not last:
        return "Training: no evaluation yet."
    if step == 0 and not best:  # the untrained model's evaluation, before the first step
        shown = ", ".join(f"{n} {last[n]:.4f}" for n in dict.fromkeys([metric, "recall@1"]) if n in last)
        return f"- the untrained model (step 0): {shown}" + (
            f"\n- training: step 0 of {total_steps}" if total_steps else ""
        )
    names = [metric] + (["recall@1"] if metric != "recall@1" and "recall@1" in last else [])
    lines = [f"- {line}" for n in names if (line := _metric_line(n, initial, last, best, best_step, step, finished))]
    if not finished and total_steps:
        lines.append(f"- training: step {step} of {total_steps}")
    return "\n".join(lines)


def with_results(description: str | None, results: str) -> str:
    """``description`` with the body of its Results section replaced by ``results`` (the section is
    added at the end when there is none)."""
    text = description or ""
    if RESULTS_HEADING not in text:
        return (text.rstrip() + "\n\n" if text.strip() else "") + f"{RESULTS_HEADING}\n\n{results}"
    head, rest = text.split(RESULTS_HEADING, 1)
    nxt = rest.find("\n### ")
    tail = rest[nxt:] if nxt >= 0 else ""
    return f"{head}{RESULTS_HEADING}\n\n{results}\n{tail}".rstrip() + ("\n" if tail else "")
