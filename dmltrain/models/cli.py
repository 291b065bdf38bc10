"""``dmltrain export RUN_OR_MODEL``: an embedding model as ONNX, TorchScript or a ``torch.export`` program, with
its preprocessing contract beside it, checked against PyTorch, and attached to the run's MLflow logged model.

    dmltrain export runs/<run>                                  # the run's best model as runs/<run>/best_model/model.onnx
    dmltrain export runs/<run>/model/model.pt --format pt2 --out serving/model.pt2
    dmltrain export 0123456789abcdef0123456789abcdef --fp16     # an MLflow run id (its model.pt is downloaded)

RUN_OR_MODEL is a ``model.pt``, a folder holding one, a run folder (its ``best_model``, or with
``--model final`` its ``model``), or an MLflow run (id or run name, in ``--tracking-uri``, else
``$MLFLOW_TRACKING_URI``, else ``./mlflow.db``: never a store the model file names). When the
model belongs to a run MLflow knows (the run folder's name in the experiment its config names), the
exported file and its contract are added to that run's logged model of the same name (``best_model``,
``model``) under ``serving/<format>/``, with the contract's fields as ``dmltrain.serving.<format>.*`` tags.

A command module: what running the command needs is imported where it runs, so ``dmltrain export --help``
answers without loading torch (the CLI's lazy dispatch).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from dmltrain.errors import UserError
from dmltrain.fileio import check_output_dir

FORMAT_NAMES = ("onnx", "torchscript", "pt2")
WHICH = {"best": "best_model", "final": "model"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "source",
        metavar="RUN_OR_MODEL",
        help="a model.pt, a folder holding one, a run folder (runs/<run>), or an MLflow run id or name",
    )
    parser.add_argument("--format", default="onnx", help="onnx (default), torchscript or pt2 (a torch.export program)")
    parser.add_argument("--opset", type=int, metavar="N", help="ONNX opset (default: the exporter's)")
    parser.add_argument("--fp16", action="store_true", help="half-precision weights (inputs and outputs stay float32)")
    parser.add_argument(
        "--out",
        metavar="PATH",
        help="the exported file (default: beside the model.pt, model.onnx / model.pt2 / model.torchscript.pt); "
        "its contract goes to PATH.json",
    )
    parser.add_argument(
        "--tolerance",
        type=float,
        metavar="X",
        help="largest absolute difference to PyTorch accepted (default 1e-4, with --fp16 1e-2)",
    )
    parser.add_argument("--model", choices=list(WHICH), default="best", help="a run's best (default) or final model")
    parser.add_argument(
        "--tracking-uri",
        metavar="URI",
        help="MLflow store of the run (default: $MLFLOW_TRACKING_URI, else ./mlflow.db; never the model file's config)",
    )
    parser.add_argument("--no-tracking", action="store_true", help="write the files only; MLflow is not contacted")


def _default_uri(given: str | None) -> str | None:
    """The MLflow store: ``--tracking-uri``, ``$MLFLOW_TRACKING_URI``, else ``./mlflow.db`` when it exists. Only
    the user names it: a model file's stored ``tracking.uri`` is anyone's who wrote the file, and the store
    receives the user's MLflow credentials (and a ``sqlite:`` URI creates a database wherever it points)."""
    uri = given or os.environ.get("MLFLOW_TRACKING_URI")
    if uri:
        return uri
    db = Path.cwd() / "mlflow.db"
    return "sqlite:///" + str(db.resolve()) if db.is_file() else None


def _local_model(path: Path, which: str) -> Path:
    if path.is_file():
        return path
    for candidate in (path / "model.pt", path / WHICH[which] / "model.pt"):
        if candidate.is_file():
            return candidate
    raise UserError(f"{path}: no model.pt there, nor {WHICH[which]}/model.pt (a run folder's {which} model)")


def _mlflow_model(token: str, uri: str | None, which: str, tmp: str) -> tuple[Path, Any]:
    """Download ``<best_model|model>/model.pt`` of the MLflow run ``token`` (an id, or a dmltrain run name)."""
    if uri is None:
        raise UserError(
            f"{token}: no such file or folder, and no MLflow store to look for a run of that id or name in (--tracking-uri)"
        )
    from mlflow import MlflowClient

    from dmltrain.tracking.names import RUN_NAME_TAG

    client = MlflowClient(tracking_uri=uri)
    try:
        run = None
        try:
            run = client.get_run(token)
        except Exception:  # noqa: BLE001 — not an id of this store: look it up by name next
            ids = [e.experiment_id for e in client.search_experiments()]
            found = (
                client.search_runs(ids, filter_string=f"tags.`{RUN_NAME_TAG}` = '{token}'", max_results=1)
                if ids
                else []
            )
            run = found[0] if found else None
        if run is None:
            raise UserError(f"{token}: no such file or folder, nor an MLflow run of that id or name at {uri}")
        artifact = f"{WHICH[which]}/model.pt"
        local = client.download_artifacts(run.info.run_id, artifact, tmp)
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001 — an unreachable store or a missing artifact: one line
        raise UserError(
            f"{token}: cannot fetch {WHICH[which]}/model.pt from MLflow at {uri} ({type(e).__name__}: {' '.join(str(e).split())[:160]})"
        ) from None
    return Path(local), run


def _find_run(uri: str | None, config: dict[str, Any], run_name: str) -> Any:
    """The MLflow run called ``run_name`` in the experiment the model's config names, or None (with the reason)."""
    if uri is None:
        return None, "no MLflow store found (--tracking-uri)"
    tracking = config.get("tracking") if isinstance(config.get("tracking"), dict) else {}
    experiment = tracking.get("experiment")
    experiment = experiment if isinstance(experiment, str) and experiment else "dmltrain"
    from mlflow import MlflowClient

    from dmltrain.tracking.queries import run_by_name

    try:
        client = MlflowClient(tracking_uri=uri)
        exp = client.get_experiment_by_name(experiment)
        run = run_by_name(client, exp.experiment_id, run_name) if exp is not None else None
    except Exception as e:  # noqa: BLE001 — tracking never stops an export that is already on disk
        return None, f"MLflow at {uri} is unreachable ({type(e).__name__})"
    return run, None if run is not None else f"no run named {run_name!r} in experiment {experiment!r} at {uri}"


def run(args: argparse.Namespace) -> int:
    if args.format not in FORMAT_NAMES:
        raise UserError(f"--format: unknown format {args.format!r} (choose from {', '.join(FORMAT_NAMES)})")
    if args.opset is not None and args.format != "onnx":
        raise UserError("--opset: only for --format onnx")
    if args.tolerance is not None and not args.tolerance > 0:
        raise UserError(f"--tolerance: must be positive, got {args.tolerance}")
    source = Path(args.source).expanduser()
    with tempfile.TemporaryDirectory(prefix="dmltrain-export-") as tmp:
        run_record, uri = None, None
        if source.exists():
            model_file = _local_model(source, args.model)
        elif "/" in args.source or args.source.endswith((".pt", ".pth")):
            raise UserError(f"{source}: no such file or folder")
        else:
            uri = _default_uri(args.tracking_uri)
            model_file, run_record = _mlflow_model(args.source, uri, args.model, tmp)
        from dmltrain.models.export import load_model
        from dmltrain.models.serving import FORMATS, export_model

        model, config, extra = load_model(model_file)
        if run_record is not None:
            run_name = run_record.data.tags.get("dmltrain.run_name", run_record.info.run_name)
            out = (
                Path(args.out)
                if args.out
                else Path("exports", run_name, WHICH[args.model], "model" + FORMATS[args.format])
            )
            which = WHICH[args.model]
        else:
            out = Path(args.out) if args.out else model_file.with_name("model" + FORMATS[args.format])
            which = model_file.parent.name if model_file.parent.name in WHICH.values() else WHICH[args.model]
            run_name = model_file.parent.parent.name if model_file.parent.name in WHICH.values() else None
        check_output_dir(out.parent, "--out")
        src = {
            "model_file": str(model_file if run_record is None else f"runs:/{run_record.info.run_id}/{which}/model.pt")
        }
        src.update({k: extra[k] for k in ("step", "metrics") if k in extra})
        if run_name:
            src["run_name"] = run_name
        src["model_config"] = getattr(model, "config", None) or {}
        print(
            f"exporting {src['model_file']} as {args.format}{' (fp16 weights)' if args.fp16 else ''}", file=sys.stderr
        )
        result = export_model(
            model, config, args.format, out, opset=args.opset, fp16=args.fp16, tolerance=args.tolerance, source=src
        )
    c = result.contract
    opset = f", opset {c.opset}" if c.opset else ""
    print(
        f"wrote {result.path} ({c.format}{opset}, {c.precision}; input N×3×{c.crop}×{c.crop}, embedding {c.embedding_dim}"
        f"{', L2-normalized' if c.normalized else ''})"
    )
    print(
        f"check: largest absolute difference to PyTorch {result.max_abs_diff:.3g} on batches of 1 and 7 "
        f"through {c.check['runtime']} (tolerance {c.check['tolerance']:g})"
    )
    print(f"wrote {result.files[-1]} (the preprocessing contract)")
    if args.no_tracking:
        return 0
    if run_record is None:
        if not run_name:
            print("MLflow: not attached (the model is not in a run folder)", file=sys.stderr)
            return 0
        uri = _default_uri(args.tracking_uri)
        run_record, why = _find_run(uri, config, run_name)
        if run_record is None:
            print(f"MLflow: not attached ({why})", file=sys.stderr)
            return 0
    from dmltrain.tracking.names import SERVING_TAG_PREFIX
    from dmltrain.tracking.run import RunHandle

    handle = RunHandle(uri, run_record.info.run_id, owner="the export")
    tags = {f"{SERVING_TAG_PREFIX}{c.format}.{k}": v for k, v in c.summary().items()}
    model_id = handle.attach_model_files(which, result.files, f"serving/{c.format}", tags)
    if model_id:
        print(
            f"MLflow: added to logged model {which} ({model_id}) of run {run_record.info.run_id}, under serving/{c.format}/"
        )
    return 0
