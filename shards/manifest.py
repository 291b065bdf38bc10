"""``manifest.json``: what a shard directory holds, and the only index the readers use.

Per split: the shard files (samples, bytes, SHA-256, and the class groups each holds as
``[label, count, byte offset, byte length]``), the number of images and classes, the
mapping from original class ids to contiguous labels (sorted numerically when the ids are
integers, else as strings; stable across rebuilds), the images per label, and the source
images skipped at build time. The group table has one row per class per shard it touches
(about C rows), never one per image.

Splits that share a label space (In-Shop ``query`` and ``gallery``) carry the same mapping,
built over their union, so an item has the same label in both.

Optional, per split: ``families`` (the family id of every label: classes of a family are alike, as synthetic
class families are) and ``noisy_labels`` (``{"index": [...], "clean_label": [...]}``: the samples whose label
was deliberately changed, by their index in the split, with their true label; synthetic label noise).

A split built from a table (``--layout table``) also lists its *rows file* under ``rows``
(``file``, ``bytes``, ``sha256``, ``columns``): ``<split>-rows.parquet``, one row per sample by its
index (``index``, ``path``, ``class_id`` and the table's other ``columns``), verified like a shard
and read with :meth:`Manifest.rows`.

The folder may be a URL (:mod:`shards.storage.location`): the manifest is then fetched, and shard file names
stay confined to the URL's prefix as they do to a local folder. In a local folder a shard must be a regular
file of the folder itself: a symbolic link (which could point anywhere) is refused when the manifest is
loaded, and never followed when a shard is opened (:func:`open_shard`).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from dmltrain.errors import UserError
from dmltrain.redact import redact, redact_url
from shards.storage.location import Location, is_url, open_location, read_chunks
from shards.storage.retries import IOStats

MANIFEST_NAME = "manifest.json"
FORMAT = "dmltrain-shards"
VERSION = 1
#: PIL format name -> shard member extension (a sample's image member is ``<key>.<extension>``); any other
#: format uses its lower-cased name
EXTENSIONS = {
    "JPEG": "jpg",
    "MPO": "jpg",
    "PNG": "png",
    "TIFF": "tiff",
    "WEBP": "webp",
    "BMP": "bmp",
    "GIF": "gif",
    "PPM": "ppm",
}
#: the member extensions readers take for a sample's image
IMAGE_EXTENSIONS = frozenset({"jpg", "jpeg", "png", "tiff", "tif", "webp", "bmp", "gif", "ppm", "pgm", "pbm", "pnm"})


@dataclass(frozen=True)
class ShardInfo:
    file: str
    samples: int
    bytes: int
    sha256: str
    groups: list[list[int]]  # [label, count, offset, length] per class group
    url: str  # where it is: an absolute local path, or the URL of a remote folder's shard

    @property
    def remote(self) -> bool:
        return is_url(self.url)

    @property
    def path(self) -> Path:
        """The local file (a remote shard has none: use :attr:`url`)."""
        if self.remote:
            raise ValueError(f"{self.url}: a remote shard, not a local file")
        return Path(self.url)


@dataclass(frozen=True)
class GroupTable:
    """The class groups of a split in shard order, as parallel arrays (one row per group)."""

    shard: np.ndarray  # index into SplitInfo.shards
    label: np.ndarray
    count: np.ndarray
    offset: np.ndarray
    length: np.ndarray
    start: np.ndarray  # index in the split of the group's first sample

    def __len__(self) -> int:
        return len(self.label)


@dataclass(frozen=True)
class SplitInfo:
    name: str
    num_images: int
    num_classes: int  # classes present in this split
    num_labels: int  # size of the label space (labels are 0..num_labels-1)
    classes: dict[str, int]  # original class id -> label
    class_counts: list[int]  # images per label in this split (0 for labels only in a sibling split)
    shards: list[ShardInfo]
    label_space: list[str]  # the splits sharing this mapping
    skipped: list[dict[str, str]] = field(default_factory=list)
    location: Location | None = None  # the shard folder (how readers reach the shards); None: a local folder
    families: list[int] | None = None  # family id of each label; None: the build recorded no families
    # split index -> true label, for the samples whose label was deliberately made wrong (label noise)
    clean_labels: dict[int, int] = field(default_factory=dict)
    rows: ShardInfo | None = None  # a table's rows file (no samples or groups of its own); None for other layouts
    columns: list[str] = field(default_factory=list)  # the table's columns beyond path, label, split

    @property
    def bytes(self) -> int:
        return sum(s.bytes for s in self.shards)

    def group_table(self) -> GroupTable:
        rows = [(i, *g) for i, s in enumerate(self.shards) for g in s.groups]
        arr = np.asarray(rows, dtype=np.int64).reshape(-1, 5)
        count = arr[:, 2]
        return GroupTable(arr[:, 0], arr[:, 1], count, arr[:, 3], arr[:, 4], np.cumsum(count) - count)

    def original_ids(self) -> list[str]:
        """Original class id of every label (index = label)."""
        out = [""] * self.num_labels
        for orig, label in self.classes.items():
            out[label] = orig
        return out


class Manifest:
    """A loaded ``manifest.json``; :meth:`load` checks it and names the file in every error."""

    def __init__(self, root: Path | str, data: dict[str, Any], location: Location | None = None):
        self.location = location if location is not None else open_location(root)
        self.root: Path | str = Path(root) if not self.location.remote else self.location.root
        self.path: Path | str = (
            self.root / MANIFEST_NAME if isinstance(self.root, Path) else self.location.url(MANIFEST_NAME)
        )
        self.data = data
        self._splits: dict[str, SplitInfo] = {}
        files: dict[str, str] = {}
        try:
            for name, s in data["splits"].items():
                num_labels = int(s["num_labels"])
                shards = []
                for i, sh in enumerate(s["shards"]):
                    where = f"splits.{name}.shards[{i}]"
                    file = _shard_file(sh["file"], where)
                    if file in files:
                        raise ValueError(f"{where}.file: {file!r} is also listed at {files[file]}")
                    files[file] = where
                    url = self.location.url(file) if self.location.remote else str(self.root / file)
                    info_sh = ShardInfo(
                        file,
                        int(sh["samples"]),
                        int(sh["bytes"]),
                        str(sh["sha256"]),
                        [list(map(int, g)) for g in sh["groups"]],
                        url,
                    )
                    _check_shard(info_sh, num_labels, where)
                    shards.append(info_sh)
                rows, columns = None, []
                if s.get("rows") is not None:
                    where = f"splits.{name}.rows"
                    r = s["rows"]
                    file = _shard_file(r["file"], where)
                    if file in files:
                        raise ValueError(f"{where}.file: {file!r} is also listed at {files[file]}")
                    files[file] = where
                    url = self.location.url(file) if self.location.remote else str(self.root / file)
                    rows = ShardInfo(file, 0, int(r["bytes"]), str(r["sha256"]), [], url)  # a file of rows, no samples
                    _check_shard(rows, num_labels, where)
                    columns = [str(c) for c in r.get("columns", [])]
                info = SplitInfo(
                    name=name,
                    num_images=int(s["num_images"]),
                    num_classes=int(s["num_classes"]),
                    num_labels=num_labels,
                    classes={str(k): int(v) for k, v in s["classes"].items()},
                    class_counts=[int(c) for c in s["class_counts"]],
                    shards=shards,
                    label_space=list(s.get("label_space", [name])),
                    skipped=list(s.get("skipped", [])),
                    location=self.location,
                    families=[int(f) for f in s["families"]] if s.get("families") is not None else None,
                    clean_labels=_clean_labels(s.get("noisy_labels"), f"splits.{name}"),
                    rows=rows,
                    columns=columns,
                )
                _check_labels(info)
                if (
                    sum(sh.samples for sh in shards) != info.num_images
                    or sum(g[1] for sh in shards for g in sh.groups) != info.num_images
                ):
                    raise ValueError(
                        f"splits.{name}: shard sample counts do not add up to num_images {info.num_images}"
                    )
                self._splits[name] = info
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            what = f"missing key {e}" if isinstance(e, KeyError) else str(e)
            raise UserError(f"{self.path}: invalid manifest ({what})") from None

    # -- loading ----------------------------------------------------------------------------
    @classmethod
    def load(
        cls, shard_dir: str | Path | Location, storage_options: dict[str, Any] | None = None, remote: Any = None
    ) -> Manifest:
        """The manifest of a shard folder: a local path, or a URL read with ``storage_options`` and ``remote``
        settings (:func:`shards.storage.location.open_location`). Every problem is a :class:`UserError` naming the file."""
        loc = open_location(shard_dir, storage_options, remote)
        if loc.remote:
            path = loc.url(MANIFEST_NAME)
            try:
                raw = loc.read_bytes(MANIFEST_NAME)
            except FileNotFoundError:
                raise UserError(
                    f"{path}: not found (build shards with `dmltrain shards build`; an interrupted build leaves no manifest)"
                ) from None
            except OSError as e:
                raise UserError(f"{path}: unreadable manifest ({e})") from None
            root: Path | str = loc.root
        else:
            root = loc.path
            path = root / MANIFEST_NAME
            if not root.is_dir():
                raise UserError(f"{root}: shard directory not found")
            if not path.is_file():
                raise UserError(
                    f"{path}: not found (build shards with `dmltrain shards build`; an interrupted build leaves no manifest)"
                )
            try:
                raw = path.read_bytes()
            except OSError as e:
                raise UserError(f"{path}: unreadable manifest ({e})") from None
            root = root.resolve()
            loc = open_location(root, loc.storage_options, loc.settings)
        try:
            data = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise UserError(f"{path}: unreadable manifest ({e})") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise UserError(
                f"{path}: not a {FORMAT} manifest (format key is {data.get('format') if isinstance(data, dict) else None!r})"
            )
        if int(data.get("version", 0)) > VERSION:
            raise UserError(
                f"{path}: manifest version {data.get('version')} is newer than this dmltrain reads ({VERSION})"
            )
        m = cls(root, data, loc)
        if not loc.remote:
            _check_no_links(m)
        return m

    # -- queries ----------------------------------------------------------------------------
    @property
    def splits(self) -> list[str]:
        return list(self._splits)

    @property
    def layout(self) -> str:
        return str(self.data.get("layout", "?"))

    def split(self, name: str) -> SplitInfo:
        if name not in self._splits:
            raise UserError(f"{self.path}: no split {name!r} (it has {', '.join(self._splits) or 'none'})")
        return self._splits[name]

    def rows(self, split: str) -> dict[str, list[Any]] | None:
        """The rows file of ``split`` (a table's: ``index``, ``path``, ``class_id`` and its other columns) as
        ``{column: values}`` in sample-index order; None when the split has none (layouts other than table)."""
        info = self.split(split)
        if info.rows is None:
            return None
        import io

        import pyarrow.parquet as pq

        try:
            raw = self.location.read_bytes(info.rows.file)
            table = pq.read_table(io.BytesIO(raw))
        except Exception as e:  # noqa: BLE001 — missing file, truncated or foreign Parquet: one line either way
            raise UserError(f"{info.rows.url}: unreadable rows file ({type(e).__name__}: {e})") from None
        cols = table.to_pydict()
        order = sorted(range(len(cols.get("index", []))), key=cols["index"].__getitem__) if "index" in cols else []
        if len(order) != info.num_images:
            raise UserError(f"{info.rows.url}: {len(order)} rows for the split's {info.num_images} samples")
        return {k: [v[i] for i in order] for k, v in cols.items()}

    def summary(self) -> dict[str, Any]:
        """A JSON-ready digest: layout, source, options, and per split the images, classes, shards, bytes, skipped;
        redacted (:func:`dmltrain.redact.redact`), as it is printed and logged."""
        return redact(
            {
                "path": str(self.root),
                "layout": self.data.get("layout"),
                "source": self.data.get("source"),
                "created": self.data.get("created"),
                "options": self.data.get("options", {}),
                "splits": {
                    name: {
                        "images": s.num_images,
                        "classes": s.num_classes,
                        "labels": s.num_labels,
                        "label_space": s.label_space,
                        "shards": len(s.shards),
                        "bytes": s.bytes,
                        "skipped": len(s.skipped),
                        **({"columns": s.columns} if s.rows is not None else {}),
                    }
                    for name, s in self._splits.items()
                },
            }
        )

    def verify(self, progress: bool = False, stats: IOStats | None = None) -> list[str]:
        """Re-hash every shard (a remote one streamed by ranged GETs); one problem line per missing, resized or
        altered shard (empty: all good). ``stats`` counts the remote requests and retries."""
        shards = [sh for s in self._splits.values() for sh in [*s.shards, *([s.rows] if s.rows else [])]]
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=sum(sh.bytes for sh in shards), unit="B", unit_scale=True, desc="verify", leave=False)
        problems = []
        loc = self.location
        for sh in shards:
            try:
                size = loc.size(sh.file, stats)
            except OSError as e:
                problems.append(f"{sh.url}: cannot read ({e})")
                continue
            if size is None:
                problems.append(f"{sh.url}: shard missing")
                continue
            if size != sh.bytes:
                problems.append(f"{sh.url}: size {size} bytes, manifest says {sh.bytes}")
                if bar is not None:
                    bar.update(sh.bytes)
                continue
            h = hashlib.sha256()
            try:
                for chunk in read_chunks(loc, sh.file, size, stats) if loc.remote else _local_chunks(sh.path):
                    h.update(chunk)
                    if bar is not None:
                        bar.update(len(chunk))
            except OSError as e:
                problems.append(f"{sh.url}: cannot read ({e})")
                continue
            if h.hexdigest() != sh.sha256:
                problems.append(
                    f"{sh.url}: checksum mismatch (sha256 {h.hexdigest()[:16]}..., manifest {sh.sha256[:16]}...)"
                )
        if bar is not None:
            bar.close()
        return [redact_url(p) for p in problems]


def _local_chunks(path: Path):
    with open_shard(path) as f:
        while chunk := f.read(1 << 20):
            yield chunk


def open_shard(path: str | os.PathLike[str]):
    """A local shard opened for reading, never through a symbolic link (``OSError`` if ``path`` is one)."""
    return os.fdopen(os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0)), "rb")


def _check_no_links(m: Manifest) -> None:
    """Refuse a shard of a local manifest's (resolved) folder that is a symbolic link, or reached through one."""
    for sh in (sh for name in m.splits for sh in m.split(name).shards):
        p = sh.path
        if p.is_symlink() or (p.exists() and Path(os.path.realpath(p)) != p):
            raise UserError(
                f"{p}: a symbolic link (to {os.path.realpath(p)}); shards are read only as regular files of the shard "
                "folder: copy the file there"
            )


def _shard_file(name: Any, where: str) -> str:
    """A shard's file name, confined to the shard folder: relative, no ``..``, no empty or odd parts."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"{where}.file: expected a file name, got {name!r}")
    parts = name.split("/")
    odd = any(c in name for c in "\\\0%?#") or any(ord(c) < 32 for c in name)  # %, ?, # would change a URL's path
    if name.startswith("/") or odd or ":" in parts[0] or any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"{where}.file: {name!r} is not a plain file name inside the shard folder")
    return name


def _check_shard(sh: ShardInfo, num_labels: int, where: str) -> None:
    """Sizes non-negative, a SHA-256, and every group ``[label, count, offset, length]`` inside the file, in order."""
    if sh.samples < 0 or sh.bytes < 0:
        raise ValueError(f"{where}: negative samples or bytes ({sh.samples}, {sh.bytes})")
    if len(sh.sha256) != 64 or any(c not in "0123456789abcdef" for c in sh.sha256):
        raise ValueError(f"{where}.sha256: expected 64 lowercase hex digits, got {sh.sha256[:80]!r}")
    if any(len(g) != 4 for g in sh.groups):
        bad = next(j for j, g in enumerate(sh.groups) if len(g) != 4)
        raise ValueError(f"{where}.groups[{bad}]: expected [label, count, offset, length], got {sh.groups[bad]}")
    if not sh.groups:
        if sh.samples:
            raise ValueError(f"{where}.groups: empty, but the shard holds {sh.samples} samples")
        return
    g = np.asarray(sh.groups, dtype=np.int64)
    label, count, offset, length = g.T
    end = offset + length
    checks = (
        ((label < 0) | (label >= num_labels), f"label outside [0, {num_labels})"),
        (count < 1, "count below 1"),
        ((offset < 0) | (length < 0), "negative offset or length"),
        (end > sh.bytes, f"byte range beyond the shard's {sh.bytes} bytes"),
    )
    for bad, what in checks:
        if bad.any():
            j = int(np.flatnonzero(bad)[0])
            raise ValueError(f"{where}.groups[{j}]: {what} in {sh.groups[j]}")
    overlap = np.flatnonzero(offset[1:] < end[:-1])
    if len(overlap):
        j = int(overlap[0]) + 1
        raise ValueError(f"{where}.groups[{j}]: byte range {sh.groups[j][2:]} overlaps or precedes the group before it")
    if int(count.sum()) != sh.samples:
        raise ValueError(f"{where}: group counts add up to {int(count.sum())}, not the shard's {sh.samples} samples")


def _clean_labels(noisy: Any, where: str) -> dict[int, int]:
    if noisy is None:
        return {}
    index, clean = noisy["index"], noisy["clean_label"]
    if len(index) != len(clean):
        raise ValueError(f"{where}.noisy_labels: {len(index)} indexes but {len(clean)} clean labels")
    return {int(i): int(c) for i, c in zip(index, clean)}


def _check_labels(info: SplitInfo) -> None:
    where = f"splits.{info.name}"
    if info.num_labels < 0 or len(info.class_counts) != info.num_labels:
        raise ValueError(f"{where}.class_counts: {len(info.class_counts)} entries for num_labels {info.num_labels}")
    labels = list(info.classes.values())
    if any(not 0 <= v < info.num_labels for v in labels) or len(set(labels)) != len(labels):
        raise ValueError(f"{where}.classes: labels must be distinct and in [0, {info.num_labels})")
    if info.families is not None and len(info.families) != info.num_labels:
        raise ValueError(f"{where}.families: {len(info.families)} entries for num_labels {info.num_labels}")
    bad = next(
        ((i, c) for i, c in info.clean_labels.items() if not (0 <= i < info.num_images and 0 <= c < info.num_labels)),
        None,
    )
    if bad is not None:
        raise ValueError(
            f"{where}.noisy_labels: sample {bad[0]} with clean label {bad[1]} is outside the split's "
            f"{info.num_images} images or {info.num_labels} labels"
        )
