"""The search of ``dmltrain tune``: checks, the parent MLflow run, the Ray Tune ``Tuner``, and its outputs.

See :mod:`cluster.tune` for what a search does; :func:`tune_search` runs one and returns its
:class:`~cluster.tune.results.TuneSummary`.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import ray
from ray import tune
from ray.tune.schedulers import ASHAScheduler, FIFOScheduler
from ray.tune.search.basic_variant import BasicVariantGenerator

from cluster.launch import RunGroup, fixed_workers, init_ray, prepare_driver
from cluster.run_location import RunLocation
from cluster.tune.results import TuneSummary, best_config_yaml, reconcile_with_mlflow, results_table, rows_from_results
from cluster.tune.sealed_state import SearchState
from cluster.tune.space import load_space
from cluster.tune.trial import run_trial, trial_index
from dmltrain.errors import UserError
from dmltrain.fileio import write_text
from dmltrain.text import csv_text, markdown_table
from dmltrain.tracking.names import (
    TUNE_BEST_RUN_TAG,
    TUNE_BEST_TRIAL_TAG,
    TUNE_BEST_VALUE_PREFIX,
)


def default_max_concurrent(cfg, trial_cpus: float) -> int:
    """Trials that fit the cluster at once: its CPUs (or GPUs) over one trial's demand."""
    total = ray.cluster_resources()
    c = cfg.cluster
    if c.use_gpu:
        fit = int(total.get("GPU", 0) // c.max_workers)
    else:
        fit = int(total.get("CPU", 0) // (c.max_workers * c.cpus_per_worker + trial_cpus))
    return max(1, fit)


def tune_search(
    cfg,
    space_path: str | Path,
    trials: int,
    *,
    scheduler: str = "fifo",
    grace_period: int = 1,
    reduction_factor: float = 2.0,
    max_concurrent: int | None = None,
    trial_cpus: float = 0.1,
    name: str | None = None,
    resume: bool = False,
    out: str | Path | None = None,
    seed: int | None = None,
    config_name: str | None = None,
    progress: bool = True,
) -> TuneSummary:
    """Run a search (see the module doc) and return its summary; raises :class:`UserError` on bad input.

    ``resume``: continue the search ``name`` from the Tune state in its folder, which must be this user's
    own (:mod:`.sealed_state`); without it, a folder that holds a search already is refused."""
    started = time.time()
    if trials < 1:
        raise UserError(f"--trials {trials}: must be at least 1")
    if scheduler not in ("fifo", "asha"):
        raise UserError(f"--scheduler {scheduler}: use asha or fifo")
    if grace_period < 1:
        raise UserError(f"--grace-period {grace_period}: must be at least 1 evaluation")
    if reduction_factor <= 1:
        raise UserError(f"--reduction-factor {reduction_factor}: must be greater than 1")
    if trial_cpus < 0:
        raise UserError(f"--trial-cpus {trial_cpus}: must be >= 0")
    if max_concurrent is not None and max_concurrent < 1:
        raise UserError(f"--max-concurrent {max_concurrent}: must be at least 1")
    if resume and not name:
        raise UserError("--resume: name the search to resume (--name NAME)")

    base_storage = cfg.cluster.storage_path
    space = load_space(space_path, cfg.to_dict())  # a bad space stops before anything is built or started
    if name:  # Tune unpickles a search's state: resumed only when asked, and only from this user's own
        state = SearchState(RunLocation.of(cfg).root, name)
        if resume:
            state.check_resumable()
        elif state.exists():
            raise UserError(
                f"tune {name}: {state.root}/{name} holds a search already; resume it with --resume, or choose "
                "another --name"
            )
    fixed_workers(cfg, "tune")
    cfg = prepare_driver(cfg)  # train's checks; synthetic shards are built once, here, for every trial
    base_tree = cfg.to_dict()
    if scheduler == "asha" and cfg.eval.every == 0:
        print(
            "dmltrain: warning: eval.every is 0, so trials evaluate only at the end and ASHA cannot stop any early",
            file=sys.stderr,
        )

    search = RunGroup.place(cfg, "tune", name=name, config_name=config_name, out=out).open(
        cfg,
        {
            **cfg.flat(),
            "tune.space": str(space_path),
            "tune.trials": trials,
            "tune.scheduler": scheduler,
            "tune.metric": space.metric,
            "tune.mode": space.mode,
        },
        owner="the search",
    )
    name, parent, out_dir = search.name, search.parent, search.out_dir
    parent.log_text(space.text, "tune/space.yaml")

    init_ray(cfg)
    concurrent = max_concurrent or default_max_concurrent(cfg, trial_cpus)
    total = trials * space.grid_size
    print(
        f"tune {name}: {total} trial{'s' * (total != 1)}"
        + (f" ({space.grid_size} grid points x {trials})" if space.grid_size > 1 else "")
        + f", up to {concurrent} at once, {scheduler.upper()} on {space.metric} ({space.mode})"
        + (f"; MLflow parent run {parent.run_id}" if parent.run_id else ""),
        file=sys.stderr,
    )

    setup = {
        "base": base_tree,
        "name": name,
        "parent_run_id": parent.run_id,
        "runs_root": search.runs_root,
        "result_key": space.result_key,
    }
    trainable = tune.with_resources(tune.with_parameters(run_trial, setup=setup), {"CPU": trial_cpus})
    if scheduler == "asha":
        sched = ASHAScheduler(
            time_attr="training_iteration",
            grace_period=grace_period,
            reduction_factor=reduction_factor,
            max_t=max(grace_period, 100_000),
        )
    else:
        sched = FIFOScheduler()

    def short_name(trial) -> str:
        return f"t{trial_index(trial.trial_id):03d}"

    # Tune reads and writes its state through a file system that seals what it may unpickle (.sealed_state)
    sealed_fs, fs_root = SearchState(search.location.root, name).filesystem()
    run_config = tune.RunConfig(
        name=name,
        storage_path=fs_root,
        storage_filesystem=sealed_fs,
        verbose=1 if progress else 0,
        failure_config=tune.FailureConfig(max_failures=0, fail_fast=False),
    )
    if resume:
        print(f"tune {name}: resuming the search in {search.folder}", file=sys.stderr)
        tuner = tune.Tuner.restore(
            f"{fs_root}/{name}",
            trainable,
            resume_unfinished=True,
            resume_errored=True,
            param_space=space.param_space(),
            storage_filesystem=sealed_fs,
        )
    else:
        tuner = tune.Tuner(
            trainable,
            param_space=space.param_space(),
            tune_config=tune.TuneConfig(
                metric=space.result_key,
                mode=space.mode,
                scheduler=sched,
                num_samples=trials,
                search_alg=BasicVariantGenerator(
                    max_concurrent=concurrent, random_state=cfg.train.seed if seed is None else seed
                ),
                trial_name_creator=short_name,
                trial_dirname_creator=short_name,
            ),
            run_config=run_config,
        )
    try:
        results = tuner.fit()
    except BaseException:
        parent.finish("KILLED")
        raise

    rows = rows_from_results(results, space, name)
    reconcile_with_mlflow(rows, parent, space.result_key, space.mode)
    sign = 1 if space.mode == "max" else -1
    scored = [r for r in rows if r.best is not None]
    best = max(scored, key=lambda r: sign * r.best) if scored else None
    summary = TuneSummary(
        name,
        space.metric,
        space.mode,
        rows,
        best,
        out_dir,
        None,
        parent.run_id,
        parent.uri,
        time.time() - started,
        [d.key for d in space.dims],
    )

    head, body = results_table(summary)
    write_text(out_dir / "results.md", markdown_table(head, body) + "\n")
    write_text(out_dir / "results.csv", csv_text(head, body))
    for f in ("results.md", "results.csv"):
        parent.log_artifact(out_dir / f, "tune")
    if best is not None:
        path = out_dir / "best_config.yaml"
        write_text(path, best_config_yaml(base_tree, best, name, space, base_storage))
        summary.best_config = path
        parent.log_artifact(path, "tune")
        parent.log_metrics(best.best_metrics, step=best.best_step or 0)
        parent.set_tags(
            {
                TUNE_BEST_TRIAL_TAG: best.run_name,
                TUNE_BEST_RUN_TAG: best.mlflow_run_id or "",
                **{TUNE_BEST_VALUE_PREFIX + k: repr(v) for k, v in best.params.items()},
            }
        )
    parent.finish("FINISHED" if best is not None else "FAILED")
    return summary
