"""The results of a ``dmltrain tune`` search: one row per trial, from Tune and from the trials' MLflow runs.

Tune's results say how each trial went as Tune saw it; the trials' MLflow runs are the full
record (a trial the scheduler stopped may evaluate once more before its process is killed).
:func:`reconcile_with_mlflow` completes the rows from the runs and gives each run its final
status. Then the table, the best trial's config as YAML, and the summary printed at the end.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cluster.tune.space import SearchSpace, apply_params
from cluster.tune.trial import trial_index, trial_run_name
from dmltrain.config import build_config
from dmltrain.redact import redact, redact_url
from dmltrain.text import finite_number, markdown_table
from dmltrain.tracking.names import ERROR_TAG, EVAL_PREFIX, REPORT_STEP, RUN_NAME_TAG, TUNE_STOPPED_TAG, metric_key
from dmltrain.tracking.queries import best_point, history, values_at_step
from dmltrain.tracking.run import RunHandle


@dataclass
class TrialRow:
    index: int
    trial_id: str
    run_name: str
    status: str  # finished, stopped early, failed
    params: dict[str, Any]
    best: float | None
    best_step: int | None
    last: float | None
    evaluations: int
    steps: int | None
    mlflow_run_id: str | None
    best_metrics: dict[str, float] = field(default_factory=dict)
    error: str | None = None


@dataclass
class TuneSummary:
    name: str
    metric: str
    mode: str
    rows: list[TrialRow]
    best: TrialRow | None
    out_dir: Path
    best_config: Path | None
    parent_run_id: str | None
    tracking_uri: str
    seconds: float
    keys: list[str] = field(default_factory=list)  # the tuned keys, in the space file's order


def results_table(summary: TuneSummary) -> tuple[list[str], list[list[Any]]]:
    keys = list(dict.fromkeys([*summary.keys, *(k for r in summary.rows for k in r.params)]))
    head = [
        "trial",
        "status",
        *keys,
        f"best {summary.metric}",
        "at step",
        f"last {summary.metric}",
        "evaluations",
        "MLflow run",
    ]
    rows = []
    for r in summary.rows:
        status = r.status + (" (best)" if summary.best is r else "")
        rows.append(
            [
                r.run_name,
                status,
                *(r.params.get(k) for k in keys),
                r.best,
                r.best_step,
                r.last,
                r.evaluations,
                r.mlflow_run_id,
            ]
        )
    return head, rows


def rows_from_results(results, space: SearchSpace, name: str) -> list[TrialRow]:
    """One row per trial from Tune's results, in trial order: its best, last and count of the metric."""
    sign = 1 if space.mode == "max" else -1
    key = space.result_key
    rows = []
    for res in results:
        trial_id = str((res.metrics or {}).get("trial_id") or (Path(res.path).name if res.path else ""))
        df = res.metrics_dataframe
        best = best_step = last = None
        best_metrics: dict[str, float] = {}
        evaluations = 0
        steps = None
        if df is not None and key in df.columns:
            vals = df[key].dropna()
            evaluations = len(vals)
            if evaluations:
                i = (vals * sign).idxmax()
                best, last = float(vals.loc[i]), float(vals.iloc[-1])
                best_step = int(df.loc[i, REPORT_STEP]) if REPORT_STEP in df.columns else None
                best_metrics = {
                    c: float(df.loc[i, c])
                    for c in df.columns
                    if c.startswith(EVAL_PREFIX) and finite_number(df.loc[i, c])
                }
                steps = int(df[REPORT_STEP].max()) if REPORT_STEP in df.columns else None
        run_id = (res.metrics or {}).get("mlflow_run_id") or None
        error = None
        if res.error is not None:
            error = (
                str(res.error).strip().splitlines()[-1][:300] if str(res.error).strip() else type(res.error).__name__
            )
        status = "failed" if res.error is not None else "finished"
        rows.append(
            TrialRow(
                0,
                trial_id,
                "",
                status,
                dict(res.config or {}),
                best,
                best_step,
                last,
                evaluations,
                steps,
                run_id,
                best_metrics,
                error,
            )
        )
    for r in rows:
        r.index = trial_index(r.trial_id)
        r.run_name = trial_run_name(name, r.index)
    return sorted(rows, key=lambda r: r.index)


def _scores_from_mlflow(row: TrialRow, run, parent: RunHandle, result_key: str, mode: str) -> None:
    """Re-score a trial from its MLflow run when the run holds evaluations Tune never received.

    A trial the scheduler stops keeps training until its process is killed, so it may evaluate
    (and keep that model as ``best_model``) after its last Tune result; the run is the full record.
    """
    points = parent.query(
        "read a trial's evaluations", lambda c: history(c, run.info.run_id, metric_key(result_key)), []
    )
    by_step = {s: v for s, v in points if s > 0}  # step 0: the untrained model, not an evaluation of the trial
    if len(by_step) <= row.evaluations:
        return
    steps = sorted(by_step)
    best_step, row.best = best_point(by_step.items(), mode)  # the first of equal bests, as Tune's idxmax
    row.best_step, row.last, row.evaluations = best_step, by_step[steps[-1]], len(steps)
    row.steps = max(row.steps or 0, steps[-1])
    metrics = parent.query(
        "read a trial's evaluation metrics", lambda c: values_at_step(c, run, best_step, EVAL_PREFIX), {}
    )
    row.best_metrics = metrics or row.best_metrics


def reconcile_with_mlflow(
    rows: list[TrialRow], parent: RunHandle, result_key: str | None = None, mode: str = "max"
) -> None:
    """Set the child runs' final status from how Tune saw each trial (and, given ``result_key``,
    complete their scores from the runs: :func:`_scores_from_mlflow`).

    A trial Tune ended without an error was stopped by the scheduler unless its run FINISHED: its
    process was killed mid-step (the run is still RUNNING) or its trainer died under it (the trial
    marked the run FAILED). Such runs end KILLED and tagged ``dmltrain.tune.stopped_early``.
    """
    by_name = {r.run_name: r for r in rows}
    for run in parent.children():
        row = by_name.get(run.data.tags.get(RUN_NAME_TAG, ""))
        if row is None:
            continue
        row.mlflow_run_id = row.mlflow_run_id or run.info.run_id
        child, status = parent.child(run.info.run_id), run.info.status
        if result_key is not None and row.status != "failed":
            _scores_from_mlflow(row, run, parent, result_key, mode)
        if row.status == "failed":
            if status == "RUNNING":
                child.finish("FAILED")
            if row.error is None and run.data.tags.get(ERROR_TAG):
                row.error = run.data.tags[ERROR_TAG].splitlines()[0][:300]
        elif status in ("RUNNING", "FAILED", "KILLED"):
            row.status = "stopped early"
            if status != "KILLED":
                child.finish("KILLED")
                child.set_tag(TUNE_STOPPED_TAG, "true")
                if ERROR_TAG in run.data.tags:  # the error of a trainer stopped under it, not the trial's
                    child.delete_tag(ERROR_TAG)


def best_config_yaml(
    base_tree: dict[str, Any], best: TrialRow, summary_name: str, space: SearchSpace, base_storage: str | None
) -> str:
    """The best trial's full config as YAML, ready for ``dmltrain train``, with a header saying where it came from."""
    tree = apply_params(base_tree, {**best.params, "train.run_name": None, "cluster.storage_path": base_storage})
    cfg = build_config(tree, source="best trial")
    sampled = "\n".join(f"#   {k}: {v!r}" for k, v in redact(best.params).items())
    header = (
        f"# Best trial of Ray Tune search {summary_name}: {best.run_name}, {space.metric} {best.best:.4f} "
        f"at step {best.best_step} (MLflow run {best.mlflow_run_id or '-'}).\n"
        f"# Sampled values:\n{sampled}\n"
        f"# Train it: dmltrain train <this file>\n"
    )
    return header + cfg.to_yaml()


def render(summary: TuneSummary) -> str:
    head, body = results_table(summary)
    lines = [markdown_table(head, body), ""]
    failed = [r for r in summary.rows if r.error]
    for r in failed:
        lines.append(f"{r.run_name} failed: {r.error}")
    if failed:
        lines.append("")
    if summary.best is None:
        lines.append(f"no trial reported {summary.metric}: nothing to pick")
    else:
        b = summary.best
        vals = ", ".join(f"{k}={v!r}" for k, v in b.params.items())
        lines.append(f"best trial {b.run_name}: {summary.metric} {b.best:.4f} at step {b.best_step} ({vals})")
        lines.append(f"best config: {summary.best_config}   (dmltrain train {summary.best_config})")
        lines.append("")
        lines.append(summary.best_config.read_text().rstrip())
    lines.append("")
    counts = {s: sum(r.status == s for r in summary.rows) for s in ("finished", "stopped early", "failed")}
    lines.append(
        f"search {summary.name}: {len(summary.rows)} trials in {summary.seconds:.0f}s ("
        + ", ".join(f"{n} {s}" for s, n in counts.items() if n)
        + ")"
    )
    lines.append(f"results: {summary.out_dir / 'results.md'}, {summary.out_dir / 'results.csv'}")
    if summary.parent_run_id:
        lines.append(f"MLflow parent run: {summary.parent_run_id} ({len(summary.rows)} child runs)")
    return redact_url("\n".join(lines))
