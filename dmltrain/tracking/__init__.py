"""MLflow tracking: the one home of everything dmltrain writes to and reads from MLflow.

    from dmltrain.tracking import RunHandle
    run = RunHandle.for_config(cfg, "my-run", cfg.flat())     # the driver: create or resume the run
    log = RunHandle.attach(uri, run_id, system_metrics=True)  # rank 0 on a worker
    log.log_metrics({"loss": 0.7}, step=10); log.log_model(model, "best_model", step=10, input_example=x)

Modules: :mod:`.names` (every tag and metric name, as constants, in the order MLflow shows them,
and the metric-key mapping), :mod:`.run` (:class:`RunHandle`, the failure-safe handle used by
training, tune and study), :mod:`.queries` (reading runs back: by name, children, histories, the
best point, the steady-state speed; used by tune, study and report), :mod:`.description` (a run's
description, MLflow's note), :mod:`.datasets` (the shards as MLflow dataset inputs), :mod:`.links`
(links into MLflow's UI, in its model-training view).
"""

from __future__ import annotations

import os

from dmltrain.lazy_exports import lazy_exports

# Fail fast instead of retrying for minutes when the server is down (the user can override).
os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")

_EXPORTS = {
    "RunHandle": "run",
    "artifact_location": "run",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
