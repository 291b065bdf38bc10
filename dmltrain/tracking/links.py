"""Links into MLflow's UI that open in its model-training view.

MLflow 3's UI opens an experiment in its GenAI view ("Traces", "Detect Issues") unless the URL asks
for the other one: every link dmltrain prints or writes carries ``workflowType=machine_learning``
(read by the UI from the query of its hash route; the experiment's ``mlflow.experimentKind`` tag
does not switch it). The UI of a SQLite store is ``mlflow ui`` on its default address; a tracking
server serves its own UI.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from urllib.parse import quote

DEFAULT_UI = "http://127.0.0.1:5000"  # `mlflow ui`'s address
WORKFLOW = "workflowType=machine_learning"


def ui_base(tracking_uri: str | None) -> str:
    """The UI of a tracking URI: the server itself for ``http(s)://``, else ``mlflow ui``'s default address."""
    uri = (tracking_uri or "").rstrip("/")
    return uri if uri.startswith(("http://", "https://")) else DEFAULT_UI


def experiment_url(ui: str, experiment_id: str) -> str:
    """The experiment's runs table."""
    return f"{ui.rstrip('/')}/#/experiments/{experiment_id}/runs?{WORKFLOW}"


def run_url(ui: str, experiment_id: str, run_id: str, tab: str = "") -> str:
    """A run's page (``tab``: ``model-metrics``, ``artifacts``, ...; empty: its overview)."""
    path = f"{ui.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}" + (f"/{tab}" if tab else "")
    return f"{path}?{WORKFLOW}"


def compare_url(ui: str, run_ids: Iterable[str], experiment_ids: Iterable[str]) -> str:
    """MLflow's comparison view of ``run_ids``."""
    runs = json.dumps(list(run_ids), separators=(",", ":"))
    exps = json.dumps(sorted(set(experiment_ids)), separators=(",", ":"))
    return (
        f"{ui.rstrip('/')}/#/compare-runs?runs={quote(runs, safe='[],')}"
        f"&experiments={quote(exps, safe='[],')}&{WORKFLOW}"
    )


def how_to_open(tracking_uri: str) -> str:
    """What to run (or open) to see the UI of ``tracking_uri``."""
    if tracking_uri.startswith("sqlite:///"):
        return f"mlflow ui --backend-store-uri {tracking_uri}"
    return ui_base(tracking_uri)
