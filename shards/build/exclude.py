"""``shards build --exclude FILE``: images a build leaves out, named by the path each sample's JSON records.

FILE is a CSV or Parquet table with a ``path`` column (other columns ignored; read by
:func:`shards.build.table.parse_cells`; a CSV's cells as the project writes them, a formula's guard taken off:
:func:`dmltrain.text.csv_value`), or any other file as text, one path per line (blank lines and lines
starting with ``#`` ignored). A path is compared with :attr:`~shards.build.layouts.Entry.relpath` as written,
in every split. The use: a model's list of likely mislabelled train images (samples far from their class's
dominant sub-center), to rebuild the shards without them and retrain.

A listed path that is in no split is refused (the list was made from other shards), as is a list that
empties a split; a class left without images simply disappears. The manifest records the file's name,
SHA-256 and the count left out (``options.excluded``); the excluded set is then part of what is built, so
``--resume`` of the same command keeps the shards already written.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dmltrain.errors import UserError
from dmltrain.fileio import read_file_bytes
from dmltrain.text import csv_value
from shards.build.layouts import Layout
from shards.build.table import FORMATS, parse_cells
from shards.storage.location import is_url


@dataclass(frozen=True)
class ExcludeList:
    """The paths listed in one file (in file order, without repeats), with the file's name and SHA-256."""

    file: str
    sha256: str
    paths: tuple[str, ...]

    def record(self, images: int) -> dict[str, Any]:
        """The manifest's ``options.excluded``."""
        return {"file": Path(self.file).name, "sha256": self.sha256, "images": images}


def read_exclude(file: str | os.PathLike[str]) -> ExcludeList:
    """Read ``file`` (a local path); one :class:`UserError` naming it when it is missing, unreadable, or a table
    without a ``path`` column."""
    text = os.fspath(file)
    if is_url(text):
        raise UserError(f"--exclude {text}: a local file only")
    path = Path(text).expanduser()
    data = read_file_bytes(path, f"--exclude {text}", "file")
    fmt = FORMATS.get(path.suffix.lower())
    if fmt is not None:
        try:
            table = parse_cells(data, fmt, text, str(path.parent))
        except UserError as e:
            raise UserError(f"--exclude {e}") from None
        if "path" not in table.columns:
            raise UserError(f"--exclude {text}: no column 'path' (it has {', '.join(table.columns) or 'no columns'})")
        # a CSV's cells as this project writes them (dmltrain.text.csv_cell): a path's formula guard taken off
        listed = [csv_value(p) if fmt == "csv" else p for p in table.columns["path"] if p is not None]
    else:
        try:
            lines = data.decode("utf-8-sig").splitlines()
        except UnicodeDecodeError as e:
            raise UserError(
                f"--exclude {text}: not UTF-8 text (byte {e.start}); a list of paths, or a CSV/Parquet table"
            ) from None
        listed = [s for s in (line.strip() for line in lines) if s and not s.startswith("#")]
    return ExcludeList(text, hashlib.sha256(data).hexdigest(), tuple(dict.fromkeys(listed)))


def apply_exclude(
    layout: Layout, args: dict[str, Sequence[Any]], exclude: ExcludeList
) -> tuple[Layout, dict[str, list[Any]], int]:
    """``layout`` and ``args`` without the entries whose ``relpath`` ``exclude`` lists (each split's entries and
    load arguments kept in step), and how many were left out. Refuses listed paths that match no entry and a
    split left empty."""
    listed = set(exclude.paths)
    known = {e.relpath for entries in layout.splits.values() for e in entries}
    unknown = [p for p in exclude.paths if p not in known]
    if unknown:
        raise UserError(
            f"--exclude {exclude.file}: {len(unknown)} of the {len(exclude.paths)} paths are in no split of the "
            f"{layout.name} layout (first: {unknown[0]!r}); was the list made from other shards?"
        )
    splits: dict[str, list] = {}
    kept_args: dict[str, list[Any]] = {}
    left_out = 0
    for split, entries in layout.splits.items():
        keep = [i for i, e in enumerate(entries) if e.relpath not in listed]
        if not keep:
            raise UserError(f"--exclude {exclude.file}: lists every image of the {split} split")
        left_out += len(entries) - len(keep)
        splits[split] = [entries[i] for i in keep]
        kept_args[split] = [args[split][i] for i in keep]
    return dataclasses.replace(layout, splits=splits), kept_args, left_out
