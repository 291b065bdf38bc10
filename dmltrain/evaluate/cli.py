"""``dmltrain eval``: retrieval metrics of a checkpoint on shards, or of saved embeddings.

    dmltrain eval runs/sop/best/model.pt --shards data/sop --binary --ks 1,10,100,1000
    dmltrain eval runs/inshop/model.pt --shards data/inshop --split query,gallery --save-embeddings emb/
    dmltrain eval - --embeddings emb/ --split query,gallery --out inshop.json
    dmltrain eval runs/sop/best/model.pt --shards data/sop --rerank kr --rerank-param kr_k1=20

Prints a table (values in %; float, re-ranked with ``--rerank``, binary with ``--binary``) and writes the
metrics JSON atomically (fractions in [0, 1]).
Defaults for ``--ks``, ``--split``, ``--shards``, ``--batch-size`` come from the checkpoint's
run config when it has them.

Partial data is an error, not a footnote: a shard file missing from the split stops the command
before anything is embedded (exit 2), and samples that cannot be read are left out of the
metrics, counted in the JSON as ``eval/unreadable_samples`` and make the command exit 1 after
writing it. ``--allow-missing`` accepts both (the count is still reported).

A command module: what running the command needs is imported where it runs, so ``dmltrain eval --help``
answers without loading torch, Ray or the data stack (the CLI's lazy dispatch).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from dmltrain.errors import UserError
from dmltrain.fileio import check_output_dir
from dmltrain.redact import REDACTED, redact_url, without_redacted
from shards.storage.location import Location, add_storage_option, location_of, parse_storage_options

DEFAULT_KS = [1, 2, 4, 8]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "checkpoint",
        nargs="?",
        default=None,
        help="model file from save_model, or a folder holding model.pt ('-' or omitted with --embeddings)",
    )
    parser.add_argument(
        "--shards",
        metavar="DIR|URL",
        help="shard folder, a path or a URL such as s3://bucket/sop (default: the checkpoint config's data.shards)",
    )
    parser.add_argument(
        "--split",
        metavar="SPLITS",
        help="'test' (self-retrieval) or 'query,gallery' (default: the config's data.eval_splits, else test)",
    )
    parser.add_argument(
        "--binary", action="store_true", help="also evaluate the sign bits by Hamming distance (binary/ metrics)"
    )
    parser.add_argument(
        "--ks", metavar="K,K,...", help="Recall@K cut-offs (default: the config's eval.ks, else 1,2,4,8)"
    )
    parser.add_argument(
        "--no-nmi", action="store_true", help="skip NMI (k-means with one cluster per class can be slow)"
    )
    parser.add_argument("--no-map", action="store_true", help="skip MAP@R and R-precision")
    parser.add_argument(
        "--rerank",
        choices=["none", "qe", "kr"],
        help="also re-rank each query's top candidates: qe (query expansion) or kr (k-reciprocal); rerank/ metrics "
        "(default: the config's eval.rerank, else none)",
    )
    parser.add_argument(
        "--rerank-param",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a parameter of --rerank, repeatable: candidates, qe_k, qe_alpha, kr_k1, kr_k2, kr_lambda "
        "(default: the config's eval.rerank_params)",
    )
    parser.add_argument(
        "--out",
        metavar="JSON",
        help="metrics file (default: eval_metrics.json beside the checkpoint or in the embeddings folder)",
    )
    parser.add_argument("--save-embeddings", metavar="DIR", help="write <split>.npy and <split>_labels.npy here")
    parser.add_argument(
        "--embeddings", metavar="DIR", help="evaluate embeddings saved by --save-embeddings instead of running a model"
    )
    parser.add_argument("--plots", metavar="DIR", help="also write recall_at_k.png and embedding_map.png here")
    parser.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default: auto)")
    parser.add_argument(
        "--precision", default="fp32", choices=["fp32", "bf16", "fp16"], help="forward-pass autocast precision"
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        metavar="N",
        help="images per forward pass (default: the config's data.eval_batch_size, else 128)",
    )
    parser.add_argument(
        "--loader-workers",
        type=int,
        metavar="N",
        help="decoding processes (default: the config's data.loader_workers, else 2)",
    )
    parser.add_argument("--seed", type=int, default=0, help="k-means seed for NMI")
    parser.add_argument(
        "--allow-missing",
        action="store_true",
        help="evaluate even when shard files are missing or samples unreadable (left out and counted; exit 0)",
    )
    add_storage_option(parser)  # added to the checkpoint config's data.storage_options


def _parse_ks(text: str) -> list[int]:
    try:
        ks = sorted({int(t) for t in text.split(",") if t.strip()})
    except ValueError:
        raise UserError(f"--ks: expected comma-separated positive integers, got '{text}'") from None
    if not ks or ks[0] < 1:
        raise UserError(f"--ks: expected comma-separated positive integers, got '{text}'")
    return ks


def _parse_splits(text: str | list[str]) -> list[str]:
    splits = [s.strip() for s in text.split(",")] if isinstance(text, str) else list(text)
    if len(splits) not in (1, 2) or not all(splits) or len(set(splits)) != len(splits):
        raise UserError(f"--split: expected 'test' or 'query,gallery' (one split, or two distinct ones), got '{text}'")
    return splits


def _rerank(args: argparse.Namespace, ev: dict[str, Any]) -> Any:
    """The :class:`~dmltrain.evaluate.rerank.Rerank` of ``--rerank``/``--rerank-param`` over the config's
    ``eval.rerank``/``eval.rerank_params``; None for none. Parameters are checked as the config's are."""
    import yaml
    from pydantic import ValidationError

    from dmltrain.config import RerankParams, _format_validation_error
    from dmltrain.evaluate.rerank import Rerank

    params = dict(ev.get("rerank_params") or {})
    for item in args.rerank_param:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UserError(f"--rerank-param: expected KEY=VALUE, got '{item}'")
        params[key.strip()] = yaml.safe_load(value)
    try:
        checked = RerankParams.model_validate(params)
    except ValidationError as e:
        raise UserError(_format_validation_error(e, "--rerank-param")) from None
    return Rerank.of(args.rerank or ev.get("rerank") or "none", checked)


def _checkpoint_file(text: str) -> Path:
    path = Path(text)
    if path.is_dir():
        path = path / "model.pt"
    if not path.is_file():
        raise UserError(f"{path}: checkpoint not found (give a model file or a folder holding model.pt)")
    return path


def _section(config: Any, name: str) -> dict[str, Any]:
    value = config.get(name) if isinstance(config, dict) else None
    return value if isinstance(value, dict) else {}


def _device(text: str) -> str:
    import torch

    if text == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(text)
    except RuntimeError:
        raise UserError(f"--device: unknown device '{text}'") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"--device: '{text}' asked for but CUDA is not available")
    return str(dev)


def _check_shard_files(shards: Location, splits: list[str], allow_missing: bool) -> None:
    """Refuse (or, with ``--allow-missing``, warn about) shard files of ``splits`` that are not there."""
    from shards.manifest import Manifest

    manifest = Manifest.load(shards)
    for split in splits:
        info = manifest.split(split)
        try:
            present = shards.sizes([sh.file for sh in info.shards])
        except OSError as e:
            raise UserError(f"{shards}: cannot check the shard files ({e})") from None
        missing = [sh for sh in info.shards if present[sh.file] is None]
        if not missing:
            continue
        lost = sum(sh.samples for sh in missing)
        what = f"{missing[0].url}: shard missing" + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
        what += f"; {lost} of the {info.num_images} samples of split '{split}' cannot be read"
        if not allow_missing:
            raise UserError(f"{what} (pass --allow-missing to evaluate without them)")
        print(f"dmltrain: warning: {what}; evaluating without them (--allow-missing)", file=sys.stderr)


def _embed_splits(
    args: argparse.Namespace, splits: list[str], model: Any, config: Any, device: str
) -> tuple[dict[str, tuple[Any, Any]], dict[str, int]]:
    """Each split's gathered ``(embeddings, labels)`` and its count of unreadable samples (left out)."""
    import torch

    from dmltrain.evaluate.embedding import embed_batches, gather_to_rank0
    from shards.decode.transforms import PixelNorm
    from shards.read.stream import eval_batches

    data = _section(config, "data")
    if not (args.shards or data.get("shards")):
        raise UserError("--shards: needed (the checkpoint's config names no data.shards)")
    if not args.shards and REDACTED in str(data.get("shards")):
        raise UserError(
            "--shards: needed (the checkpoint's data.shards held a password, which model files do not keep)"
        )
    # a model file keeps its config redacted: the options it lost must come from --storage-option (or the environment)
    stored, lost = without_redacted(data.get("storage_options") or {})
    if lost:
        print(
            f"dmltrain: warning: the checkpoint's data.storage_options {', '.join(lost)} were not stored (redacted); "
            "pass them with --storage-option if the shards need them",
            file=sys.stderr,
        )
    options = {**stored, **parse_storage_options(args.storage_option)}
    shards = location_of({**data, "storage_options": options}, args.shards or data.get("shards"))
    if not shards.remote and not shards.path.is_dir():
        raise UserError(f"{shards}: shard folder not found")
    batch_size = args.batch_size or int(data.get("eval_batch_size", 128))
    if batch_size < 1:
        raise UserError(f"--batch-size: must be >= 1, got {batch_size}")
    workers = args.loader_workers if args.loader_workers is not None else int(data.get("loader_workers", 2))
    _check_shard_files(shards, splits, args.allow_missing)
    spec = model.input_spec or {}  # the model file's normalization and resampling (its backbone's)
    norm, interpolation = PixelNorm.of(spec.get("mean"), spec.get("std")), spec.get("interpolation")
    out, unreadable = {}, {}
    for split in splits:
        print(f"embedding split '{split}' of {shards} on {device}", file=sys.stderr)
        batches = eval_batches(
            shards,
            split,
            rank=0,
            world_size=1,
            batch_size=batch_size,
            resize=int(data.get("eval_resize", 256)),
            crop=int(data.get("eval_crop", 224)),
            grayscale=int((data.get("augment") or {}).get("grayscale", 0)),
            loader_workers=workers,
            norm=norm,
            interpolation=interpolation,
        )
        layout = bool(_section(config, "model").get("channels_last")) and device.startswith(
            "cuda"
        )  # the run's layout, on a GPU
        emb, labels, index = embed_batches(
            model.to(memory_format=torch.channels_last) if layout else model,
            batches,
            device=device,
            precision=args.precision,
            progress=True,
            channels_last=layout,
        )
        if len(emb) == 0:
            raise UserError(f"{shards}: split '{split}' has no readable images")
        out[split] = gather_to_rank0(emb, labels, index)
        unreadable[split] = batches.num_samples - len(out[split][1])
        if batches.io.get("requests"):
            retries = sum(v for k, v in batches.io.items() if k.startswith("retries/"))
            print(
                f"split '{split}': {batches.io['requests']} remote requests, {retries} retried after transient errors",
                file=sys.stderr,
            )
    args.shards = shards
    return out, unreadable


# the metric families a table shows side by side: (key prefix, column title)
COLUMNS = (("", "float %"), ("rerank/", "rerank %"), ("binary/", "binary %"))


def format_table(metrics: dict[str, Any]) -> str:
    """Metrics as an aligned text table: one row per metric, float, re-ranked and binary columns, in %."""
    prefixed = tuple(p for p, _ in COLUMNS if p)
    names = [k for k in metrics if not k.startswith(prefixed) and isinstance(metrics[k], float)]
    for p in prefixed:
        names += [k[len(p) :] for k in metrics if k.startswith(p) and k[len(p) :] not in names]
    columns = [(p, title) for p, title in COLUMNS if not p or any(k.startswith(p) for k in metrics)]
    width = max(len(n) for n in names + ["metric"])
    lines = [f"{'metric':<{width}}  " + "  ".join(f"{title:>8}" for _, title in columns)]
    for n in names:
        cells = [metrics.get(p + n) for p, _ in columns]
        lines.append(
            f"{n:<{width}}  " + "  ".join(f"{100 * v:8.2f}" if isinstance(v, float) else f"{'-':>8}" for v in cells)
        )
    lines.append(
        f"{metrics['num_queries']} queries evaluated, {metrics['excluded_queries']} excluded (no relevant item), "
        f"gallery of {metrics['gallery_size']}"
    )
    return "\n".join(lines)


def _check_outputs(args: argparse.Namespace, ckpt: str | None) -> None:
    """Every folder this evaluation will write to, checked before the (long) evaluation starts."""
    if args.out:
        check_output_dir(Path(args.out).parent, "--out")
    elif args.embeddings or ckpt is not None:  # the default: beside the checkpoint or in the embeddings folder
        default = Path(args.embeddings) if args.embeddings else Path(ckpt) if Path(ckpt).is_dir() else Path(ckpt).parent
        check_output_dir(
            default, "--out (default: beside the checkpoint)" if ckpt else "--out (default: the --embeddings folder)"
        )
    for option, folder in (("--save-embeddings", args.save_embeddings), ("--plots", args.plots)):
        if folder:
            check_output_dir(folder, option)


def run(args: argparse.Namespace) -> int:
    from dmltrain.fileio import write_json

    ckpt = None if args.checkpoint in (None, "-") else args.checkpoint
    if ckpt is None and not args.embeddings:
        raise UserError("eval: give a CHECKPOINT, or --embeddings DIR to evaluate saved embeddings")
    if ckpt is not None and args.embeddings:
        raise UserError("eval: give either a CHECKPOINT or --embeddings DIR, not both (use '-' for no checkpoint)")
    _check_outputs(args, ckpt)
    device = _device(args.device)
    config: Any = {}
    model = None
    ckpt_path = None
    if ckpt is not None:
        ckpt_path = _checkpoint_file(ckpt)
        from dmltrain.models import load_model

        model, config, _ = load_model(ckpt_path, map_location=device)
    ev = _section(config, "eval")
    ks = _parse_ks(args.ks) if args.ks else sorted(set(ev.get("ks") or DEFAULT_KS))
    splits = _parse_splits(args.split or _section(config, "data").get("eval_splits") or ["test"])
    binary = args.binary or bool(ev.get("binary", False))
    rerank = _rerank(args, ev)

    if args.embeddings:
        from dmltrain.evaluate.store import load_embeddings

        gathered = {s: load_embeddings(args.embeddings, s) for s in splits}
        unreadable: dict[str, int] | None = None
    else:
        gathered, unreadable = _embed_splits(args, splits, model, config, device)
    lost = sum(unreadable.values()) if unreadable else 0
    if args.save_embeddings:
        from dmltrain.evaluate.store import save_embeddings

        for split, (emb, labels) in gathered.items():
            print(f"saved {save_embeddings(args.save_embeddings, split, emb, labels)}", file=sys.stderr)

    from dmltrain.evaluate.retrieval import retrieval_metrics

    q, ql = gathered[splits[0]]
    g, gl = gathered[splits[1]] if len(splits) == 2 else (None, None)
    try:
        metrics = retrieval_metrics(
            q,
            ql,
            g,
            gl,
            ks=ks,
            nmi=not args.no_nmi,
            map_at_r=not args.no_map,
            binary=binary,
            seed=args.seed,
            device=device,
            progress=True,
            rerank=rerank,
        )
    except ValueError as e:
        raise UserError(f"{args.embeddings or ckpt_path}: {e}") from None
    print(format_table(metrics))
    if lost:
        print(
            f"{lost} unreadable samples left out of these metrics ({', '.join(f'{k}: {v}' for k, v in unreadable.items())})"
        )

    out = (
        Path(args.out)
        if args.out
        else (Path(args.embeddings) if args.embeddings else ckpt_path.parent) / "eval_metrics.json"
    )  # type: ignore[union-attr]
    record = {
        "metrics": metrics,
        "splits": splits,
        "ks": ks,
        "rerank": None if rerank is None else vars(rerank),
        "checkpoint": str(ckpt_path) if ckpt_path else None,
        "shards": None if args.embeddings else redact_url(str(args.shards)),
        "embeddings": args.embeddings,
        # samples of the shards left out because they could not be read (null for saved embeddings)
        "eval/unreadable_samples": None if unreadable is None else lost,
        "unreadable_by_split": unreadable,
    }
    write_json(out, record)
    print(f"wrote {out}", file=sys.stderr)
    if args.plots:
        from dmltrain.evaluate.plots import plot_embedding_map, plot_recall_at_k

        name = ckpt_path.stem if ckpt_path else Path(args.embeddings).name
        print(f"wrote {plot_recall_at_k({name: metrics}, Path(args.plots) / 'recall_at_k.png')}", file=sys.stderr)
        print(
            f"wrote {plot_embedding_map(q, ql, Path(args.plots) / 'embedding_map.png', seed=args.seed)}",
            file=sys.stderr,
        )
    if lost and not args.allow_missing:
        total = sum(len(labels) for _, labels in gathered.values()) + lost
        raise UserError(
            f"{args.shards}: {lost} of {total} samples could not be read and are left out of the metrics in {out} "
            "(pass --allow-missing to accept partial data)",
            exit_code=1,
        )
    return 0
