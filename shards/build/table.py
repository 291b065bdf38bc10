"""The table layout: a CSV or Parquet file that lists a dataset's images, one row each.

The columns (names as written, case-sensitive; the order does not matter):

==============  ==========================================================================================
``path``        the image: relative to the table's folder, absolute (under that folder: see below), or a URL
                (``s3://``, ``gs://``, ``https://``, ``file://``; read with ``--storage-option``, as ``--out``
                is). A URL's user name and password (``https://USER:PASSWORD@host/...``) are used to read it
                and written nowhere: the shards, the manifest and the rows file hold it as
                ``https://<redacted>@host/...``
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
twice, an image file that is not there or larger than :data:`~shards.build.ingest.MAX_SOURCE_BYTES` (all are
looked up before anything is built: local files with one ``stat`` each, URLs with one request each,
concurrently, per folder), a train row flagged as a query. Labels shared by train and test are refused by the
build (:func:`shards.build.builder.check_disjoint_classes`), which names a row of each.

A table is data someone else may have written, so what it can reach is confined (:func:`check_reach`, before
anything is looked up):

* a local path must lie under the table's folder, symbolic links resolved: an absolute path elsewhere, ``../``
  out of it and a link pointing out are refused, unless ``allow_outside`` (``--allow-outside-paths``; the build's
  summary then says how many images came from outside). A table read from a URL names no local file at all;
* a URL must be of a scheme a table may name (:data:`URL_SCHEMES`; ``file://`` is a local path), and an http(s)
  URL written in the table must reach a public address: one whose host resolves to a loopback, link-local
  (``169.254.169.254``), private or other non-global address is refused unless ``allow_private``
  (``--allow-private-urls``, also named in the summary). The table's own host, which the user named, and the
  relative paths under it are the user's. The same rule guards every connection of the build
  (:class:`~shards.storage.location.HostGuard`: redirects, a name resolving elsewhere later);
* sizes are bounded: at most :data:`MAX_TABLE_BYTES` of table, :data:`MAX_COLUMNS` columns (counted from the
  header or the Parquet schema before anything is parsed) and :data:`MAX_CELL_CHARS` characters a cell.

A URL's query string may carry a secret (a presigned URL's ``X-Amz-Signature``): it is fetched with it and
written and printed without it (:func:`dmltrain.redact.redact_url`), as a URL's password.
"""

from __future__ import annotations

import csv
import io
import os
import posixpath
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dmltrain.errors import UserError
from dmltrain.fileio import read_file_bytes
from dmltrain.redact import redact_url
from shards.build.ingest import MAX_SOURCE_BYTES, too_large
from shards.build.layouts import Confinement, Entry, Layout
from shards.storage.location import HOST_SCHEMES, HostGuard, Location, is_url, open_location

REQUIRED = ("path", "label", "split")
FLAGS = ("is_query", "is_gallery")
SPLITS = {"train": "train", "test": "test", "val": "test", "validation": "test"}
TRUE = frozenset({"1", "true", "t", "yes", "y", "1.0"})
FALSE = frozenset({"0", "false", "f", "no", "n", "", "0.0", "nan", "none", "null"})
FORMATS = {".csv": "csv", ".parquet": "parquet", ".pq": "parquet"}
#: bounds on what a table may hold: far above any dataset's table (a million rows of paths and a few columns is
#: well under 1 GiB), and each parsed in time and memory that grow with the table, not with its columns squared
MAX_TABLE_BYTES = 2**30
MAX_COLUMNS = 256
MAX_CELL_CHARS = 8192  # a long presigned URL is a few thousand characters
#: the schemes a table's URL may have: object stores (their endpoint is the user's), the web (host checked),
#: fsspec's in-process memory store; ``file://`` (and fsspec's ``local://``) are local paths, confined as any
URL_SCHEMES = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "http", "https", "memory"})
LOCAL_SCHEMES = ("file://", "local://")


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
            if raw.lower().startswith(LOCAL_SCHEMES):
                return Location("file://" + raw.split("://", 1)[1]).root
            return raw
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
    """Every cell of a CSV or Parquet file (a local path or a URL) of at most :data:`MAX_TABLE_BYTES` as text;
    one-line errors for what cannot be read."""
    text = os.fspath(table)
    suffix = Path(text.split("?")[0]).suffix.lower()
    fmt = FORMATS.get(suffix)
    if fmt is None:
        raise UserError(f"{text}: not a table (expected a .csv or .parquet file, got '{suffix or 'no suffix'}')")
    if is_url(text) and not text.lower().startswith("file://"):
        parent, name = text.rsplit("/", 1)
        loc = open_location(parent, storage_options)
        too_large = f"more than the {MAX_TABLE_BYTES:,} bytes a table may have"
        try:
            size = loc.size(name)  # a server may not say (None): the ranged read below still bounds it
            if size is not None and size > MAX_TABLE_BYTES:
                raise UserError(f"{redact_url(text)}: {size:,} bytes, {too_large}")
            data = loc.read_bytes(name, limit=MAX_TABLE_BYTES + 1)
            if len(data) > MAX_TABLE_BYTES:  # it said less than it sends
                raise UserError(f"{redact_url(text)}: {too_large}")
        except FileNotFoundError:
            raise UserError(f"{text}: table not found") from None
        except OSError as e:
            raise UserError(f"{text}: cannot read the table ({e})") from None
        base, shown = parent, text
    else:
        path = Path(Location(text).root).expanduser()
        data = read_file_bytes(path, str(path), "table", limit=MAX_TABLE_BYTES)
        base, shown = str(path.resolve().parent), str(path)
    return parse_cells(data, fmt, shown, base)


def _column_count(data: bytes, fmt: str) -> int | None:
    """How many columns the table declares (a CSV's header line, a Parquet file's schema), read before the rest is
    parsed; None when that cannot be told (pandas then names the problem)."""
    try:
        if fmt == "csv":
            end = data.find(b"\n")
            header = data[: end if end >= 0 else len(data)].decode("utf-8", errors="replace")
            return len(next(csv.reader([header]), []))
        import pyarrow.parquet as pq

        return pq.ParquetFile(io.BytesIO(data)).metadata.num_columns
    except Exception:  # noqa: BLE001 — a malformed file: pandas says what is wrong with it
        return None


def parse_cells(data: bytes, fmt: str, shown: str, base: str) -> Table:
    """The cells of a table's bytes (``fmt``: ``csv`` or ``parquet``) as text, named ``shown`` in messages, its
    relative paths under ``base``; one-line errors for a malformed file or a repeated column."""
    import pandas as pd

    declared = _column_count(data, fmt)
    if declared is not None and declared > MAX_COLUMNS:
        raise UserError(f"{shown}: {declared:,} columns, more than the {MAX_COLUMNS} a table may have")
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
    if len(names) > MAX_COLUMNS:  # a header the count above could not read (a quoted line break in a name)
        raise UserError(f"{shown}: {len(names):,} columns, more than the {MAX_COLUMNS} a table may have")
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise UserError(f"{shown}: column {dup!r} appears twice")
    long = next((n for n in names if len(n) > MAX_CELL_CHARS), None)
    if long is not None:
        raise UserError(
            f"{shown}: a column name of {len(long):,} characters, more than the {MAX_CELL_CHARS:,} a cell may have"
        )
    columns = {n: [_cell(v) for v in frame[c].tolist()] for n, c in zip(names, frame.columns)}
    t = Table(shown, columns, fmt == "csv", base)
    for n, values in columns.items():
        i = next((i for i, v in enumerate(values) if v is not None and len(v) > MAX_CELL_CHARS), None)
        if i is not None:
            raise UserError(
                f"{t.where(i, n)}: {len(values[i]):,} characters, more than the {MAX_CELL_CHARS:,} a cell may have"
            )
    return t


def _flag(t: Table, i: int, column: str) -> bool:
    v = t.columns[column][i]
    key = (v or "").lower()
    if key in TRUE:
        return True
    if key in FALSE:
        return False
    raise UserError(f"{t.where(i, column)}: {v!r} is not true or false (1/0, yes/no)")


def table_guard(table: str | os.PathLike[str], allow_private: bool = False) -> HostGuard | None:
    """The :class:`~shards.storage.location.HostGuard` of a table's URLs: public addresses and the table's own host
    (None with ``allow_private``: any)."""
    return None if allow_private else HostGuard.allowing(os.fspath(table))


def check_reach(
    t: Table,
    rows: list[int],
    resolved: list[str],
    *,
    allow_outside: bool = False,
    allow_private: bool = False,
    follow_symlinks: bool = False,
) -> dict[str, int]:
    """Refuse, in one line naming the row, a path the table may not name (see the module doc): a local file outside
    the table's folder (unless ``allow_outside``; with ``follow_symlinks`` a symbolic link may point out), a URL of
    a scheme not in :data:`URL_SCHEMES`, an http(s) URL written in the table whose host is no public address
    (unless ``allow_private``). ``resolved`` holds what :meth:`Table.resolve` made of each row's cell. Returns how
    many rows each flag let through, by flag."""
    raw = t.columns["path"]
    remote_table = is_url(t.base)
    inside = None if remote_table else Confinement(t.base, follow_symlinks)
    guard = HostGuard.allowing(t.name if is_url(t.name) else None)
    hosts: dict[str, str | None] = {}  # scheme://host -> why refused (None: public)
    let: dict[str, int] = {"--allow-outside-paths": 0, "--allow-private-urls": 0}
    for i, path in zip(rows, resolved):
        cell = raw[i] or ""
        if is_url(path):
            scheme = path.split("://", 1)[0].lower()
            if scheme not in URL_SCHEMES:
                raise UserError(
                    f"{t.where(i, 'path')}: {redact_url(cell)}: a table's URLs are s3, gs, az, http(s) or file URLs, "
                    f"not {scheme}://"
                )
            if scheme not in HOST_SCHEMES or not is_url(cell):
                continue  # an object store's bucket; or a relative path under the table's own URL
            origin = "/".join(path.split("/", 3)[:3])
            if origin not in hosts:
                hosts[origin] = guard.url_refusal(path)
            why = hosts[origin]
            if why is None:
                continue
            if not allow_private:
                raise UserError(
                    f"{t.where(i, 'path')}: {redact_url(cell)}: {why}; a table's URLs are fetched from public hosts "
                    "only (pass --allow-private-urls to fetch from loopback, link-local and private ones)"
                )
            let["--allow-private-urls"] += 1
            continue
        if inside is None:
            why = f"a local file, named by a table read from {redact_url(t.base)}"
        else:
            real = inside.outside(path)
            if real is None:
                continue
            why = (
                f"outside the table's folder {t.base}"
                if real == os.path.normpath(path)
                else f"a symbolic link to {real}, outside the table's folder {t.base}"
            )
        if not allow_outside:
            raise UserError(
                f"{t.where(i, 'path')}: {redact_url(cell)}: {why}; a table names files under its own folder "
                "(pass --allow-outside-paths to pack others)"
            )
        let["--allow-outside-paths"] += 1
    return {flag: n for flag, n in let.items() if n}


def check_files(
    t: Table,
    rows: list[int],
    paths: list[str],
    storage_options: Mapping[str, Any] | None,
    guard: HostGuard | None = None,
) -> None:
    """Refuse, naming the first row, any image that is not there (a local regular file, by ``stat``; URLs asked
    concurrently per folder, :meth:`~shards.storage.location.Location.sizes`, with its retries, connecting as
    ``guard`` allows), and any larger than :data:`~shards.build.ingest.MAX_SOURCE_BYTES`."""
    missing: list[int] = []
    by_folder: dict[str, list[tuple[int, str]]] = {}

    def size_ok(i: int, size: int) -> None:
        if size > MAX_SOURCE_BYTES:
            raise UserError(f"{t.where(i, 'path')}: {redact_url(paths[rows.index(i)])}: {too_large(size)}")

    for i, p in zip(rows, paths):
        if is_url(p):
            parent, name = p.rsplit("/", 1)
            by_folder.setdefault(parent, []).append((i, name))
            continue
        try:
            st = os.stat(p)
        except OSError:
            st = None
        if st is None or not stat.S_ISREG(st.st_mode):
            missing.append(i)
        else:
            size_ok(i, st.st_size)
    for parent, items in by_folder.items():
        try:
            sizes = Location(parent, storage_options, guard=guard).sizes([name for _, name in items])
        except OSError as e:
            raise UserError(f"{t.where(items[0][0], 'path')}: cannot look up {parent}/{items[0][1]} ({e})") from None
        missing += [i for i, name in items if sizes[name] is None]
        for i, name in items:
            if sizes[name] is not None:
                size_ok(i, sizes[name])
    if missing:
        missing.sort()
        i = missing[0]
        more = f" (and {len(missing) - 1} more rows)" if len(missing) > 1 else ""
        shown = paths[rows.index(i)]
        raise UserError(f"{t.where(i, 'path')}: {shown}: image file not found{more}")


def read_table(
    table: str | os.PathLike[str],
    storage_options: Mapping[str, Any] | None = None,
    *,
    allow_outside: bool = False,
    allow_private: bool = False,
    follow_symlinks: bool = False,
) -> Layout:
    """The :class:`Layout` of a table (see the module doc): splits ``train`` and ``test``, or ``train``, ``query``
    and ``gallery``; each :class:`Entry` keeps its row number and the table's other columns. Its paths are confined
    (:func:`check_reach`; ``allow_outside``, ``allow_private`` lift the two bounds, and the layout's
    :attr:`~Layout.allowed` counts what they let through; ``follow_symlinks`` lets links point out)."""
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
    allowed = check_reach(
        t,
        every,
        [resolved[i] for i in every],
        allow_outside=allow_outside,
        allow_private=allow_private,
        follow_symlinks=follow_symlinks,
    )
    check_files(t, every, [resolved[i] for i in every], storage_options, table_guard(table, allow_private))
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
        "table",
        t.name,
        splits,
        label_spaces=[s for s in spaces if all(x in splits for x in s)],
        columns=extras,
        allowed=allowed,
    )
