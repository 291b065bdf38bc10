"""Where ``dmltrain embed`` takes its images from: a split of shards, a table of image paths, or a folder tree.

Every source is a numbered list of images (positions ``0 .. count-1``) that :meth:`Source.batches` reads in any
range ``[lo, hi)``, as ``(images, labels, index)`` batches of normalized float32 ``N × 3 × crop × crop`` images
prepared as the model's contract says (:class:`shards.decode.transforms.EvalTransform`, then
``normalize_batch``); an image that cannot be read is left out of its batch, never replaced, so its position
is missing from ``index``. :meth:`Source.rows` gives each position's ``id``, ``label`` (text, or None) and the
source's own columns:

* shards (``--shards DIR|URL --split S``): ``id`` ``<split>/<index>``, or the table's path for shards built
  from a table (with its other columns); ``label`` the original class id;
* a table (``--table T``, CSV or Parquet, column ``path`` as in ``shards build --layout table``; ``label``,
  ``split`` and any other columns optional, ``--split`` keeps that split's rows): ``id`` the path as written;
* a folder (``--folder F``): every image file under it, sorted; ``id`` its path relative to ``F``, ``label`` its
  first folder (None for files directly in ``F``).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dmltrain.errors import UserError
from dmltrain.redact import redact_url
from shards.decode.transforms import EvalTransform, PixelNorm, normalize_batch

# what --folder takes for an image (PIL opens more; these are the usual photo formats)
IMAGE_SUFFIXES = frozenset({".jpg", ".jpeg", ".png", ".webp", ".bmp", ".tif", ".tiff", ".gif", ".ppm"})


class Source:
    """A numbered list of images (see the module doc)."""

    kind: str
    count: int

    def describe(self) -> dict[str, Any]:
        """What identifies the source in a resumable run's plan: a resumed run must read the same images."""
        raise NotImplementedError

    def batches(
        self, lo: int, hi: int, transform: EvalTransform, batch_size: int, loader_workers: int
    ) -> Iterable[tuple[torch.Tensor, Any, Any]]:
        raise NotImplementedError

    def rows(self, index: np.ndarray) -> dict[str, list[Any]]:
        raise NotImplementedError


class ShardSource(Source):
    kind = "shards"

    def __init__(self, shards: Any, split: str, storage_options: Mapping[str, Any] | None = None):
        from shards.manifest import Manifest
        from shards.storage.location import open_location

        self.location = open_location(shards, storage_options)
        self.manifest = Manifest.load(self.location)
        self.split = split
        self.info = self.manifest.split(split)
        self.count = self.info.num_images

    def describe(self) -> dict[str, Any]:
        digest = [sh.sha256 for sh in self.info.shards]
        return {
            "kind": self.kind,
            "shards": str(self.location),
            "split": self.split,
            "count": self.count,
            "sha256": digest,
        }

    def batches(self, lo, hi, transform, batch_size, loader_workers, norm):
        from shards.read.stream import eval_batches

        return eval_batches(
            self.location,
            self.split,
            rank=0,
            world_size=1,
            batch_size=batch_size,
            resize=transform.resize,
            crop=transform.crop,
            grayscale=transform.grayscale,
            interpolation=transform.interpolation,
            norm=norm,
            loader_workers=loader_workers,
            samples=(lo, hi),
        )

    def rows(self, index: np.ndarray) -> dict[str, list[Any]]:
        table = self.manifest.rows(self.split)
        names = self.info.original_ids()
        labels = [names[v] for v in self.label_indices()[index]]
        out: dict[str, list[Any]] = {"split": [self.split] * len(index), "index": index.tolist()}
        if table is None:
            out["id"] = [f"{self.split}/{i}" for i in index.tolist()]
        else:
            out["id"] = [table["path"][i] for i in index.tolist()]
            out.update({k: [v[i] for i in index.tolist()] for k, v in table.items() if k not in ("index", "class_id")})
        return {"id": out.pop("id"), "label": labels, **out}

    def label_indices(self) -> np.ndarray:
        """Each sample's label (its index in the split's label space), from the group table (no image is read)."""
        t = self.info.group_table()
        return np.repeat(t.label, t.count)


class FileSource(Source):
    """Image files (local paths or URLs) with their ids, labels and other columns."""

    def __init__(
        self,
        kind: str,
        where: str,
        paths: list[str],
        ids: list[str],
        labels: list[str | None],
        columns: dict[str, list[Any]] | None = None,
        storage_options: Mapping[str, Any] | None = None,
        guard: Any = None,
    ):
        if not paths:
            raise UserError(f"{where}: no images to embed")
        self.kind, self.where, self.paths, self.ids, self.labels = kind, where, paths, ids, labels
        self.columns = columns or {}
        self.storage_options = dict(storage_options or {})
        self.guard = guard  # a table's URLs: the addresses they may reach (shards.storage.location.HostGuard)
        self.count = len(paths)

    def describe(self) -> dict[str, Any]:
        import hashlib

        h = hashlib.sha256("\n".join(self.paths).encode()).hexdigest()
        return {"kind": self.kind, "where": self.where, "count": self.count, "paths_sha256": h}

    def batches(self, lo, hi, transform, batch_size, loader_workers, norm):
        dataset = _FileImages(self.paths, transform, self.storage_options, self.guard)
        loader = torch.utils.data.DataLoader(
            torch.utils.data.Subset(dataset, range(lo, hi)),
            batch_size=batch_size,
            num_workers=loader_workers,
            collate_fn=functools.partial(_collate, norm=norm),
        )
        return loader

    def rows(self, index: np.ndarray) -> dict[str, list[Any]]:
        pick = index.tolist()
        out = {"id": [self.ids[i] for i in pick], "label": [self.labels[i] for i in pick], "index": pick}
        out.update({k: [v[i] for i in pick] for k, v in self.columns.items()})
        return out


class _FileImages(torch.utils.data.Dataset):
    """Position ``i`` -> ``(crop × crop × C uint8 image or None when unreadable, i)``."""

    def __init__(self, paths: list[str], transform: EvalTransform, storage_options: dict[str, Any], guard: Any = None):
        self.paths, self.transform, self.storage_options, self.guard = paths, transform, storage_options, guard

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> tuple[np.ndarray | None, int]:
        from shards.build.ingest import SkipImage, read_source

        try:
            return self.transform(read_source(self.paths[i], self.storage_options, self.guard)), i
        except SkipImage:
            return None, i
        except Exception:  # noqa: BLE001 — PIL raises many types for a file that is not a readable image
            return None, i


def _collate(
    items: list[tuple[np.ndarray | None, int]], norm: PixelNorm
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A batch of the readable images, normalized by ``norm`` (the unreadable ones left out: their positions are
    absent)."""
    good = [(a, i) for a, i in items if a is not None]
    index = torch.tensor([i for _, i in good], dtype=torch.int64)
    if not good:
        return torch.zeros((0, 3, 1, 1)), torch.full((0,), -1), index
    images = torch.from_numpy(np.stack([a for a, _ in good])).permute(0, 3, 1, 2).contiguous()
    return normalize_batch(images, norm=norm), torch.full((len(good),), -1), index


def table_source(
    table: str | os.PathLike[str],
    split: str | None,
    storage_options: Mapping[str, Any] | None = None,
    *,
    allow_outside: bool = False,
    allow_private: bool = False,
) -> FileSource:
    """The images a table lists (column ``path``; with ``split``, only that split's rows), confined as a build's
    (:func:`shards.build.table.check_reach`: under the table's folder, URLs to public hosts, unless
    ``allow_outside``/``allow_private``); every file is looked up first, and one that is not there is a one-line
    error naming its row (:func:`shards.build.table.check_files`)."""
    from shards.build.table import SPLITS, check_files, check_reach, read_cells, table_guard

    t = read_cells(table, storage_options)
    if "path" not in t.columns:
        raise UserError(f"{t.name}: no column 'path' (it has {', '.join(t.columns)})")
    keep = list(range(t.rows))
    if split is not None:
        if "split" not in t.columns:
            raise UserError(f"--split: {t.name} has no column 'split'")
        wanted = SPLITS.get(split.lower(), split.lower())
        keep = [i for i in keep if SPLITS.get((t.columns["split"][i] or "").lower()) == wanted]
        if not keep:
            raise UserError(f"--split: no row of {t.name} is in split {split!r}")
    for i in keep:
        if t.columns["path"][i] is None:
            raise UserError(f"{t.where(i, 'path')}: empty")
    paths = [t.resolve(t.columns["path"][i], i) for i in keep]
    check_reach(t, keep, paths, allow_outside=allow_outside, allow_private=allow_private)
    guard = table_guard(table, allow_private)
    check_files(t, keep, paths, storage_options, guard)
    labels = [t.columns["label"][i] for i in keep] if "label" in t.columns else [None] * len(keep)
    others = {c: [v[i] for i in keep] for c, v in t.columns.items() if c not in ("path", "label")}
    ids = [redact_url(t.columns["path"][i]) for i in keep]  # written and printed: a URL without its password
    return FileSource("table", t.name, paths, ids, labels, others, storage_options, guard)


def folder_source(folder: str | os.PathLike[str]) -> FileSource:
    """Every image file under ``folder`` (by suffix, hidden files and folders skipped), sorted by relative path."""
    root = Path(folder).expanduser()
    if not root.is_dir():
        raise UserError(f"{root}: image folder not found")
    found: list[str] = []

    def unlistable(e: OSError) -> None:
        raise UserError(f"{e.filename}: cannot list ({e.strerror or e})")

    for dirpath, dirnames, filenames in os.walk(root, onerror=unlistable):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        for name in filenames:
            if not name.startswith(".") and Path(name).suffix.lower() in IMAGE_SUFFIXES:
                found.append(str(Path(dirpath, name).relative_to(root)))
    found.sort()
    labels = [Path(rel).parts[0] if len(Path(rel).parts) > 1 else None for rel in found]
    return FileSource("folder", str(root), [str(root / rel) for rel in found], found, labels)


def iter_counted(batches: Iterable[Any], bar: Any) -> Iterator[Any]:
    """``batches`` as they come, advancing the progress ``bar`` by each batch's images."""
    for item in batches:
        bar.update(len(item[0]))
        yield item
