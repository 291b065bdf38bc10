"""``dmltrain tune``: the command line of a Ray Tune search (see :mod:`cluster.tune`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from cluster.tune.results import render
from cluster.tune.search import tune_search
from dmltrain.config import load_config


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="YAML config of the run to tune (see configs/)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides applied before sampling, e.g. train.epochs=4")
    parser.add_argument("--space", required=True, help="search space YAML over dotted config keys (see configs/tune/)")
    parser.add_argument(
        "--trials",
        type=int,
        default=8,
        help="samples drawn from the space (x the grid size, as in Ray Tune; default 8)",
    )
    parser.add_argument(
        "--scheduler",
        choices=("fifo", "asha"),
        default="fifo",
        help="asha: stop weak trials early (async successive halving); fifo: run every trial to the end (default)",
    )
    parser.add_argument("--grace-period", type=int, default=1, help="ASHA: evaluations a trial always gets (default 1)")
    parser.add_argument(
        "--reduction-factor", type=float, default=2.0, help="ASHA: keep the top 1/factor at each rung (default 2)"
    )
    parser.add_argument(
        "--max-concurrent", type=int, help="trials at once (default: as many as the cluster's CPUs/GPUs hold)"
    )
    parser.add_argument(
        "--trial-cpus", type=float, default=0.1, help="CPUs reserved for each trial's driver (default 0.1)"
    )
    parser.add_argument("--name", help="search name (default tune-<config>-<time>)")
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue the search --name NAME: finished trials are kept, unfinished ones continue from their last "
        "checkpoint; only a search this user's dmltrain wrote is resumed (docs/security.md)",
    )
    parser.add_argument("--out", help="directory of results.md/csv and best_config.yaml (default <storage>/<name>)")
    parser.add_argument("--seed", type=int, help="random seed of the sampling (default train.seed)")
    parser.add_argument("--no-progress", action="store_true", help="no Tune status table")


def run(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)
    summary = tune_search(
        cfg,
        args.space,
        args.trials,
        scheduler=args.scheduler,
        grace_period=args.grace_period,
        reduction_factor=args.reduction_factor,
        max_concurrent=args.max_concurrent,
        trial_cpus=args.trial_cpus,
        name=args.name,
        resume=args.resume,
        out=args.out,
        seed=args.seed,
        config_name=Path(args.config).stem,
        progress=not args.no_progress,
    )
    print(render(summary))
    return 0 if summary.best is not None else 1
