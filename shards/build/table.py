"""The table layout: a CSV or Parquet file that lists a dataset's images, one row each.

The columns (names as written, case-sensitive; the order does not matter):

==============  ==========================================================================================
``path``        the image: relative to the table's folder, absolute, or a URL (``s3://``, ``gs://``,
                ``https://``, ``file://``; read with ``--storage-option``, as ``--out`` is). A URL's user name
                and password (``https://USER:PASSWORD@host/...``) are used to read it and written nowhere: the
                shards, the manifest and the rows file hold it as ``https://<redacted>@host/...``
``label``       its class: any text (numeric labels sort as numbers); train and test labels are disjoint
``split``       ``train`` or ``test`` (``val`` and ``validation``, OML's name, read as ``test``)
``is_query``,   optional, together (true/false, 1/0, yes/no; empty is false): In-Shop-style evaluation.
``is_gallery``  Each test row is then a query or a gallery item, giving the splits ``query`` and
                ``gallery`` with one label space; a table whose test rows are all both (OML's files for
                SOP, CUB, Cars) is self-retrieval, the ``test`` split, as without the columns
anything else    kept: per image in its sample's JSON (``extra``) and in the split's rows file
                 (:attr:`shards.manifest.SplitInfo.rows`, a Parquet file the manifest lists)
==============  ==========================================================================================

Every problem is one :class:`~dmltrain.errors.UserError` naming the table, the row (1-based, the header
not counted; a CSV's line too) and the column: a missing column, an empty or unknown value, a path listed
twice, an image file that is not there (all are looked up before anything is built: local files with one
``stat`` each, URLs with one request each, concurrently, per folder), a train row flagged as a query.
Labels shared by train and test are refused by the build (:func:`shards.build.builder.check_disjoint_classes`),
which names a row of each.
"""

from __future__ import annotations

import io
import os
import posixpath
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dmltrain.errors import UserError
from dmltrain.fileio import read_file_bytes
from dmltrain.redact import redact_url
from shards.build.layouts import Entry, Layout
from shards.storage.location import Location, is_url, open_location

REQUIRED = ("path", "label", "split")
FLAGS = ("is_query", "is_gallery")
SPLITS = {"train": "train", "test": "test", "val": "test", "validation": "test"}
TRUE = frozenset({"1", "true", "t", "yes", "y", "1.0"})
FALSE = frozenset({"0", "false", "f", "no", "n", "", "0.0", "nan", "none", "null"})
FORMATS = {".csv": "csv", ".parquet": "parquet", ".pq": "parquet"}


class Table:
    """A table's cells as text (``None`` for an empty cell), column by column, and where each row came from."""

    def __init__(self, name: str, columns: dict[str, list[str | None]], csv: bool, base: str):
        self.name, self.columns, self.csv = name, columns, csv
        self.base = base  # the folder relative paths resolve against: a local folder or a URL prefix
        self.rows = len(next(iter(columns.values()))) if columns else 0

    def where(self, i: int, column: str) -> str:
        """``table.csv row 3 (line 4), column label``: row ``i`` (0-based) for an error message."""
        line = f" (line {i + 2})" if self.csv else ""
        return f"{self.name} row {i + 1}{line}, column {column}"

    def resolve(self, raw: str, row: int) -> str:
        """The path cell ``raw`` of row ``row`` (0-based) as what ingestion opens: a local absolute path, or a URL
        (``file://`` made local). A relative path under a URL base is joined as a local one would be (``.`` and
        ``..`` segments resolved); one climbing above the URL's bucket or host is refused in one line."""
        if is_url(raw):
            return Location(raw).root if raw.lower().startswith("file://") else raw
        p = Path(raw).expanduser()
        if p.is_absolute():
            return str(p)
        if is_url(self.base):
            scheme, _, rest = self.base.partition("://")
            root, _, folder = rest.partition("/")
            joined = posixpath.normpath(posixpath.join(folder, raw))
            if joined == ".." or joined.startswith("../"):
                raise UserError(f"{self.where(row, 'path')}: {raw} climbs above {redact_url(f'{scheme}://{root}')}")
            return f"{scheme}://{root}/{joined}"
        return str(Path(self.base, p))


def _cell(v: Any) -> str | None:
    """A cell as text: None for empty/NaN/null, ``str`` otherwise (an integral float ``3.0`` as ``3``)."""
    if v is None:
        return None
    if isinstance(v, float):
        if v != v:
            return None
        if v.is_integer():
            return str(int(v))
    text = str(v).strip()
    return text or None


def read_cells(table: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None) -> Table:
    """Every cell of a CSV or Parquet file (a local path or a URL) as text; one-line errors for what cannot be read."""
    text = os.fspath(table)
    suffix = Path(text.split("?")[0]).suffix.lower()
    fmt = FORMATS.get(suffix)
    if fmt is None:
        raise UserError(f"{text}: not a table (expected a .csv or .parquet file, got '{suffix or 'no suffix'}')")
    if is_url(text) and not text.lower().startswith("file://"):
        parent, name = text.rsplit("/", 1)
        loc = open_location(parent, storage_options)
        try:
            data = loc.read_bytes(name)
        except FileNotFoundError:
            raise UserError(f"{text}: table not found") from None
        except OSError as e:
            raise UserError(f"{text}: cannot read the table ({e})") from None
        base, shown = parent, text
    else:
        path = Path(Location(text).root).expanduser()
        data = read_file_bytes(path, str(path), "table")
        base, shown = str(path.resolve().parent), str(path)
    return parse_cells(data, fmt, shown, base)


def parse_cells(data: bytes, fmt: str, shown: str, base: str) -> Table:
    """The cells of a table's bytes (``fmt``: ``csv`` or ``parquet``) as text, named ``shown`` in messages, its
    relative paths under ``base``; one-line errors for a malformed file or a repeated column."""
    import pandas as pd

    try:
        if fmt == "csv":
            # every cell as text: labels such as 007 stay as written, empty cells become NaN
            frame = pd.read_csv(io.BytesIO(data), dtype=str, keep_default_na=False, na_values=[""])
        else:
            frame = pd.read_parquet(io.BytesIO(data))
    except Exception as e:  # noqa: BLE001 — pandas and pyarrow raise many types for a malformed file
        raise UserError(
            f"{shown}: unreadable {fmt} table ({type(e).__name__}: {' '.join(str(e).split())[:160]})"
        ) from None
    names = [str(c).strip() for c in frame.columns]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise UserError(f"{shown}: column {dup!r} appears twice")
    columns = {n: [_cell(v) for v in frame[c].tolist()] for n, c in zip(names, frame.columns)}
    return Table(shown, columns, fmt == "csv", base)


def _flag(t: Table, i: int, column: str) -> bool:
    v = t.columns[column][i]
    key = (v or "").lower()
    if key in TRUE:
        return True
    if key in FALSE:
        return False
    raise UserError(f"{t.where(i, column)}: {v!r} is not true or false (1/0, yes/no)")


def check_files(t: Table, rows: list[int], paths: list[str], storage_options: Mapping[str, Any] | None) -> None:
    """Refuse, naming the first row, any image that is not there: local files by ``stat``, URLs asked
    concurrently per folder (:meth:`~shards.storage.location.Location.sizes`, with its retries)."""
    missing: list[int] = []
    by_folder: dict[str, list[tuple[int, str]]] = {}
    for i, p in zip(rows, paths):
        if is_url(p):
            parent, name = p.rsplit("/", 1)
            by_folder.setdefault(parent, []).append((i, name))
        elif not os.path.isfile(p):
            missing.append(i)
    for parent, items in by_folder.items():
        try:
            sizes = open_location(parent, storage_options).sizes([name for _, name in items])
        except OSError as e:
            raise UserError(f"{t.where(items[0][0], 'path')}: cannot look up {parent}/{items[0][1]} ({e})") from None
        missing += [i for i, name in items if sizes[name] is None]
    if missing:
        missing.sort()
        i = missing[0]
        more = f" (and {len(missing) - 1} more rows)" if len(missing) > 1 else ""
        shown = paths[rows.index(i)]
        raise UserError(f"{t.where(i, 'path')}: {shown}: image file not found{more}")


def read_table(table: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None) -> Layout:
    """The :class:`Layout` of a table (see the module doc): splits ``train`` and ``test``, or ``train``, ``query``
    and ``gallery``; each :class:`Entry` keeps its row number and the table's other columns."""
    t = read_cells(table, storage_options)
    if t.rows == 0:
        raise UserError(f"{t.name}: the table has no rows")
    for column in REQUIRED:
        if column not in t.columns:
            raise UserError(
                f"{t.name}: no column {column!r} (the table needs path, label, split; it has {', '.join(t.columns)})"
            )
    flagged = [c for c in FLAGS if c in t.columns]
    if len(flagged) == 1:
        other = next(c for c in FLAGS if c not in flagged)
        raise UserError(f"{t.name}: column {flagged[0]!r} without {other!r}: give both, or neither")
    extras = [c for c in t.columns if c not in REQUIRED and c not in FLAGS]
    seen: dict[str, int] = {}
    rows: dict[str, list[int]] = {"train": [], "test": []}
    resolved: list[str] = [""] * t.rows
    kinds: dict[int, tuple[bool, bool]] = {}
    for i in range(t.rows):
        for column in REQUIRED:
            if t.columns[column][i] is None:
                raise UserError(f"{t.where(i, column)}: empty")
        split_text = t.columns["split"][i]
        split = SPLITS.get(split_text.lower())
        if split is None:
            raise UserError(f"{t.where(i, 'split')}: unknown split {split_text!r} (train or test; val, validation)")
        path = t.resolve(t.columns["path"][i], i)
        if path in seen:
            raise UserError(f"{t.where(i, 'path')}: {path} is listed twice (also at row {seen[path] + 1})")
        seen[path] = i
        resolved[i] = path
        if flagged:
            q, g = _flag(t, i, "is_query"), _flag(t, i, "is_gallery")
            if split == "train" and (q or g):
                raise UserError(
                    f"{t.where(i, 'is_query' if q else 'is_gallery')}: a train row cannot be a query or gallery item"
                )
            if split == "test":
                kinds[i] = (q, g)
        rows[split].append(i)
    spaces: list[list[str]] = []
    if kinds and not all(q and g for q, g in kinds.values()):  # In-Shop style: each test row one or the other
        for i, (q, g) in kinds.items():
            if q == g:
                what = "both a query and a gallery item" if q else "neither a query nor a gallery item"
                raise UserError(
                    f"{t.where(i, 'is_query')}: {what}; with is_query/is_gallery every test row is one of the two "
                    "(query→gallery), or every test row is both (self-retrieval)"
                )
        rows["query"] = [i for i in rows["test"] if kinds[i][0]]
        rows["gallery"] = [i for i in rows["test"] if kinds[i][1]]
        del rows["test"]
        spaces = [["query", "gallery"]]
    every = [i for split_rows in rows.values() for i in split_rows]
    check_files(t, every, [resolved[i] for i in every], storage_options)
    column_of = t.columns
    splits = {
        split: [
            Entry(
                resolved[i],  # what is fetched: a URL's user name and password kept
                column_of["label"][i],
                redact_url(column_of["path"][i]),  # what is written and printed: without them
                row=i + 1,
                extra=tuple((c, column_of[c][i]) for c in extras),
            )
            for i in split_rows
        ]
        for split, split_rows in rows.items()
        if split_rows
    }
    return Layout(
        "table", t.name, splits, label_spaces=[s for s in spaces if all(x in splits for x in s)], columns=extras
    )
