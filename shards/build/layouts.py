"""Readers of the official dataset layouts: each lists (source path, original class id) per split.

A reader only parses index files and lists folders; it never opens an image (the build
checks images in parallel and skips the unreadable ones). A missing, unreadable or
malformed index file (an empty or truncated ``.mat``, a MATLAB v7.3 one), a missing image
folder or a malformed index line raises :class:`~dmltrain.errors.UserError` naming the
path (and line). :func:`confine` then keeps the images inside the root (no ``../`` in an index, no
symbolic link pointing out of it unless the user allows it). Train and test classes are disjoint by construction in the four benchmarks:

==========  ==============================================  ==================================
layout      index                                           splits
==========  ==============================================  ==================================
sop         ``Ebay_train.txt``, ``Ebay_test.txt``           train, test
cub         ``images.txt`` + ``image_class_labels.txt``     train (classes 1-100), test (101-200)
cars        ``cars_annos.mat`` (struct ``annotations``)     train (classes 1-98), test (99-196)
inshop      ``list_eval_partition.txt``                     train, query, gallery
folder      ``train/<class>/*``, ``test/<class>/*``         train, test
table       a CSV or Parquet file (:mod:`shards.build.table`)  train, test (or query, gallery)
==========  ==============================================  ==================================

In-Shop's query and gallery share one label space (an item has the same label in both);
:attr:`Layout.label_spaces` says which splits share their class-id mapping.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from dmltrain.errors import UserError

LAYOUTS = ("sop", "cub", "cars", "inshop", "folder", "table", "synthetic")


@dataclass(frozen=True)
class Entry:
    """One source image: where it is, its original class id (a string), and the path recorded in the shard;
    for a table also its row (1-based) and the table's other columns as ``(name, value)`` pairs.

    ``clean_class_id`` is the true class of an image whose ``class_id`` was made noisy on purpose (synthetic
    label noise), or None: the build then records the true label beside the noisy one."""

    path: str
    class_id: str
    relpath: str
    clean_class_id: str | None = None
    row: int | None = None
    extra: tuple[tuple[str, str | None], ...] = ()


@dataclass
class Layout:
    """The entries of every split, in the order the index lists them."""

    name: str
    root: str
    splits: dict[str, list[Entry]]
    # groups of splits whose labels come from one mapping over their union (In-Shop query+gallery)
    label_spaces: list[list[str]] = field(default_factory=list)
    # original class id -> family id (groups of similar classes, synthetic families); None: no families
    families: dict[str, int] | None = None
    # a table's columns beyond path, label, split (kept per image); None: the layout keeps no rows file
    columns: list[str] | None = None
    # what the user's flags let through, by flag (a table's --allow-outside-paths: how many images from outside
    # its folder): the build's summary names each
    allowed: dict[str, int] = field(default_factory=dict)

    def spaces(self) -> list[list[str]]:
        """Every split in exactly one label space (singletons for the splits not grouped)."""
        grouped = {s for space in self.label_spaces for s in space}
        return [list(space) for space in self.label_spaces] + [[s] for s in self.splits if s not in grouped]


def class_sort_key(class_id: str) -> tuple[int, int, str]:
    """Numeric ids sort as numbers (``2 < 10``), any others as strings after them; stable and total."""
    return (0, int(class_id), "") if class_id.isdigit() else (1, 0, class_id)


def _need_file(path: Path, what: str) -> Path:
    if not path.is_file():
        raise UserError(f"{path}: {what} not found")
    return path


def _need_dir(path: Path, what: str) -> Path:
    if not path.is_dir():
        raise UserError(f"{path}: {what} not found")
    return path


def _rows(path: Path, n_fields: int, skip: int = 0) -> list[tuple[int, list[str]]]:
    """(line number, fields) of the non-blank lines after ``skip``; a short line names the file and line."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            lines = f.readlines()
    except OSError as e:
        raise UserError(f"{path}: cannot read ({e.strerror or e})") from None
    out = []
    for lineno, line in enumerate(lines, 1):
        if lineno <= skip or not line.strip():
            continue
        parts = line.split()
        if len(parts) < n_fields:
            raise UserError(f"{path}:{lineno}: expected {n_fields} fields, got {line.strip()!r}")
        out.append((lineno, parts))
    return out


def read_sop(root: Path) -> Layout:
    """Stanford Online Products: ``Ebay_{train,test}.txt`` with header ``image_id class_id super_class_id path``."""
    splits = {}
    for split in ("train", "test"):
        index = _need_file(root / f"Ebay_{split}.txt", "SOP index file")
        rows = _rows(index, 4)
        if rows and not rows[0][1][0].isdigit():  # the header line
            rows = rows[1:]
        entries = []
        for lineno, (_image_id, class_id, _super, rel, *_rest) in rows:
            if not class_id.isdigit():
                raise UserError(f"{index}:{lineno}: class_id {class_id!r} is not an integer")
            entries.append(Entry(str(root / rel), class_id, rel))
        splits[split] = entries
    return Layout("sop", str(root), splits)


def read_cub(root: Path) -> Layout:
    """CUB-200-2011: ``images.txt`` (id, path under ``images/``) and ``image_class_labels.txt``; classes 1-100 train."""
    images = _need_file(root / "images.txt", "CUB index file")
    labels_file = _need_file(root / "image_class_labels.txt", "CUB index file")
    image_dir = _need_dir(root / "images", "CUB image directory")
    labels = {}
    for lineno, (image_id, class_id, *_rest) in _rows(labels_file, 2):
        if not class_id.isdigit():
            raise UserError(f"{labels_file}:{lineno}: class {class_id!r} is not an integer")
        labels[image_id] = class_id
    splits: dict[str, list[Entry]] = {"train": [], "test": []}
    for lineno, (image_id, rel, *_rest) in _rows(images, 2):
        if image_id not in labels:
            raise UserError(f"{labels_file}: no class for image id {image_id} ({images}:{lineno})")
        class_id = labels[image_id]
        split = "train" if int(class_id) <= 100 else "test"
        splits[split].append(Entry(str(image_dir / rel), class_id, f"images/{rel}"))
    return Layout("cub", str(root), splits)


def read_cars(root: Path) -> Layout:
    """Cars196: ``cars_annos.mat``, struct array ``annotations`` with ``relative_im_path`` and ``class``; 1-98 train."""
    import numpy as np
    import scipy.io

    mat_path = _need_file(root / "cars_annos.mat", "Cars annotation file")
    try:
        mat = scipy.io.loadmat(str(mat_path), squeeze_me=True, struct_as_record=True)
    except NotImplementedError:  # scipy reads MATLAB v4-v7; v7.3 is HDF5
        raise UserError(
            f"{mat_path}: MATLAB v7.3 (HDF5) file, which scipy cannot read; re-save it in MATLAB v7 format (save(..., '-v7'))"
        ) from None
    # Empty, truncated or not a MAT file: scipy raises MatReadError, OSError, ValueError, IndexError...
    except Exception as e:  # noqa: BLE001
        raise UserError(f"{mat_path}: unreadable MAT file ({type(e).__name__}: {e})") from None
    try:
        annos = np.atleast_1d(mat["annotations"])
        rels = [str(r) for r in annos["relative_im_path"]]
        classes = [int(c) for c in annos["class"]]
    except (KeyError, ValueError, TypeError, IndexError, OSError) as e:
        need = "struct 'annotations' with 'relative_im_path' and 'class'"
        raise UserError(f"{mat_path}: not a Cars196 annotation file (need {need}): {e}") from None
    if rels:
        _need_dir(root / Path(rels[0]).parent, "Cars image directory")
    splits: dict[str, list[Entry]] = {"train": [], "test": []}
    for rel, c in zip(rels, classes):
        splits["train" if c <= 98 else "test"].append(Entry(str(root / rel), str(c), rel))
    return Layout("cars", str(root), splits)


def read_inshop(root: Path) -> Layout:
    """DeepFashion In-Shop: ``list_eval_partition.txt`` (count line, header, then ``path item_id status``).

    The index may sit at the root or under ``Eval/``; image paths (``img/...``) resolve against
    the root or ``Img/``. Query and gallery share one label space.
    """
    index = next(
        (p for p in (root / "list_eval_partition.txt", root / "Eval" / "list_eval_partition.txt") if p.is_file()), None
    )
    if index is None:
        raise UserError(f"{root / 'list_eval_partition.txt'}: In-Shop partition file not found (also looked in Eval/)")
    rows = _rows(index, 1)
    if len(rows) < 2 or not rows[0][1][0].isdigit():
        raise UserError(f"{index}: expected a count line and a header line first")
    declared = int(rows[0][1][0])
    body = rows[2:]
    if declared != len(body):
        raise UserError(f"{index}: the first line declares {declared} images but {len(body)} are listed")
    base = root
    if body:
        first = body[0][1][0]
        if not (root / first).exists() and (root / "Img" / first).exists():
            base = root / "Img"
        _need_dir(base / Path(first).parts[0], "In-Shop image directory")
    splits: dict[str, list[Entry]] = {"train": [], "query": [], "gallery": []}
    for lineno, parts in body:
        if len(parts) < 3:
            raise UserError(
                f"{index}:{lineno}: expected 'image_name item_id evaluation_status', got {' '.join(parts)!r}"
            )
        rel, item, status = parts[:3]
        if status not in splits:
            raise UserError(f"{index}:{lineno}: evaluation_status {status!r} is not train, query or gallery")
        splits[status].append(Entry(str(base / rel), item, rel))
    return Layout("inshop", str(root), splits, label_spaces=[["query", "gallery"]])


def _unlistable(e: OSError) -> None:
    # os.walk skips a folder it cannot list unless told otherwise: its images would vanish without a word
    raise UserError(f"{e.filename}: cannot list ({e.strerror or e})")


def read_folder(root: Path) -> Layout:
    """``root/train/<class>/*`` and ``root/test/<class>/*``: every non-hidden file of a class folder is a candidate
    image (the build skips what PIL cannot read); files directly under ``train/`` or ``test/`` are ignored."""
    splits = {}
    for split in ("train", "test"):
        split_dir = _need_dir(root / split, "image directory")
        entries = []
        try:
            class_dirs = sorted(
                (d for d in split_dir.iterdir() if d.is_dir() and not d.name.startswith(".")), key=lambda d: d.name
            )
        except OSError as e:
            raise UserError(f"{split_dir}: cannot list ({e.strerror or e})") from None
        for class_dir in class_dirs:
            for dirpath, dirnames, filenames in os.walk(class_dir, onerror=_unlistable):
                dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
                for name in sorted(filenames):
                    if name.startswith("."):
                        continue
                    path = Path(dirpath) / name
                    entries.append(Entry(str(path), class_dir.name, str(path.relative_to(root))))
        splits[split] = entries
    return Layout("folder", str(root), splits)


class Confinement:
    """Whether paths lie under a folder ``root`` (its real path): by name (an absolute path elsewhere, ``../`` out of
    it) and, unless ``follow_symlinks``, once symbolic links are resolved (the file, or a folder on its way). One
    ``lstat`` per path and one ``realpath`` per folder."""

    def __init__(self, root: str | os.PathLike[str], follow_symlinks: bool = False):
        self.root = os.path.realpath(root)
        self.follow_symlinks = follow_symlinks
        self._folders: dict[str, str] = {}

    def _inside(self, p: str) -> bool:
        return p == self.root or p.startswith(self.root.rstrip(os.sep) + os.sep)

    def outside(self, path: str) -> str | None:
        """None when ``path`` lies under the root; else where it is: its normalized path when its name leads out,
        the real path a symbolic link on its way points to otherwise."""
        joined = os.path.join(self.root, path)
        path = os.path.normpath(joined)
        if not self._inside(path):  # unless it only names the root another way (a symbolic link above it)
            return None if self._inside(os.path.realpath(path)) else path
        if self.follow_symlinks:
            return None
        if ".." in joined.split(os.sep):
            # the system resolves a link before the `..` after it (link/../x is x beside the link's target), which
            # the name's normal form does not: the path exactly as it will be opened, resolved in full
            real = os.path.realpath(joined)
            return None if self._inside(real) else real
        folder, name = os.path.split(path)
        if folder not in self._folders:
            self._folders[folder] = os.path.realpath(folder)
        real = os.path.realpath(path) if os.path.islink(path) else os.path.join(self._folders[folder], name)
        return None if self._inside(real) else real


def confine(layout: Layout, follow_symlinks: bool = False) -> None:
    """Refuse, in one line, an image outside the dataset root (:class:`Confinement`): named there by an index
    (``../x.jpg``), always; or reached through a symbolic link (the file, or a folder on its way) that points
    outside, unless ``follow_symlinks`` (``--follow-symlinks``: the user vouches for the links). Links within the
    root are fine."""
    inside = Confinement(layout.root, follow_symlinks)
    root = inside.root
    for entries in layout.splits.values():
        for e in entries:
            real = inside.outside(e.path)
            if real is None:
                continue
            if real == os.path.normpath(os.path.join(root, e.path)):
                raise UserError(f"{e.path}: outside the dataset root {root} (the index lists {e.relpath!r})")
            raise UserError(
                f"{e.path}: a symbolic link to {real}, outside the dataset root {root}; images are packed only "
                "from inside it (pass --follow-symlinks to pack what the links point to)"
            )


READERS = {"sop": read_sop, "cub": read_cub, "cars": read_cars, "inshop": read_inshop, "folder": read_folder}
