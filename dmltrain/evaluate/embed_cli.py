"""``dmltrain embed MODEL --shards S | --table T | --folder F --out DIR``: a gallery's embeddings, resumably.

    dmltrain embed runs/<run>/best_model/model.pt --shards data/shop --split gallery --out emb/gallery
    dmltrain embed exports/model.onnx --table catalogue.csv --out emb/catalogue --binary
    dmltrain embed model.pt --folder photos/ --out emb/photos --device cuda --resume

MODEL is a ``model.pt`` (or a folder holding one) or a file ``dmltrain export`` wrote, run through onnxruntime
(ONNX) or torch as its extension says (a TorchScript file only with ``--trust-torchscript``); images are prepared
as its contract says. The output is an embedding set
(:mod:`dmltrain.evaluate.embedding_set`): ``embeddings.npy``, ``ids.parquet`` (ids, labels, the source's
columns), ``codes.npy`` with ``--binary``, and ``embeddings.json``. The source is embedded in chunks of
``--chunk-size`` images, each saved as it is done; ``--resume`` finishes an interrupted run, skipping the
chunks already saved. Images that cannot be read are left out, counted and named in ``embeddings.json``.

A command module: what running the command needs is imported where it runs, so ``dmltrain embed --help``
answers without loading torch (the CLI's lazy dispatch).
"""

from __future__ import annotations

import argparse
import sys

from dmltrain.errors import UserError
from dmltrain.fileio import check_output_dir
from dmltrain.text import printable
from shards.storage.location import add_storage_option, parse_storage_options


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model", metavar="MODEL", help="a model.pt (or its folder), or an exported model.onnx / .pt2 / .torchscript.pt"
    )
    parser.add_argument("--shards", metavar="DIR|URL", help="a shard folder (with --split)")
    parser.add_argument(
        "--table", metavar="CSV|PARQUET", help="a table of images: column path (label, split, others optional)"
    )
    parser.add_argument("--folder", metavar="DIR", help="every image file under a folder (labels: the first subfolder)")
    parser.add_argument(
        "--allow-outside-paths",
        action="store_true",
        help="--table: read images outside the table's folder (refused by default, as by shards build)",
    )
    parser.add_argument(
        "--allow-private-urls",
        action="store_true",
        help="--table: fetch URLs whose host is loopback, link-local or private (refused by default)",
    )
    parser.add_argument(
        "--split", help="the shards' split (default: gallery if there is one, else test); a table's split"
    )
    parser.add_argument("--out", required=True, metavar="DIR", help="the embedding set's folder")
    parser.add_argument("--binary", action="store_true", help="also write the sign bits (codes.npy)")
    parser.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default)")
    parser.add_argument(
        "--precision", default="fp32", choices=["fp32", "bf16", "fp16"], help="autocast of a model.pt's forward pass"
    )
    parser.add_argument(
        "--batch-size", type=int, default=128, metavar="N", help="images per forward pass (default 128)"
    )
    parser.add_argument("--loader-workers", type=int, default=2, metavar="N", help="decoding processes (default 2)")
    parser.add_argument(
        "--chunk-size", type=int, default=10000, metavar="N", help="images per saved chunk (default 10000)"
    )
    parser.add_argument("--resume", action="store_true", help="finish an interrupted run in --out (the same command)")
    parser.add_argument(
        "--trust-torchscript",
        action="store_true",
        help="load a TorchScript MODEL: TorchScript programs can run arbitrary code, pass it only for a file you trust",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace an embedding set in --out")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    add_storage_option(parser)


def _source(args: argparse.Namespace, options: dict):
    from dmltrain.evaluate.sources import ShardSource, folder_source, table_source

    given = [n for n in ("shards", "table", "folder") if getattr(args, n)]
    if len(given) != 1:
        raise UserError("embed: give one of --shards, --table or --folder")
    if args.shards:
        from shards.manifest import Manifest

        split = args.split
        if split is None:
            splits = Manifest.load(args.shards, options).splits
            split = "gallery" if "gallery" in splits else "test"
        return ShardSource(args.shards, split, options)
    if args.table:
        return table_source(
            args.table,
            args.split,
            options,
            allow_outside=args.allow_outside_paths,
            allow_private=args.allow_private_urls,
        )
    if args.split:
        raise UserError("--split: not used with --folder")
    return folder_source(args.folder)


def run(args: argparse.Namespace) -> int:
    for name in ("batch_size", "chunk_size"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')}: must be >= 1, got {getattr(args, name)}")
    if args.loader_workers < 0:
        raise UserError(f"--loader-workers: must be >= 0, got {args.loader_workers}")
    check_output_dir(args.out, "--out")
    from dmltrain.evaluate.cli import _device

    device = _device(args.device)
    options = parse_storage_options(args.storage_option)
    source = _source(args, options)  # before the model: a bad path fails fast
    import torch
    from tqdm import tqdm

    from dmltrain.evaluate.embedding import embed_batches
    from dmltrain.evaluate.embedding_set import ChunkedWriter
    from dmltrain.evaluate.sources import iter_counted
    from dmltrain.models.binary import pack_sign_bits
    from dmltrain.models.serving import file_sha256, load_embedder
    from shards.decode.transforms import EvalTransform

    model, contract, files = load_embedder(args.model, device, trust_torchscript=args.trust_torchscript)
    if args.binary and not contract.binarizable:
        raise UserError(
            f"--binary: {args.model}'s embeddings are not centred (its head pools non-negative features), so sign bits carry no information"
        )
    plan = {
        "model": {"file": str(files[0]), "sha256": file_sha256(files[0])},
        "source": source.describe(),
        "chunk_size": args.chunk_size,
        "binary": args.binary,
        "precision": args.precision,
        "input": {
            "resize": contract.resize,
            "crop": contract.crop,
            "grayscale": contract.grayscale,
            "interpolation": contract.interpolation,
            "mean": list(contract.mean),
            "std": list(contract.std),
        },
    }
    writer = ChunkedWriter(args.out, plan, resume=args.resume, overwrite=args.overwrite)
    transform = EvalTransform(
        contract.resize, contract.crop, grayscale=contract.grayscale, interpolation=contract.interpolation
    )
    n_chunks = -(-source.count // args.chunk_size)
    kept = writer.check_done(n_chunks, source.count, contract.embedding_dim)  # a changed chunk: refused, first
    where = f"{source.kind} {getattr(source, 'where', '')}{getattr(source, 'location', '')}".strip()
    print(
        f"embedding {source.count:,} images of {where} on {device} in {n_chunks} chunks"
        + (f" ({kept} already done)" if kept else ""),
        file=sys.stderr,
    )
    channels_last = (
        device.startswith("cuda") and isinstance(model, torch.nn.Module) and getattr(model, "channels_last", False)
    )
    with tqdm(
        total=source.count, desc="embed", unit="img", file=sys.stderr, disable=args.quiet, dynamic_ncols=True
    ) as bar:
        for c in range(n_chunks):
            lo, hi = c * args.chunk_size, min((c + 1) * args.chunk_size, source.count)
            if writer.done(c):
                bar.update(hi - lo)
                continue
            batches = source.batches(lo, hi, transform, args.batch_size, args.loader_workers, contract.norm())
            emb, _, index = embed_batches(
                model,
                iter_counted(batches, bar),
                device=device,
                precision=args.precision,
                progress=False,
                channels_last=channels_last,
            )
            bar.update((hi - lo) - len(index))  # the unreadable ones
            writer.write(c, emb, index, pack_sign_bits(emb) if args.binary else None)
    info = {
        "normalized": contract.normalized,
        "model": {
            **plan["model"],
            "format": contract.format,
            "embedding_dim": contract.embedding_dim,
            "contract": contract.to_json(),
        },
        "source": source.describe(),
        "chunk_size": args.chunk_size,
    }
    result = writer.assemble(n_chunks, source.count, source.rows, info, contract.embedding_dim)
    what = ["embeddings.npy", "ids.parquet"] + (["codes.npy"] if args.binary else [])
    print(
        f"wrote {len(result):,} embeddings ({result.dim}-d{', L2-normalized' if contract.normalized else ''}) "
        f"to {args.out}: {', '.join(what)}, embeddings.json"
    )
    lost = result.info["unreadable"]
    if lost:
        print(
            f"dmltrain: warning: {lost} images could not be read and are left out "
            f"(first: {', '.join(printable(i, 200) for i in result.info['unreadable_ids'][:3])}; all counted in "
            "embeddings.json)",
            file=sys.stderr,
        )
    return 0
