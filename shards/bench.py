"""``dmltrain bench input``: shard streaming vs torchvision ImageFolder + DataLoader, images/s per loader process.

The first ``--images`` images of a split are extracted twice into a temporary folder: as an
ImageFolder tree (one file per image, bytes as stored) and as shards holding the same bytes.
Both pipelines then do the same work end to end: decode, RandomResizedCrop to ``--image-size``
+ horizontal flip, and ImageNet normalization to a float32 ``b×3×S×S`` batch in the consuming
process's hands, with the same batch size and the same number of loader processes, after one
untimed pass that warms the page cache. ImageFolder normalizes inside its loader processes;
the shard stream hands over uint8 and normalizes in the consuming process, inside the timed
loop (so that cost is counted, and not spread over the loader processes). Each is timed
``--repeat`` times, alternating, and the best run counts. The shard stream is measured with
and without JPEG draft-mode decoding. The last line is the ratio shards / ImageFolder.

With ``--shards URL`` (``s3://``, ``gs://``, ``https://``) the bench instead compares reading from the
URL with reading the same shards from local disk, in the same run: the split's shards are first
downloaded to a temporary folder, then the training stream (P×K batches, ``--k`` images per class)
is timed over the first ``--images`` images from local disk, from the URL through the shard cache
(emptied before each run, so every shard it needs is downloaded inside the timed run), and from the
URL by ranged GETs alone. The last line gives both URL figures as ratios to local disk.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from itertools import islice
from pathlib import Path

import torch
from PIL import Image
from torchvision import datasets, transforms

from dmltrain.errors import UserError
from shards.build.builder import build_shards
from shards.build.ingest import ingest_file
from shards.build.layouts import Entry, Layout
from shards.config import DataConfig
from shards.decode.transforms import IMAGENET_MEAN, IMAGENET_STD, normalize_batch
from shards.manifest import MANIFEST_NAME, Manifest
from shards.read.stream import TrainStream
from shards.read.tar_index import GroupReader
from shards.storage.location import Location, add_storage_option, is_url, parse_storage_options, read_chunks


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--shards",
        required=True,
        help="shard folder to take the images from; a URL compares reading from it with local disk",
    )
    parser.add_argument("--split", default="train")
    parser.add_argument("--images", type=int, default=2000, help="images to stream (default 2000)")
    parser.add_argument("--batch", type=int, default=64, help="batch size (default 64)")
    parser.add_argument("--image-size", type=int, default=224, help="RandomResizedCrop output (default 224)")
    parser.add_argument(
        "--loader-workers",
        type=int,
        default=1,
        help="loader processes of each pipeline (default 1: per-process figures)",
    )
    parser.add_argument(
        "--repeat", type=int, default=2, help="timed runs of each pipeline; the best counts (default 2)"
    )
    parser.add_argument("--k", type=int, default=4, help="with a URL: images per class in the P×K batches (default 4)")
    parser.add_argument(
        "--requests-in-flight",
        type=int,
        default=8,
        help="with a URL: ranged GETs in flight per loader process (default 8)",
    )
    add_storage_option(parser)


def _extract(shard_dir: str, split: str, n: int, tmp: Path) -> tuple[Path, Path, int, str]:
    """Write the first ``n`` images of ``split`` as an ImageFolder tree and as shards; return (tree, shards, count, formats)."""
    info = Manifest.load(shard_dir).split(split)
    table = info.group_table()
    reader = GroupReader(info, table)
    tree = tmp / "imagefolder"
    entries, exts = [], set()
    for g in range(len(table)):
        for pos in range(int(table.count[g])):
            if len(entries) >= n:
                break
            s = reader.sample(g, pos)
            if s is None:
                continue
            key, ext, data = s
            path = tree / f"{int(table.label[g]):06d}" / f"{key}.{ext}"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
            entries.append(Entry(str(path), str(int(table.label[g])), str(path.relative_to(tree))))
            exts.add(ext)
    reader.close()
    if not entries:
        raise UserError(f"{shard_dir}: split {split!r} has no readable images")
    layout = Layout("folder", str(tree), {"train": entries})
    out = tmp / "shards"
    build_shards(out, layout, load=ingest_file, args={"train": [e.path for e in entries]}, workers=1, progress=False)
    return tree, out, len(entries), "/".join(sorted(exts))


def _time_imagefolder(tree: Path, batch: int, size: int, workers: int) -> tuple[int, float]:
    tf = transforms.Compose(
        [
            transforms.RandomResizedCrop(size),
            transforms.RandomHorizontalFlip(),
            transforms.ToTensor(),
            transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD),
        ]
    )
    dataset = datasets.ImageFolder(str(tree), transform=tf)
    loader = torch.utils.data.DataLoader(dataset, batch_size=batch, shuffle=True, num_workers=workers, drop_last=True)
    t0 = time.perf_counter()
    n = sum(len(labels) for _, labels in loader)
    return n, time.perf_counter() - t0


def _time_shards(shards: Path, batch: int, size: int, workers: int, draft: bool) -> tuple[int, float]:
    data = DataConfig(shards=str(shards), sampler="random", batch_size=batch, image_size=size, loader_workers=workers)
    ts = TrainStream.from_config(data, 0, 0, 1, draft=draft, normalize=False)
    t0 = time.perf_counter()
    n = 0
    for images, labels in ts.epoch(0):
        # the same float32 b×3×S×S batch ImageFolder's loader hands over, normalized inside the timed loop
        # (here in the consuming process, where ImageFolder does it in its loader processes)
        images = normalize_batch(images)
        n += len(labels)
    return n, time.perf_counter() - t0


def run(args: argparse.Namespace) -> int:
    if args.images < args.batch:
        raise UserError(f"--images: {args.images} is fewer than one batch (--batch {args.batch})")
    torch.set_num_threads(1)
    if is_url(args.shards):
        return _run_url(args)
    procs = max(1, args.loader_workers)
    with tempfile.TemporaryDirectory(prefix="dmltrain-bench-input-") as tmp:
        tree, shard_dir, n, exts = _extract(args.shards, args.split, args.images, Path(tmp))
        sample = next(p for p in tree.rglob("*") if p.is_file())
        with Image.open(sample) as im:
            w, h = im.size
        print(
            f"input bench: {n} {exts} images (e.g. {w}x{h}) from {args.shards} [{args.split}], batch {args.batch}, "
            f"RandomResizedCrop {args.image_size} + flip, {args.loader_workers} loader process(es) each, best of {args.repeat}"
        )
        b, s, w = args.batch, args.image_size, args.loader_workers
        runs = {
            "torchvision ImageFolder + DataLoader": lambda: _time_imagefolder(tree, b, s, w),
            "shards TrainStream, draft decode off": lambda: _time_shards(shard_dir, b, s, w, False),
            "shards TrainStream": lambda: _time_shards(shard_dir, b, s, w, True),
        }
        for fn in runs.values():  # warm the page cache and the imports
            fn()
        best = {name: 0.0 for name in runs}
        for _ in range(max(1, args.repeat)):
            for name, fn in runs.items():
                count, seconds = fn()
                best[name] = max(best[name], count / seconds / procs)
        for name, rate in best.items():
            print(f"{name:<38} {rate:9.1f} images/s per loader process")
        base, ours = best["torchvision ImageFolder + DataLoader"], best["shards TrainStream"]
        print(f"ratio shards / ImageFolder: {ours / base:.2f}x ({ours:.1f} vs {base:.1f} images/s per loader process)")
    return 0


# -- --shards URL: the same shards from the URL and from local disk --------------------------------
def _download(url: Location, split: str, tmp: Path) -> tuple[Path, int, float]:
    """The manifest and the split's shards of ``url`` copied to ``tmp/local``; (folder, bytes, seconds)."""
    info = Manifest.load(url).split(split)
    local = tmp / "local"
    local.mkdir()
    t0 = time.perf_counter()
    (local / MANIFEST_NAME).write_bytes(url.read_bytes(MANIFEST_NAME))
    for sh in info.shards:
        with open(local / sh.file, "wb") as f:
            for chunk in read_chunks(url, sh.file, sh.bytes):
                f.write(chunk)
    return local, info.bytes, time.perf_counter() - t0


def _time_stream(
    where: str | Path, args: argparse.Namespace, remote: dict | None, cache: Path | None
) -> tuple[int, float, dict]:
    if cache is not None and cache.exists():
        shutil.rmtree(cache)  # cold: every shard the run needs is downloaded inside it
    ts = TrainStream(
        where,
        args.split,
        rank=0,
        world_size=1,
        sampler="pk",
        batch_size=args.batch,
        samples_per_class=args.k,
        seed=0,
        image_size=args.image_size,
        loader_workers=args.loader_workers,
        normalize=False,
        storage_options=parse_storage_options(args.storage_option),
        remote=remote,
    )
    steps = max(1, min(ts.batches_per_epoch, args.images // args.batch))
    t0 = time.perf_counter()
    n = 0
    for images, labels in islice(ts.epoch(0), steps):
        images = normalize_batch(images)
        n += len(labels)
    return n, time.perf_counter() - t0, ts.io_counts()


def _run_url(args: argparse.Namespace) -> int:
    url = Location(args.shards, parse_storage_options(args.storage_option))
    procs = max(1, args.loader_workers)
    with tempfile.TemporaryDirectory(prefix="dmltrain-bench-input-") as tmp:
        local, nbytes, seconds = _download(url, args.split, Path(tmp))
        cache = Path(tmp) / "cache"
        base = {"requests_in_flight": args.requests_in_flight}
        runs = {
            "local disk": lambda: _time_stream(local, args, None, None),
            "URL, shard cache (cold)": lambda: _time_stream(
                url.root, args, {**base, "cache": True, "cache_dir": str(cache)}, cache
            ),
            "URL, ranged GETs": lambda: _time_stream(url.root, args, {**base, "cache": False}, None),
        }
        print(
            f"input bench: {url} [{args.split}] against the same shards on local disk ({nbytes / 1e6:,.1f} MB downloaded in "
            f"{seconds:.1f}s); P×K batches of {args.batch} (K {args.k}), RandomResizedCrop {args.image_size} + flip, "
            f"{args.loader_workers} loader process(es), {args.requests_in_flight} requests in flight each, best of {args.repeat}"
        )
        for fn in runs.values():  # warm the page cache, the imports and the server
            fn()
        best = {name: (0.0, {}) for name in runs}
        for _ in range(max(1, args.repeat)):
            for name, fn in runs.items():
                count, secs, io = fn()
                if count / secs / procs > best[name][0]:
                    best[name] = (count / secs / procs, io)
        for name, (rate, io) in best.items():
            reads = (
                f"  ({int(io['requests'])} requests, {io['bytes'] / 1e6:,.1f} MB, {int(io['retries'])} retries)"
                if io
                else ""
            )
            print(f"{name:<26} {rate:9.1f} images/s per loader process{reads}")
        disk = best["local disk"][0]
        cached, ranged = best["URL, shard cache (cold)"][0], best["URL, ranged GETs"][0]
        print(
            f"ratio URL / local disk: {cached / disk:.2f} with the shard cache (cold), {ranged / disk:.2f} by ranged GETs alone "
            f"({cached:.1f}, {ranged:.1f} vs {disk:.1f} images/s per loader process)"
        )
    return 0
