"""Text output shared by the commands: file-safe names, durations, table cells, Markdown and CSV tables.

Tables take a header and rows of plain values (numbers, strings, None) and format the cells
themselves, so ``tune``, ``study`` and ``report`` print and save the same table the same way.

What goes into a table, a page or a terminal may come from anyone who can write to the MLflow store (run
names, params, tags), a table of images (labels, paths), a manifest or a run record: :func:`visible` is the one
rule that keeps it on one line and without control characters, which :func:`printable` (the terminal) and the
Markdown helpers share; :func:`md_text`, :func:`md_code` and :func:`md_url` make it inert in Markdown (no raw
HTML, no links or images of its own), :func:`csv_cell` keeps spreadsheets from running it as a formula in every
CSV the project writes, and :func:`safe_name` keeps it from naming a path outside the folder it is joined to.
"""

from __future__ import annotations

import csv
import io
import math
import numbers
import re
import unicodedata
from collections.abc import Mapping, Sequence
from typing import Any

from dmltrain.redact import redact_url

MISSING = "—"  # a cell with no value


def safe_name(text: str | None, default: str = "run") -> str:
    """``text`` as a name for files, Ray jobs and MLflow runs: runs of characters other than
    letters, digits, ``_ . -`` become ``-``, no ``-`` or ``.`` at either end (so never ``.``, ``..`` or a
    hidden file: joined to a folder, the name stays inside it); ``default`` when nothing is left."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", text or "").strip("-.") or default


def format_duration(seconds: float | None, *, exact: bool = False) -> str:
    """``1h02m`` or ``3m04s`` (whole seconds, negatives as 0); ``exact`` keeps the seconds of an
    hour-long span (``1h02m03s``) and drops an empty minute (``4s``). None is :data:`MISSING`."""
    if seconds is None:
        return MISSING
    s = int(max(0.0, seconds))
    h, rem = divmod(s, 3600)
    m, s = divmod(rem, 60)
    if h:
        return f"{h}h{m:02d}m{s:02d}s" if exact else f"{h}h{m:02d}m"
    return f"{s}s" if exact and not m else f"{m}m{s:02d}s"


def finite_number(x: Any) -> bool:
    """A real number (not a bool) that is neither NaN nor infinite."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)


def clip(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters, the last one an ellipsis when cut."""
    return text if len(text) <= limit else text[: limit - 1] + "…"


def one_line(error: BaseException | str, limit: int = 300) -> str:
    """The gist of an error for a table cell or a progress line: ``Type: message``'s first line, clipped."""
    text = str(error).strip() if isinstance(error, str) else f"{type(error).__name__}: {str(error).strip()}"
    return clip(redact_url(text.splitlines()[0]) if text else "", limit)


def visible(text: Any) -> str:
    """``str(text)`` as one line of visible text: line breaks and tabs as spaces, every other control or format
    character (Unicode category C: ANSI escapes, carriage returns, NUL, bidirectional overrides, zero-width
    characters) removed. The one rule for text others may write (labels, ids, paths, manifest fields, run and
    experiment names) before it reaches a terminal (:func:`printable`) or a Markdown page (:func:`md_text`,
    :func:`md_code`)."""
    s = " ".join(str(text).splitlines())
    if s.isprintable():  # the common case: nothing to remove
        return s
    return "".join(" " if ch == "\t" else ch for ch in s if ch == "\t" or unicodedata.category(ch)[0] != "C")


def printable(text: Any, limit: int | None = 300) -> str:
    """``str(text)`` safe to print on a terminal (:func:`visible`), clipped to ``limit`` characters (None: not
    clipped). For text read from files others may write (a table, a manifest, a run record, a folder name)."""
    s = visible(text)
    return s if limit is None else clip(s, limit)


def cell(value: Any) -> str:
    """A table cell: :data:`MISSING` for None and non-finite floats, 4 significant digits for floats, else ``str``
    (URL userinfo redacted: tables are printed and written)."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return MISSING
    if isinstance(value, float):
        return f"{value:.4g}"
    return redact_url(str(value))


# Markdown's inline syntax: escaped with a backslash (an underscore only where it could open or close emphasis)
_MD_PUNCT = re.compile(r"[\\`*\[\]|~]|(?<![A-Za-z0-9])_|_(?![A-Za-z0-9])")
_URL_SAFE = ":/?#[]@!$&*+,;=%~-._"  # kept as they are in a link target; anything else is percent-encoded
# what GitHub's Markdown makes a link by itself (a bare scheme://, www.): a character reference in the middle
# (``https&#58;//``, ``www&#46;``) shows the same text and makes no link
_AUTOLINK = re.compile(r"(?<=[A-Za-z0-9])(:)(?=//)|(?<![A-Za-z0-9])(?i:www)(\.)")


def md_text(text: Any) -> str:
    """``text`` as inert Markdown on one line: HTML's ``& < >`` as entities (no tag, no autolink), the ``:`` of a
    bare ``scheme://`` and the dot of ``www.`` as character references (no link of GitHub's), Markdown's
    punctuation backslash-escaped (no link, image, emphasis or code of its own), ``|`` escaped for tables; without
    control characters (:func:`visible`)."""
    s = visible(text)
    s = s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    s = _AUTOLINK.sub(lambda m: "&#58;" if m.group(1) else m.group(0)[:-1] + "&#46;", s)
    return _MD_PUNCT.sub(lambda m: "\\" + m.group(0), s)


def md_code(text: Any) -> str:
    """``text`` as a Markdown code span, on one line, whatever backticks it holds (its content is never markup);
    without control characters (:func:`visible`)."""
    s = visible(text)
    fence = "`" * (max((len(r) for r in re.findall(r"`+", s)), default=0) + 1)
    pad = " " if s.startswith("`") or s.endswith("`") or not s.strip() else ""
    return f"{fence}{pad}{s}{pad}{fence}"


def md_url(url: str) -> str:
    """``url`` as a Markdown link target: spaces, parentheses, quotes and angle brackets percent-encoded."""
    from urllib.parse import quote

    return quote(str(url), safe=_URL_SAFE)


def _md(value: Any) -> str:
    return md_text(cell(value))


def markdown_table(
    head: Sequence[str],
    rows: Sequence[Sequence[Any]],
    *,
    bold: Mapping[int, set[int]] | None = None,
    links: Sequence[str] | None = None,
    cell_links: Mapping[tuple[int, int], str] | None = None,
) -> str:
    """A Markdown table of ``rows`` (cells formatted by :func:`cell`, made inert by :func:`md_text`).

    ``bold`` maps a column index to the row indices shown in bold; ``links`` gives each row's first
    cell a link target, ``cell_links`` any cell's, by (row, column), row -1 being the header.
    """
    bold = bold or {}
    targets = dict(cell_links or {})
    targets.update({(i, 0): url for i, url in enumerate(links or ())})

    def text(i: int, j: int, value: Any) -> str:
        s = _md(value)
        if (i, j) in targets:
            return f"[{s}]({md_url(targets[i, j])})"
        return f"**{s}**" if i in bold.get(j, ()) else s

    lines = [
        "| " + " | ".join(text(-1, j, h) for j, h in enumerate(head)) + " |",
        "|" + "|".join("---" for _ in head) + "|",
    ]
    lines += ["| " + " | ".join(text(i, j, v) for j, v in enumerate(row)) + " |" for i, row in enumerate(rows)]
    return "\n".join(lines)


# a spreadsheet reads a cell starting with one of these as a formula (=HYPERLINK(...), +cmd|..., @SUM(...))
_FORMULA_START = ("=", "+", "-", "@", "\t", "\r")
_NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")


def csv_cell(value: Any) -> str:
    """A CSV cell: None empty, a float with every digit (``repr``), text with URL userinfo redacted, and text a
    spreadsheet would run as a formula (starting with ``= + - @``, a tab or a CR, after any ``'``) prefixed with ``'``; numbers,
    negative ones included, stay numbers."""
    if value is None:
        return ""
    if isinstance(value, float):
        return repr(value)
    s = redact_url(str(value))
    # quotes already there are kept behind the guard, so that csv_value gives back exactly what was written
    return "'" + s if s.lstrip("'").startswith(_FORMULA_START) and not _NUMBER.fullmatch(s) else s


def csv_value(text: str) -> str:
    """A text cell of a CSV :func:`csv_cell` wrote, as it was: the ``'`` put before a formula's first character
    taken off (a file read back, such as ``noisy-labels``' list given to ``shards build --exclude``)."""
    guarded = text.startswith("'") and text.lstrip("'").startswith(_FORMULA_START) and not _NUMBER.fullmatch(text[1:])
    return text[1:] if guarded else text


def csv_text(head: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """``head`` and ``rows`` as CSV, every cell (the header's too) through :func:`csv_cell`."""
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow([csv_cell(h) for h in head])
    for r in rows:
        w.writerow([csv_cell(x) for x in r])
    return buf.getvalue()
