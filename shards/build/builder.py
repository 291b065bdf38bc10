"""Build a shard directory: read a layout, check images in parallel, write grouped shards, then the manifest.

Order inside a split: images grouped by class, classes in a seeded random order (the same
seed gives the same shards), each class's images in index order. Labels are contiguous over
the sorted original class ids of the split's label space. Images that cannot be read are
skipped and listed in the manifest (``strict`` stops at the first one instead). A table's splits
(``--layout table``) also get a rows file, ``<split>-rows.parquet`` (each written sample's path, class id and
the table's other columns, by its index), published like a shard and listed in the manifest.

A layout may carry class families (:attr:`Layout.families`: the manifest lists each label's family) and
deliberately wrong labels (:attr:`Entry.clean_class_id`: each such sample's metadata holds its
``clean_label``, and the manifest lists the split indexes whose label differs from the true one).

The output may be a local folder or a URL (``s3://bucket/prefix``, ``gs://...``): shards are
uploaded as they are finished (:mod:`shards.build.publish`). The manifest is written last and atomically:
a folder without ``manifest.json`` is an unfinished build, and readers refuse it; ``resume``
finishes one, keeping the shards already in place with the right checksum.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import signal
import sys
import threading
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

from dmltrain.errors import UserError
from dmltrain.fileio import atomic_path
from dmltrain.redact import redact_url
from dmltrain.text import printable
from shards.build.exclude import apply_exclude, read_exclude
from shards.build.ingest import ingest_file, ingest_source, load_or_skip
from shards.build.layouts import READERS, Entry, Layout, class_sort_key, confine
from shards.build.publish import Publisher
from shards.build.table import read_table, table_guard
from shards.build.writer import ShardRecord, SplitWriter
from shards.config import MAX_IMAGE_SIDE
from shards.manifest import FORMAT, MANIFEST_NAME, VERSION
from shards.storage.location import Location, open_location

# below this many images a build runs in-process: a pool costs more than it saves
POOL_MIN_IMAGES = 512


@dataclass
class SplitResult:
    images: int = 0
    classes: int = 0
    shards: int = 0
    bytes: int = 0
    skipped: list[dict[str, str]] = field(default_factory=list)


@dataclass
class BuildResult:
    out_dir: Path | str  # a local folder, or the URL built to
    splits: dict[str, SplitResult]
    seconds: float
    uploads: str | None = None  # for a URL: the uploads (and shards kept by --resume)
    excluded: tuple[str, int] | None = None  # --exclude: the file and how many images it left out
    allowed: dict[str, int] = field(default_factory=dict)  # what a flag let through (Layout.allowed), by flag

    def summary_lines(self) -> list[str]:
        lines = []
        for name, r in self.splits.items():
            lines.append(
                f"{name:>8}: {r.images:,} images, {r.classes:,} classes, {r.shards} shard{'s' * (r.shards != 1)}, "
                f"{r.bytes / 1e6:,.1f} MB, {len(r.skipped)} skipped"
            )
        skipped = [s for r in self.splits.values() for s in r.skipped]
        for s in skipped[:10]:  # a table's paths are anyone's text: without control characters
            lines.append(f"  skipped {printable(s['path'])}: {printable(s['reason'])}")
        if len(skipped) > 10:
            lines.append(f"  ... and {len(skipped) - 10} more skipped (listed in {self.out_dir}/{MANIFEST_NAME})")
        total_images = sum(r.images for r in self.splits.values())
        total_bytes = sum(r.bytes for r in self.splits.values())
        lines.append(
            f"wrote {total_images:,} images in {sum(r.shards for r in self.splits.values())} shards "
            f"({total_bytes / 1e6:,.1f} MB) to {self.out_dir} in {self.seconds:.1f}s; {len(skipped)} skipped"
        )
        if self.excluded is not None:
            file, n = self.excluded
            lines.append(f"left out {n:,} image{'s' * (n != 1)} listed in {file} (--exclude)")
        what = {
            "--allow-outside-paths": "from outside the table's folder",
            "--allow-private-urls": "from loopback, link-local or private hosts",
        }
        for flag, n in self.allowed.items():
            lines.append(f"{flag}: {n:,} of the table's images {what.get(flag, 'let through')} were allowed")
        if self.uploads:
            lines.append(self.uploads)
        return lines


def read_layout(
    name: str, root: str | os.PathLike[str], storage_options: dict[str, Any] | None = None, **table: bool
) -> Layout:
    """Parse the index of layout ``name`` under ``root`` (any of :data:`~shards.build.layouts.READERS`), or the table file ``root``
    (``table``: a path or a URL, read with ``storage_options`` like the image URLs it lists, and confined as
    :func:`shards.build.table.read_table` says; ``table`` holds its ``allow_outside`` and ``allow_private``)."""
    if name == "table":
        return read_table(root, storage_options, **table)
    if name not in READERS:
        raise UserError(f"--layout: unknown layout {name!r} (choose from {', '.join(READERS)})")
    root = Path(root).expanduser()
    if not root.is_dir():
        raise UserError(f"{root}: dataset root not found")
    return READERS[name](root.resolve())


def _is_number_list(x: Any) -> bool:
    return isinstance(x, list) and bool(x) and all(isinstance(v, (int, float)) for v in x)


def manifest_json(obj: Any, level: int = 0) -> str:
    """``json.dumps(obj, indent=1)``, except that a non-empty list of numbers goes on one line without spaces
    (a group row, ``class_counts``), so the group table stays one short line per class. Strings, keys
    included, are always encoded by :func:`json.dumps` and never rewritten."""
    if _is_number_list(obj):
        return json.dumps(obj, separators=(",", ":"))
    pad = " " * (level + 1)
    if isinstance(obj, dict) and obj:
        items = [f"{pad}{json.dumps(str(k))}: {manifest_json(v, level + 1)}" for k, v in obj.items()]
        return "{\n" + ",\n".join(items) + "\n" + " " * level + "}"
    if isinstance(obj, (list, tuple)) and obj:
        return "[\n" + ",\n".join(pad + manifest_json(v, level + 1) for v in obj) + "\n" + " " * level + "]"
    return json.dumps(obj)


def check_disjoint_classes(layout: Layout, allow_shared: bool = False) -> list[str]:
    """Refuse a layout whose label spaces share an original class id (train vs test, or vs In-Shop query/gallery).

    Retrieval benchmarks evaluate on classes never seen in training; a folder tree that reuses a
    class name under ``train/`` and ``test/`` (or an edited index) would silently break that. Raises
    :class:`UserError` naming the first shared class, the splits and the layout; with ``allow_shared``
    it only warns (on stderr) and returns the shared ids.
    """
    spaces = layout.spaces()
    ids = [{e.class_id for s in space for e in layout.splits[s]} for space in spaces]
    for i in range(len(spaces)):
        for j in range(i + 1, len(spaces)):
            shared = sorted(ids[i] & ids[j], key=class_sort_key)
            if not shared:
                continue
            a, b = "+".join(spaces[i]), "+".join(spaces[j])
            more = f" (and {len(shared) - 1} more)" if len(shared) > 1 else ""
            rows = [
                next((e.row for s in space for e in layout.splits[s] if e.class_id == shared[0]), None)
                for space in (spaces[i], spaces[j])
            ]
            where = f" (rows {rows[0]} and {rows[1]}, column label)" if None not in rows else ""
            msg = (
                f"--layout {layout.name} --root {layout.root}: class {shared[0]!r}{more} is in both the {a} and the {b} split{where}; "
                f"retrieval needs disjoint train and evaluation classes"
            )
            if not allow_shared:
                raise UserError(msg + " (pass --allow-shared-classes to build anyway)")
            print(
                f"WARNING: {msg}; building anyway (--allow-shared-classes): evaluation will see training classes",
                file=sys.stderr,
            )
            return shared
    return []


def _split_seed(seed: int, split: str) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(split.encode()), 0x5EED])


def build_shards(
    out_dir: str | os.PathLike[str] | Location,
    layout: Layout,
    *,
    load: Callable[[Any], tuple[bytes, str]],
    args: dict[str, Sequence[Any]],
    shard_size: int = 2000,
    seed: int = 0,
    workers: int | None = None,
    strict: bool = False,
    overwrite: bool = False,
    progress: bool = True,
    options: dict[str, Any] | None = None,
    allow_shared_classes: bool = False,
    resume: bool = False,
    storage_options: dict[str, Any] | None = None,
    exclude: str | os.PathLike[str] | None = None,
) -> BuildResult:
    """Write every split of ``layout`` to ``out_dir`` (a local folder, or a URL with ``storage_options``).

    ``args[split][i]`` is what ``load`` (a picklable function) turns into ``(bytes, extension)``
    for ``layout.splits[split][i]``; it raises :class:`SkipImage` for an unusable image.
    Splits in different label spaces must not share an original class id
    (:func:`check_disjoint_classes`; checked before anything in ``out_dir`` is touched).
    ``overwrite`` replaces a previous build, ``resume`` finishes an interrupted one (:mod:`shards.build.publish`).
    ``exclude`` names a file of paths to leave out (:mod:`shards.build.exclude`), read and checked first.
    """
    out = open_location(out_dir, storage_options)
    if shard_size < 1:
        raise UserError(f"--shard-size: must be at least 1, got {shard_size}")
    excluded, left_out = None, None
    if exclude is not None:
        listing = read_exclude(exclude)
        layout, args, n = apply_exclude(layout, args, listing)
        excluded, left_out = listing.record(n), (listing.file, n)
    shared = check_disjoint_classes(layout, allow_shared_classes)
    with Publisher(out, overwrite=overwrite, resume=resume) as publisher:
        publisher.prepare()
        splits_json, results, t0 = _write_splits(
            publisher, layout, shard_size, seed, workers, strict, progress, load, args
        )
        manifest = {
            "format": FORMAT,
            "version": VERSION,
            "layout": layout.name,
            "source": redact_url(layout.root),
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "options": {
                "shard_size": shard_size,
                "seed": seed,
                **(options or {}),
                **({"shared_classes": len(shared)} if shared else {}),
                **({"excluded": excluded} if excluded is not None else {}),
                **({"allowed": dict(layout.allowed)} if layout.allowed else {}),
            },
            "splits": {name: splits_json[name] for name in layout.splits},
        }
        publisher.finish(manifest_json(manifest) + "\n")
    shown = str(out) if out.remote else out.path  # a URL as messages show it (no password)
    return BuildResult(
        shown,
        {name: results[name] for name in layout.splits},
        time.perf_counter() - t0,
        publisher.summary(),
        left_out,
        dict(layout.allowed),
    )


def _write_splits(publisher: Publisher, layout: Layout, shard_size, seed, workers, strict, progress, load, args):
    from tqdm import tqdm

    workers = max(1, workers if workers is not None else min(8, os.cpu_count() or 1))
    total = sum(len(v) for v in layout.splits.values())
    pool = _pool(workers) if workers > 1 and total >= POOL_MIN_IMAGES else None
    t0 = time.perf_counter()
    splits_json: dict[str, Any] = {}
    results: dict[str, SplitResult] = {}
    # per split, what each written sample's row holds (a table's path, class id and other columns)
    rows_of: dict[str, list[tuple[int, Entry]]] = {split: [] for split in layout.splits}
    try:
        for space in layout.spaces():
            # a true class whose every image was relabelled (label noise) keeps its label, with no images
            ids = {e.class_id for s in space for e in layout.splits[s]}
            ids |= {e.clean_class_id for s in space for e in layout.splits[s] if e.clean_class_id is not None}
            ids = sorted(ids, key=class_sort_key)
            mapping = {c: i for i, c in enumerate(ids)}
            for split in space:
                entries = layout.splits[split]
                bar = tqdm(
                    total=len(entries),
                    desc=split,
                    unit="img",
                    file=sys.stderr,
                    disable=not progress,
                    dynamic_ncols=True,
                )
                res, sj = _write_split(
                    publisher,
                    split,
                    entries,
                    args[split],
                    mapping,
                    load=load,
                    pool=pool,
                    shard_size=shard_size,
                    rng=_split_seed(seed, split),
                    strict=strict,
                    bar=bar,
                    written=rows_of[split] if layout.columns is not None else None,
                )
                sj["label_space"] = list(space)
                if layout.families is not None:
                    sj["families"] = [layout.families[c] for c in ids]
                if layout.columns is not None:
                    sj["rows"] = _write_rows(publisher, split, rows_of[split], layout.columns)
                splits_json[split] = sj
                results[split] = res
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
    return splits_json, results, t0


def _pool(workers: int):
    """A pool of ``workers`` image-checking processes that a Ctrl-C ends with the build's one line.

    Ctrl-C signals the terminal's whole process group. A worker interrupted while it imports would print a
    traceback, and one interrupted while it holds the pool's task queue would deadlock ``terminate()``. So the
    workers ignore SIGINT from their first step, their stderr is ``/dev/null`` (what they raise comes back
    through the pool; an interrupt during their start-up dies silently), and a Ctrl-C that arrives while the
    pool starts is held and raised once it stands, so that the pool is always ended (``terminate``) by the
    build, never orphaned half-made.
    """
    import multiprocessing as mp

    # spawn, not fork: the caller may be a threaded process (Ray, DeepSpeed); the jobs live in
    # light modules (shards.build.ingest, shards.build.synthetic) so the children never import torch
    ctx = mp.get_context("spawn")
    ignore = {"initializer": signal.signal, "initargs": (signal.SIGINT, signal.SIG_IGN)}
    if threading.current_thread() is not threading.main_thread():  # only the main thread handles signals
        return ctx.Pool(workers, **ignore)
    held: list[int] = []
    handler = signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum))
    stderr, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)  # what the workers inherit as their stderr
        pool = ctx.Pool(workers, **ignore)
    finally:
        os.dup2(stderr, 2)
        os.close(stderr)
        os.close(devnull)
        signal.signal(signal.SIGINT, handler)
    if held:
        pool.terminate()
        pool.join()
        raise KeyboardInterrupt
    return pool


def _write_split(
    publisher: Publisher,
    split,
    entries: list[Entry],
    args,
    mapping,
    *,
    load,
    pool,
    shard_size,
    rng,
    strict,
    bar,
    written: list[tuple[int, Entry]] | None = None,
):
    by_label: dict[int, list[int]] = {}
    for i, e in enumerate(entries):
        by_label.setdefault(mapping[e.class_id], []).append(i)
    labels = np.array(sorted(by_label), dtype=np.int64)
    order = labels[rng.permutation(len(labels))] if len(labels) else labels
    sequence = [i for label in order for i in by_label[int(label)]]
    job = functools.partial(load_or_skip, load)
    results = (
        pool.imap(job, (args[i] for i in sequence), chunksize=8)
        if pool is not None
        else map(job, (args[i] for i in sequence))
    )
    res = SplitResult()
    class_counts = [0] * len(mapping)
    noisy = any(e.clean_class_id is not None for e in entries)
    flipped: dict[str, list[int]] = {"index": [], "clean_label": []}
    with bar, SplitWriter(publisher.staging, split, shard_size, on_shard=publisher.shard_done) as writer:
        it = iter(results)
        for label in order:
            label = int(label)
            members = by_label[label]
            writer.begin_group(label, len(members))
            for i in members:
                ok, data, ext_or_reason = next(it)
                e = entries[i]
                bar.update(1)
                if not ok:
                    if strict:
                        raise UserError(f"{e.path}: {ext_or_reason} (--strict stops at the first bad image)")
                    res.skipped.append({"path": e.relpath, "reason": redact_url(ext_or_reason)})
                    continue
                meta: dict[str, Any] = {
                    "class_id": e.class_id,
                    "path": e.relpath,
                    **({"extra": dict(e.extra)} if e.extra else {}),
                }
                if e.clean_class_id is not None:
                    clean = mapping[e.clean_class_id]
                    meta.update(clean_label=clean, clean_class_id=e.clean_class_id)
                    if clean != label:
                        flipped["index"].append(writer.num_samples)  # the index write() gives this sample
                        flipped["clean_label"].append(clean)
                if written is not None:
                    written.append((writer.num_samples, e))
                writer.write(label, data, ext_or_reason, meta)
                class_counts[label] += 1
    res.images = writer.num_samples
    res.classes = sum(1 for c in class_counts if c)
    res.shards = len(writer.shards)
    res.bytes = sum(s.bytes for s in writer.shards)
    sj = {
        "num_images": res.images,
        "num_classes": res.classes,
        "num_labels": len(mapping),
        "classes": mapping,
        "class_counts": class_counts,
        "skipped": res.skipped,
        "shards": [s.to_json() for s in writer.shards],
    }
    if noisy:
        sj["noisy_labels"] = flipped
    return res, sj


def _write_rows(publisher: Publisher, split: str, written: list[tuple[int, Entry]], columns: list[str]) -> dict:
    """``<split>-rows.parquet``: one row per sample of the split, by its index (the position the shards give it):
    ``index``, ``path`` (as the table wrote it), ``class_id``, then the table's other ``columns``, all text.
    Published like a shard; returns its manifest entry."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    data = {
        "index": pa.array([i for i, _ in written], pa.int64()),
        "path": pa.array([e.relpath for _, e in written], pa.string()),
        "class_id": pa.array([e.class_id for _, e in written], pa.string()),
    }
    extra = [dict(e.extra) for _, e in written]  # each row's once: per column, it grew with the columns squared
    for c in columns:
        data[c] = pa.array([row.get(c) for row in extra], pa.string())
    name = f"{split}-rows.parquet"
    path = publisher.staging / name
    with atomic_path(path) as tmp:
        pq.write_table(pa.table(data), tmp)
    record = ShardRecord(name, len(written), path.stat().st_size, hashlib.sha256(path.read_bytes()).hexdigest())
    entry = {"file": name, "bytes": record.bytes, "sha256": record.sha256, "columns": list(columns)}
    publisher.shard_done(record, path)
    return entry


def build_layout(
    layout_name: str,
    root: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    shard_size: int = 2000,
    resize: int | None = None,
    seed: int = 0,
    workers: int | None = None,
    strict: bool = False,
    overwrite: bool = False,
    progress: bool = True,
    allow_shared_classes: bool = False,
    resume: bool = False,
    storage_options: dict[str, Any] | None = None,
    follow_symlinks: bool = False,
    exclude: str | os.PathLike[str] | None = None,
    allow_outside_paths: bool = False,
    allow_private_urls: bool = False,
) -> BuildResult:
    """``dmltrain shards build --layout NAME --root ROOT --out DIR``: shards from an official layout, a folder tree,
    or a table (``ROOT`` the CSV or Parquet file; its URLs are read with ``storage_options``).

    Every image of a layout must lie inside ``root`` (:func:`~shards.build.layouts.confine`); with
    ``follow_symlinks`` symbolic links may point outside it. A table's images must lie under its folder (the same
    ``follow_symlinks`` for its links) and its URLs reach public hosts (:mod:`shards.build.table`), unless
    ``allow_outside_paths`` or ``allow_private_urls`` (each named in the summary with what it let through).
    ``exclude``: see :func:`build_shards`."""
    if resize is not None and not 8 <= resize <= MAX_IMAGE_SIDE:
        raise UserError(f"--resize: must be in [8, {MAX_IMAGE_SIDE}] pixels, got {resize}")
    table = layout_name == "table"
    if not table and (allow_outside_paths or allow_private_urls):
        flag = "--allow-outside-paths" if allow_outside_paths else "--allow-private-urls"
        raise UserError(f"{flag}: only for --layout table (a layout's images lie under --root: see --follow-symlinks)")
    flags = (
        {"allow_outside": allow_outside_paths, "allow_private": allow_private_urls, "follow_symlinks": follow_symlinks}
        if table
        else {}
    )
    layout = read_layout(layout_name, root, storage_options, **flags)
    if not table:
        confine(layout, follow_symlinks)
    # a table may list URLs, read with the options of --out (its images and shards may share a store), each
    # connection checked as the table's were (shards.storage.location.HostGuard)
    load = (
        functools.partial(
            ingest_source,
            resize=resize,
            storage_options=storage_options or {},
            guard=table_guard(os.fspath(root), allow_private_urls),
        )
        if table
        else functools.partial(ingest_file, resize=resize)
    )
    args = {s: [e.path for e in entries] for s, entries in layout.splits.items()}
    return build_shards(
        out_dir,
        layout,
        load=load,
        args=args,
        shard_size=shard_size,
        seed=seed,
        workers=workers,
        strict=strict,
        overwrite=overwrite,
        progress=progress,
        options={"resize": resize},
        allow_shared_classes=allow_shared_classes,
        resume=resume,
        storage_options=storage_options,
        exclude=exclude,
    )
