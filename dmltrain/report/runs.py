"""The runs a report compares, and what is collected of each from MLflow."""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from dmltrain.errors import UserError
from dmltrain.text import one_line, safe_name
from dmltrain.tracking.names import (
    DESCRIPTION_TAG,
    EVAL_PREFIX,
    IMAGES_PER_S,
    LOSS,
    PROBE_FULL_LOSS,
    RUN_NAME_TAG,
    STEP_MS,
    eval_key,
)
from dmltrain.tracking.queries import child_runs, experiment_runs, find_run, history, leaf_runs

LOSS_KEY = LOSS
FULL_LOSS_KEY = PROBE_FULL_LOSS  # the probe's full-softmax loss: the same loss whatever the sample ratio
RECALL1_KEY = eval_key("recall@1")
SPEED_KEYS = (IMAGES_PER_S, STEP_MS)


@dataclass
class RunRecord:
    """One compared run: identity, params, final metrics, the curves and its downloaded plots."""

    run_id: str
    name: str
    experiment_id: str
    status: str
    start_time: int | None
    end_time: int | None
    params: dict[str, str]
    metrics: dict[str, float]
    tags: dict[str, str]
    history: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    plots: list[Path] = field(default_factory=list)
    artifacts: list[str] = field(default_factory=list)

    @property
    def duration_s(self) -> float | None:
        return (self.end_time - self.start_time) / 1000 if self.start_time and self.end_time else None

    @property
    def description(self) -> str | None:
        """The run's description (MLflow's note), None when it has none."""
        return self.tags.get(DESCRIPTION_TAG) or None

    def at_step(self, key: str, step: int) -> float | None:
        """The value of metric ``key`` logged at ``step`` (the latest when logged twice); None when there is none."""
        values = [v for s, v in self.history.get(key, []) if s == step]
        return values[-1] if values else None


def natural_key(key: str) -> list[Any]:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", key)]


def resolve_tracking_uri(uri: str | None) -> str:
    """``--tracking-uri``, else ``$MLFLOW_TRACKING_URI``, else ``mlflow.db`` in the current directory (as ``dmltrain train``)."""
    uri = uri or os.environ.get("MLFLOW_TRACKING_URI")
    if uri:
        if uri.startswith("sqlite:///") and not Path(uri[len("sqlite:///") :]).is_file():
            raise UserError(f"--tracking-uri {uri}: no such SQLite file")
        return uri
    db = Path.cwd() / "mlflow.db"
    if not db.is_file():
        raise UserError(f"no MLflow store at {db}; pass --tracking-uri (an MLflow server URL or sqlite:///PATH)")
    return "sqlite:///" + str(db.resolve())


def get_experiment(client, name: str, uri: str):
    try:
        exp = client.get_experiment_by_name(name)
    except Exception as e:  # noqa: BLE001 — a server that cannot be reached is the user's to fix
        raise UserError(
            f"--tracking-uri {uri}: cannot read MLflow ({type(e).__name__}: {str(e).splitlines()[0][:200]})",
            exit_code=1,
        ) from None
    if exp is None:
        names = sorted(e.name for e in client.search_experiments())
        known = ", ".join(names[:20]) + (" ..." if len(names) > 20 else "")
        raise UserError(
            f"--experiment {name}: no such experiment in {uri} (experiments: {known or 'none'})", exit_code=1
        )
    return exp


def named_run(client, exp, token: str):
    """The run ``token`` (an id or a run name) names in ``exp``; a token naming none is refused in one line."""
    run = find_run(client, exp.experiment_id, token)
    if run is None:
        raise UserError(f"--runs {token}: no run with this id or name in experiment {exp.name}", exit_code=1)
    return run


def select_runs(client, exp, tokens: list[str] | None = None, max_runs: int = 100) -> list:
    """The runs to compare, oldest first: the given ones (or all of the experiment), parents replaced by their children."""
    if tokens:
        chosen = [named_run(client, exp, t) for t in tokens]
        out, seen = [], set()
        while chosen:
            run = chosen.pop(0)
            if run.info.run_id in seen:
                continue
            seen.add(run.info.run_id)
            kids = child_runs(client, exp.experiment_id, run.info.run_id)
            if kids:
                chosen = kids + chosen
            else:
                out.append(run)
        runs = out
    else:
        runs = leaf_runs(experiment_runs(client, exp.experiment_id))
    if not runs:
        raise UserError(f"--experiment {exp.name}: no runs to compare", exit_code=1)
    if len(runs) > max_runs:
        print(
            f"dmltrain: warning: {len(runs)} runs; the report shows the {max_runs} most recent (--max-runs)",
            file=sys.stderr,
        )
        runs = runs[-max_runs:]
    return runs


def _display_names(runs) -> list[str]:
    names = [r.data.tags.get(RUN_NAME_TAG) or r.info.run_name or r.info.run_id[:8] for r in runs]
    counts = {n: names.count(n) for n in names}
    return [f"{n} ({r.info.run_id[:6]})" if counts[n] > 1 else n for n, r in zip(names, runs)]


@contextlib.contextmanager
def _artifact_bars(on: bool):
    """MLflow's own artifact download bars on or off (``MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR``) within the block."""
    name, was = "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", os.environ.get("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR")
    if not on:
        os.environ[name] = "false"
    try:
        yield
    finally:
        if was is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = was


def collect(client, runs, out_dir: Path, progress: bool = True) -> list[RunRecord]:
    """Params, final metrics, the histories a report reads (loss, speed; every evaluation metric, the
    untrained model's at step 0 included) and plot artifacts (downloaded under ``out_dir/runs``).
    ``progress``: a bar over the runs and MLflow's download bars; off, nothing is drawn."""
    records = []
    with _artifact_bars(progress):
        for run, name in tqdm(
            list(zip(runs, _display_names(runs))),
            desc="runs",
            unit="run",
            file=sys.stderr,
            disable=not progress,
            leave=False,
        ):
            records.append(_collect_one(client, run, name, out_dir))
    return records


def _collect_one(client, run, name: str, out_dir: Path) -> RunRecord:
    info, data = run.info, run.data
    rec = RunRecord(
        info.run_id,
        name,
        info.experiment_id,
        info.status,
        info.start_time,
        info.end_time,
        dict(data.params),
        dict(data.metrics),
        dict(data.tags),
    )
    for key in (LOSS_KEY, FULL_LOSS_KEY, *SPEED_KEYS, *(k for k in rec.metrics if k.startswith(EVAL_PREFIX))):
        if key in rec.metrics:
            rec.history[key] = history(client, info.run_id, key)
    try:
        rec.artifacts = [a.path for a in client.list_artifacts(info.run_id)]
        if any(a == "plots" for a in rec.artifacts):
            rec.plots = _download_plots(client, info.run_id, out_dir / "runs" / safe_name(name) / "plots")
    except Exception as e:  # noqa: BLE001 — a missing artifact store costs the plots, not the report
        print(
            f"dmltrain: warning: run {name}: cannot read its artifacts ({one_line(e, 150)})",
            file=sys.stderr,
        )
    return rec


def _download_plots(client, run_id: str, dest: Path) -> list[Path]:
    dest.mkdir(parents=True, exist_ok=True)
    pngs = [a.path for a in client.list_artifacts(run_id, "plots") if a.path.lower().endswith(".png")]
    out = []
    with tempfile.TemporaryDirectory(dir=dest) as tmp:
        for rel in pngs:
            local = Path(client.download_artifacts(run_id, rel, tmp))
            target = dest / Path(rel).name
            os.replace(local, target)
            out.append(target)
    return sorted(out, key=lambda p: natural_key(p.name))
