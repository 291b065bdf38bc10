"""``dmltrain shards build|inspect``: write WebDataset shards from a dataset layout; summarize and verify them.

A command module: what running the command needs is imported where it runs, so ``dmltrain shards --help``
answers without loading torch, Ray or the data stack (the CLI's lazy dispatch).
"""

from __future__ import annotations

import argparse
import sys

from dmltrain.errors import UserError
from dmltrain.fileio import check_output_dir
from dmltrain.text import printable
from shards.build.layouts import LAYOUTS
from shards.storage.location import Location, add_storage_option, parse_storage_options
from shards.storage.retries import IOStats


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    b = sub.add_parser(
        "build",
        help="write shards and manifest.json from a dataset layout",
        description="Write WebDataset shards (train-000000.tar, test-..., In-Shop query-/gallery-) and manifest.json. "
        "Images are grouped by class, classes in a seeded random order; unreadable images are skipped and listed.",
    )
    b.add_argument("--layout", required=True, choices=LAYOUTS, help="dataset layout of --root (synthetic: generated)")
    b.add_argument(
        "--root",
        help="dataset root (the folder holding the index files); for table the CSV or Parquet file (columns path, "
        "label, split, optional is_query/is_gallery; a path or a URL); not for synthetic",
    )
    b.add_argument(
        "--out",
        required=True,
        help="output folder for the shards and manifest.json: a path, or a URL (s3://bucket/prefix, gs://...)",
    )
    b.add_argument("--shard-size", type=int, default=2000, help="samples per shard (default 2000)")
    b.add_argument(
        "--resize",
        type=int,
        default=None,
        metavar="S",
        help="re-encode as JPEG with the shorter side at most S (default: store bytes as they are)",
    )
    b.add_argument("--strict", action="store_true", help="stop at the first unreadable image instead of skipping it")
    b.add_argument(
        "--follow-symlinks",
        action="store_true",
        help="pack images that are (or lie in folders that are) symbolic links to places outside --root "
        "(refused by default)",
    )
    b.add_argument(
        "--allow-outside-paths",
        action="store_true",
        help="table: pack images outside the table's folder (absolute paths, ../, symbolic links out of it; refused "
        "by default: a table is data, and could name any file this user can read); the summary says how many",
    )
    b.add_argument(
        "--allow-private-urls",
        action="store_true",
        help="table: fetch URLs whose host is loopback, link-local (169.254.169.254) or private (refused by default: "
        "a table could make the build fetch a cloud's metadata or an internal service); the summary says how many",
    )
    b.add_argument("--overwrite", action="store_true", help="replace the shards of a non-empty --out")
    b.add_argument(
        "--resume",
        action="store_true",
        help="finish an interrupted build in --out (same command): shards already there with the right checksum are kept",
    )
    b.add_argument(
        "--allow-shared-classes",
        action="store_true",
        help="build even when a class id is in both train and an evaluation split (refused by default: retrieval needs disjoint classes)",
    )
    b.add_argument(
        "--exclude",
        metavar="FILE",
        help="leave out the images listed in FILE (a CSV or Parquet table with a path column, or one path per "
        "line), matched against the path each sample's JSON records, in every split; e.g. likely mislabelled "
        "images, to rebuild and retrain without them",
    )
    b.add_argument("--workers", type=int, default=None, help="image-checking processes (default: CPU count, at most 8)")
    b.add_argument("--seed", type=int, default=0, help="seed of the class order (and of the synthetic images)")
    b.add_argument("--classes", type=int, help="synthetic: train classes (disjoint test classes: --test-classes)")
    b.add_argument("--per-class", type=int, help="synthetic: images per class")
    b.add_argument(
        "--test-classes",
        type=int,
        help="synthetic: test classes (default: as many as --classes; fewer: a cheaper evaluation)",
    )
    b.add_argument("--image-size", type=int, default=64, help="synthetic: image side in pixels (default 64)")
    b.add_argument(
        "--family-size",
        type=int,
        help="synthetic: classes per family, alike but for small differences (default 1: every class its own object)",
    )
    b.add_argument(
        "--family-spread",
        type=float,
        help="synthetic: how different a family's classes are, in [0, 1] (default 0.5; 0: the same object)",
    )
    b.add_argument(
        "--label-noise",
        type=float,
        help="synthetic: share of train images labelled as another class, in [0, 1) (default 0; test labels never)",
    )
    b.add_argument(
        "--label-noise-mode",
        metavar="{uniform,family}",
        help="synthetic: the wrong label is any other class (uniform, the default) or a sibling in the family",
    )
    b.add_argument("--quiet", action="store_true", help="no progress bar")
    add_storage_option(b)
    i = sub.add_parser(
        "inspect",
        help="print a shard directory's summary and verify checksums",
        description="Print the manifest summary and verify every shard's SHA-256; exits 1 naming the first bad shard.",
    )
    i.add_argument("dir", help="shard folder (holding manifest.json): a path or a URL")
    i.add_argument("--no-verify", action="store_true", help="only print the summary")
    i.add_argument("--json", action="store_true", help="print the summary as JSON")
    add_storage_option(i)


# the options of --layout synthetic (flag, attribute): refused with any other layout
SYNTHETIC_ONLY = (
    ("--classes", "classes"),
    ("--per-class", "per_class"),
    ("--test-classes", "test_classes"),
    ("--family-size", "family_size"),
    ("--family-spread", "family_spread"),
    ("--label-noise", "label_noise"),
    ("--label-noise-mode", "label_noise_mode"),
)


def _build(args: argparse.Namespace) -> int:
    opts = parse_storage_options(args.storage_option)
    out = Location(args.out, opts)
    if not out.remote:  # a URL's shards are staged in the temporary folder, a few at a time
        check_output_dir(out.path, "--out")
    if args.layout == "synthetic":
        if args.root:
            raise UserError("--root: not used with --layout synthetic (the images are generated)")
        if args.resize is not None:
            raise UserError("--resize: not used with --layout synthetic (use --image-size)")
        for flag in ("follow_symlinks", "allow_outside_paths", "allow_private_urls"):
            if getattr(args, flag):
                name = "--" + flag.replace("_", "-")
                raise UserError(f"{name}: not used with --layout synthetic (the images are generated)")
        missing = [n for n, v in (("--classes", args.classes), ("--per-class", args.per_class)) if v is None]
        if missing:
            raise UserError(f"{' and '.join(missing)}: required with --layout synthetic")
        from shards.build.synthetic import build_synthetic_shards

        result = build_synthetic_shards(
            args.out,
            args.classes,
            args.per_class,
            args.image_size,
            args.seed,
            shard_size=args.shard_size,
            overwrite=args.overwrite,
            workers=args.workers,
            progress=not args.quiet,
            resume=args.resume,
            storage_options=opts,
            family_size=1 if args.family_size is None else args.family_size,
            family_spread=0.5 if args.family_spread is None else args.family_spread,
            label_noise=0.0 if args.label_noise is None else args.label_noise,
            label_noise_mode=args.label_noise_mode or "uniform",
            exclude=args.exclude,
            test_classes=args.test_classes,
        )
    else:
        if not args.root:
            raise UserError(f"--root: required with --layout {args.layout}")
        extra = [n for n, v in SYNTHETIC_ONLY if getattr(args, v) is not None]
        if extra:
            raise UserError(f"{', '.join(extra)}: only for --layout synthetic")
        from shards.build.builder import build_layout

        result = build_layout(
            args.layout,
            args.root,
            args.out,
            shard_size=args.shard_size,
            resize=args.resize,
            seed=args.seed,
            workers=args.workers,
            strict=args.strict,
            overwrite=args.overwrite,
            progress=not args.quiet,
            allow_shared_classes=args.allow_shared_classes,
            resume=args.resume,
            storage_options=opts,
            follow_symlinks=args.follow_symlinks,
            exclude=args.exclude,
            allow_outside_paths=args.allow_outside_paths,
            allow_private_urls=args.allow_private_urls,
        )
    print("\n".join(result.summary_lines()))
    if {"query", "gallery"} <= set(result.splits):
        print(
            "evaluate query→gallery: data.eval_splits=[query,gallery] in the run config, --split query,gallery for eval"
        )
    return 0


def _inspect(args: argparse.Namespace) -> int:
    from shards.manifest import Manifest

    m = Manifest.load(args.dir, parse_storage_options(args.storage_option))
    summary = m.summary()
    if args.json:
        import json

        print(json.dumps(summary, indent=2))
    else:
        # the manifest's fields are anyone's text: printed without control characters (dmltrain.text.printable)
        print(
            f"{printable(summary['path'])}: layout {printable(summary['layout'])}, source {printable(summary['source'])}, "
            f"built {printable(summary['created'])}"
        )
        for name, s in summary["splits"].items():
            shared = (
                f" (labels shared with {', '.join(printable(x, 80) for x in s['label_space'] if x != name)})"
                if len(s["label_space"]) > 1
                else ""
            )
            print(
                f"{printable(name, 80):>8}: {s['images']:,} images, {s['classes']:,} classes{shared}, {s['shards']} shards, "
                f"{s['bytes'] / 1e6:,.1f} MB, {s['skipped']} skipped at build"
            )
    if args.no_verify:
        return 0
    stats = IOStats()
    problems = m.verify(progress=sys.stderr.isatty(), stats=stats)
    if m.location.remote and stats.retries:
        print(
            f"remote reads: {stats.counts['requests']} requests, {stats.retries} retried after transient errors",
            file=sys.stderr,
        )
    if problems:
        for p in problems:
            print(f"BAD {printable(p, None)}", file=sys.stderr)
        raise UserError(
            f"{problems[0]}" + (f" (and {len(problems) - 1} more bad shards)" if len(problems) > 1 else ""), exit_code=1
        )
    n = sum(s["shards"] for s in summary["splits"].values())
    print(f"checksums: all {n} shards match")
    return 0


def run(args: argparse.Namespace) -> int:
    return _build(args) if args.action == "build" else _inspect(args)
