"""``dmltrain noisy-labels CHECKPOINT --angle 80 --out noisy.csv``: the train samples a sub-center model
places far from their class, to rebuild the shards without them (sub-center ArcFace's noisy-label recipe).

    dmltrain train cfg.yaml train.run_name=k3 loss.classifier.params.subcenters=3
    dmltrain noisy-labels runs/k3/checkpoint-step00001200 --angle 80 --out noisy.csv
    dmltrain shards build --layout synthetic ... --exclude noisy.csv --out data/cleaned
    dmltrain train cfg.yaml data.shards=data/cleaned

Deng et al. (ECCV 2020, sec. 3.2): trained with k sub-centers per class, a class's clean samples gather
around one *dominant* sub-center, while mislabelled ones sit on the others or far from all. The command
embeds the train split with the checkpoint's model (its trained weights, not a weights' average: the
rows were trained against those), reads the checkpoint's class rows, counts for each class which of its
sub-centers its samples are nearest to (the dominant one: the most counted, ties to the lower index) and
lists the samples whose angle to their class's dominant sub-center exceeds ``--angle``: a CSV of
``path`` (what ``dmltrain shards build --exclude`` matches), ``label`` (the class id as the shards hold
it), ``angle``, ``index`` (the sample in the split), ``nearest`` and ``dominant`` (sub-center numbers),
farthest first; every cell guarded as every CSV the project writes is (:func:`dmltrain.text.csv_cell`: a path
or label starting with ``=``, ``+``, ``-`` or ``@`` is no formula in a spreadsheet, and ``--exclude`` reads it
back as it was). It prints the share listed, the angles' percentiles and the share of samples on a
non-dominant sub-center, so a threshold can be read off; shards built with synthetic label noise also
get how many listed samples are truly mislabelled and how many mislabelled ones are listed.

A command module: what running the command needs is imported where it runs, so ``--help`` answers
without loading torch.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import tarfile
from pathlib import Path
from typing import Any

from dmltrain.errors import UserError
from shards.storage.location import add_storage_option, parse_storage_options


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "checkpoint", metavar="CHECKPOINT", help="a checkpoint folder of a run with sub-centers (model.pt, classifier/)"
    )
    parser.add_argument("--angle", type=float, required=True, help="degrees: list the samples farther than this")
    parser.add_argument("--out", required=True, metavar="CSV", help="the list of samples (a CSV file)")
    parser.add_argument("--shards", metavar="DIR|URL", help="the shard folder (default: the run config's data.shards)")
    parser.add_argument("--split", default="train", help="the split the classifier was trained on (default train)")
    parser.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default)")
    parser.add_argument("--batch-size", type=int, default=256, help="images per forward pass (default 256)")
    parser.add_argument("--loader-workers", type=int, default=2, help="decoding processes (default 2)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    add_storage_option(parser)


def subcenter_angles(embeddings, labels, weight, chunk: int = 1 << 16):
    """``(angle, nearest, dominant)`` of ``embeddings`` (``N × D``) with class ``labels`` (``N``) against the class
    rows ``weight`` (``C × k × D``; both normalised here): each sample's angle in degrees to its class's dominant
    sub-center, the sub-center it is nearest to, and each class's dominant sub-center (the one most of its
    samples are nearest to, ties to the lower number; 0 for a class without samples). Works in ``chunk``
    samples at a time (float64 within a chunk), so memory stays ``O(chunk × k × D)`` beside the inputs."""
    import torch
    import torch.nn.functional as F

    N, (C, k, _) = labels.numel(), weight.shape
    nearest = torch.empty(N, dtype=torch.int64)
    angle = torch.empty(N, dtype=torch.float64)
    counts = torch.zeros(C, k, dtype=torch.int64)

    def cosines(lo: int, hi: int) -> torch.Tensor:
        x = F.normalize(embeddings[lo:hi].double(), dim=-1)
        return torch.einsum("nd,nkd->nk", x, F.normalize(weight[labels[lo:hi]].double(), dim=-1))

    for lo in range(0, N, chunk):
        hi = min(N, lo + chunk)
        nearest[lo:hi] = cosines(lo, hi).argmax(1)
        counts.index_put_((labels[lo:hi], nearest[lo:hi]), torch.ones(hi - lo, dtype=torch.int64), accumulate=True)
    dominant = counts.argmax(1)  # the first maximum: ties to the lower number
    for lo in range(0, N, chunk):
        hi = min(N, lo + chunk)
        c = cosines(lo, hi).gather(1, dominant[labels[lo:hi]][:, None]).squeeze(1).clamp(-1.0, 1.0)
        angle[lo:hi] = torch.rad2deg(torch.acos(c))
    return angle, nearest, dominant


def _sample_paths(manifest: Any, info: Any, location: Any) -> dict[int, str]:
    """Split index -> the path its shard sample records: a table's rows file, else each sample's ``<key>.json``,
    the shards streamed member by member (a remote shard is read whole, one at a time). One line naming the
    shard if one cannot be read."""
    rows = manifest.rows(info.name)
    if rows is not None:
        return {int(i): str(p) for i, p in zip(rows["index"], rows["path"])}
    out: dict[int, str] = {}
    for shard in info.shards:
        try:
            if location.remote:
                tar = tarfile.open(fileobj=io.BytesIO(location.read_bytes(shard.file)))
            else:
                tar = tarfile.open(location.path / shard.file, mode="r|")
            with tar:
                for member in tar:
                    if member.isfile() and member.name.endswith(".json"):
                        meta = json.loads(tar.extractfile(member).read())
                        out[int(meta["index"])] = str(meta["path"])
        except Exception as e:  # noqa: BLE001 — I/O, tar, JSON or a storage library's own errors: one line each
            raise UserError(f"{shard.url}: cannot read the samples' paths ({type(e).__name__}: {e})") from None
    return out


def run(args: argparse.Namespace) -> int:
    if not 0.0 < args.angle < 180.0:
        raise UserError(f"--angle: must be in (0, 180) degrees, got {args.angle}")
    if args.batch_size < 1:
        raise UserError(f"--batch-size: must be >= 1, got {args.batch_size}")
    if args.loader_workers < 0:
        raise UserError(f"--loader-workers: must be >= 0, got {args.loader_workers}")
    ckpt = Path(args.checkpoint)
    index_file = ckpt / "classifier" / "classifier-index.json"
    if not (ckpt / "model.pt").is_file() or not index_file.is_file():
        raise UserError(f"{ckpt}: not a checkpoint folder (needs model.pt and classifier/classifier-index.json)")
    from dmltrain.evaluate.cli import _device
    from dmltrain.fileio import read_json, write_text

    device = _device(args.device)
    options = parse_storage_options(args.storage_option)
    import numpy as np
    import torch
    from tqdm import tqdm

    from dmltrain.distributed import ShardedClassifier
    from dmltrain.distributed.class_checkpoint import load_by_class
    from dmltrain.evaluate.embedding import embed_batches
    from dmltrain.evaluate.sources import ShardSource, iter_counted
    from dmltrain.models.export import load_model
    from dmltrain.models.serving import model_contract
    from shards.decode.transforms import EvalTransform

    model, config, _ = load_model(ckpt / "model.pt", map_location=device)  # one line for an unreadable model file
    contract = model_contract(model, config, fmt="model.pt", precision="fp32", file="model.pt", source={})
    clf_cfg = (config.get("loss") or {}).get("classifier") or {}
    params = dict(clf_cfg.get("params") or {})
    if int(params.get("subcenters", 1)) < 2:
        raise UserError(f"{ckpt}: trained without sub-centers (loss.classifier.params.subcenters < 2); nothing to read")
    index = read_json(index_file, "classifier index")
    if not isinstance(index, dict) or any(key not in index for key in ("num_classes", "dim", "kind")):
        raise UserError(f"{index_file}: not a classifier index (needs num_classes, dim and kind)")
    shards = args.shards or (config.get("data") or {}).get("shards")
    if not shards:
        raise UserError(f"{ckpt}: its config names no data.shards; give --shards")
    source = ShardSource(shards, args.split, options)
    if "train" not in source.info.label_space:
        raise UserError(
            f"{shards}: split {args.split!r} does not share the train split's classes (its label space: "
            f"{', '.join(source.info.label_space)}), which the checkpoint's classifier holds"
        )
    C = int(index["num_classes"])
    if source.info.num_labels != C:
        raise UserError(
            f"{shards}: split {args.split!r} has {source.info.num_labels} labels, the checkpoint's classifier {C}: "
            "not the shards it was trained on"
        )
    paths = _sample_paths(source.manifest, source.info, source.location)  # before the long part: fails fast
    clf = ShardedClassifier(C, int(index["dim"]), str(index["kind"]), **params)
    load_by_class(clf, ckpt / "classifier")
    weight = clf.full_weight().detach()

    transform = EvalTransform(
        contract.resize, contract.crop, grayscale=contract.grayscale, interpolation=contract.interpolation
    )
    print(f"embedding {source.count:,} {args.split} images of {shards} on {device}", file=sys.stderr)
    with tqdm(total=source.count, desc="embed", unit="img", file=sys.stderr, disable=args.quiet) as bar:
        batches = source.batches(0, source.count, transform, args.batch_size, args.loader_workers, contract.norm())
        emb, _, idx = embed_batches(model, iter_counted(batches, bar), device=device, progress=False)
    if len(idx) == 0:
        raise UserError(f"{shards}: no readable {args.split} sample")
    labels = torch.as_tensor(source.label_indices()[idx], dtype=torch.int64)
    angle, nearest, dominant = subcenter_angles(torch.from_numpy(emb), labels, weight)
    beyond = (angle > args.angle).numpy()
    names = source.info.original_ids()
    order = np.argsort(-angle.numpy(), kind="stable")
    rows = [i for i in order.tolist() if beyond[i]]
    unnamed = next((int(idx[i]) for i in rows if int(idx[i]) not in paths), None)
    if unnamed is not None:  # a list that --exclude could not match: refuse it rather than write it
        raise UserError(f"{shards}: {args.split} sample {unnamed} records no path in its shard's JSON")
    from dmltrain.text import csv_text

    head = ["path", "label", "angle", "index", "nearest", "dominant"]
    body = [
        [
            paths[int(idx[i])],
            names[int(labels[i])],
            round(float(angle[i]), 3),
            int(idx[i]),
            int(nearest[i]),
            int(dominant[labels[i]]),
        ]
        for i in rows
    ]
    write_text(args.out, csv_text(head, body))
    n, a = len(idx), angle.numpy()
    off = (nearest != dominant[labels]).numpy()
    p = np.percentile(a, [10, 50, 90, 99])
    print(
        f"{len(rows):,} of {n:,} {args.split} samples ({100 * len(rows) / max(n, 1):.1f} %) lie beyond {args.angle:g}° "
        f"of their class's dominant sub-center: listed in {args.out}"
    )
    print(f"angle to the dominant sub-center: p10 {p[0]:.1f}°, p50 {p[1]:.1f}°, p90 {p[2]:.1f}°, p99 {p[3]:.1f}°")
    print(f"samples nearest a non-dominant sub-center: {100 * off.mean():.1f} %")
    noisy = source.info.clean_labels
    if noisy:  # synthetic label noise: how well the angle finds it
        wrong = np.isin(idx, np.fromiter(noisy, dtype=np.int64))
        listed_wrong = int((beyond & wrong).sum())
        print(
            f"label noise recorded by the build: {listed_wrong:,} of the {len(rows):,} listed are mislabelled "
            f"({100 * listed_wrong / max(len(rows), 1):.1f} %); {listed_wrong:,} of the {int(wrong.sum()):,} "
            f"mislabelled are listed ({100 * listed_wrong / max(int(wrong.sum()), 1):.1f} %); angle p50 "
            f"{np.median(a[~wrong]) if (~wrong).any() else float('nan'):.1f}° clean, "
            f"{np.median(a[wrong]) if wrong.any() else float('nan'):.1f}° mislabelled"
        )
    return 0
