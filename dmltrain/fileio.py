"""Crash-safe file writing: write under a temporary name in the same folder, then rename.

A reader never sees a half-written file: either the old content or the new one.
:func:`check_output_dir` is the one up-front check of an output folder (every command that
writes runs it before starting work, so a read-only or full folder fails in one line, not
after an hour).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from dmltrain.errors import UserError

MIN_FREE_MB = 64  # below this an output folder counts as full


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success it replaces ``path``, on error it is removed.

    The temporary name starts with ``.`` and ends with ``.tmp`` so globs like ``*.tar`` skip it.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # The name is chosen before the file exists, so a Ctrl-C at any moment after its creation is inside the
    # ``try`` and removes it (``mkstemp`` creates the file before it returns its name). O_EXCL refuses a file
    # or symlink already there; mode 0666 less the umask is what a plain open() gives.
    tmp_path = path.parent / f".{path.name}.{secrets.token_hex(8)}.tmp"
    try:
        os.close(os.open(tmp_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
        yield tmp_path
        os.replace(tmp_path, path)
    except BaseException:
        tmp_path.unlink(missing_ok=True)
        raise


def write_text(path: str | os.PathLike[str], text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def write_json(path: str | os.PathLike[str], obj: Any) -> None:
    write_text(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


def read_file_bytes(path: Path, shown: str, what: str, limit: int | None = None) -> bytes:
    """The bytes of the local file ``path``; a one-line :class:`UserError` if it is not a file
    (``<shown>: <what> not found``), cannot be read (``<shown>: cannot read the <what> (<why>)``) or holds more
    than ``limit`` bytes (never read further than that)."""
    if not path.is_file():
        raise UserError(f"{shown}: {what} not found")
    try:
        with open(path, "rb") as f:
            data = f.read() if limit is None else f.read(limit + 1)
    except OSError as e:
        raise UserError(f"{shown}: cannot read the {what} ({e.strerror or e})") from None
    if limit is not None and len(data) > limit:
        raise UserError(f"{shown}: more than the {limit:,} bytes a {what} may have")
    return data


def read_json(path: str | os.PathLike[str], what: str = "") -> Any:
    """The JSON document at ``path``; one line :class:`UserError` (``<path>: unreadable <what> (<why>)``) if it
    cannot be read or parsed."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{path}: unreadable {what + ' ' if what else ''}({e})") from None


def check_output_dir(path: str | os.PathLike[str], what: str, *, min_free_mb: float = MIN_FREE_MB) -> Path:
    """Refuse, before any work, an output folder that cannot take the output; returns ``path``.

    ``path`` need not exist: its nearest existing ancestor must be a folder in which a file can
    be created (tried for real, then removed: permission bits do not tell a read-only mount or an
    immutable folder) with at least ``min_free_mb`` MB free. Nothing is left behind. Each refusal
    is a one-line :class:`UserError` naming ``what`` (the option or config key) and the folder.
    """
    path = Path(path).expanduser()
    existing = path.absolute()
    while not existing.exists() and existing.parent != existing:
        existing = existing.parent
    if not existing.is_dir():
        raise UserError(f"{what}: {existing} is not a folder")
    try:
        fd, probe = tempfile.mkstemp(prefix=".dmltrain-write-check-", dir=existing)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise UserError(f"{what}: cannot write to {existing} ({e.strerror or e})") from None
    free_mb = shutil.disk_usage(existing).free / 2**20
    if free_mb < min_free_mb:
        raise UserError(f"{what}: {existing} is full ({free_mb:.0f} MB free; at least {min_free_mb:.0f} MB needed)")
    return path
