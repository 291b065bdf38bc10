"""Write one split as a numbered series of WebDataset tar shards, class groups kept whole.

Samples arrive grouped by class (a *group* = consecutive samples of one class). A new shard
starts before a group that would overflow ``shard_size``, unless the shard is empty, so a
class straddles two shards only when it alone is larger than a shard. For every group the
writer records (label, count, byte offset, byte length) in its shard: the reader seeks
straight to a group instead of scanning the tar, and plans class-balanced batches from these
counts without an index of images.

Each shard is written under a hidden temporary name (:func:`dmltrain.fileio.atomic_path`)
and renamed when closed, so an interrupted build never leaves a partial ``*.tar``. The
SHA-256 and size are computed while writing. Tar headers carry a fixed mtime, so the same
input and seed give byte-identical shards. ``on_shard(record, path)`` is called with each shard
once it is complete under its final name (the build uploads it from there to a URL).

A sample is ``KEY.<ext>`` (the image bytes), ``KEY.cls`` (the label as decimal text) and
``KEY.json`` (``label``, ``class_id``, ``path``, ``index``); ``KEY`` is the zero-padded index
of the sample in its split. Any WebDataset reader can use the shards.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import webdataset as wds

from dmltrain.fileio import atomic_path

TAR_MTIME = 946684800  # 2000-01-01: a fixed mtime makes shards reproducible


def shard_name(prefix: str, number: int) -> str:
    return f"{prefix}-{number:06d}.tar"


class _HashingFile:
    """A write-only file that hashes and counts what passes through it."""

    def __init__(self, f):
        self._f = f
        self.sha256 = hashlib.sha256()
        self.bytes = 0

    def write(self, data) -> int:
        self.sha256.update(data)
        self.bytes += len(data)
        return self._f.write(data)

    def flush(self) -> None:
        self._f.flush()

    def close(self) -> None:
        self._f.close()


@dataclass
class ShardRecord:
    """What the manifest keeps about one finished shard."""

    file: str
    samples: int = 0
    bytes: int = 0
    sha256: str = ""
    # one [label, count, offset, length] per class group, in the order written
    groups: list[list[int]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "file": self.file,
            "samples": self.samples,
            "bytes": self.bytes,
            "sha256": self.sha256,
            "groups": self.groups,
        }


class SplitWriter:
    """Write one split's class groups into ``out_dir/<prefix>-NNNNNN.tar``.

    Use as a context manager; ``begin_group(label, planned)`` before each class's samples
    (``planned`` = how many may follow, to decide whether to start a new shard), then
    ``write(...)`` per sample. Leaving the context with an exception removes the shard in
    progress; finished shards stay (the manifest, written last, is what makes a build valid).
    """

    def __init__(
        self,
        out_dir: str | Path,
        prefix: str,
        shard_size: int,
        on_shard: Callable[[ShardRecord, Path], None] | None = None,
    ):
        if shard_size < 1:
            raise ValueError(f"shard_size must be >= 1, got {shard_size}")
        self.out_dir = Path(out_dir)
        self.prefix = prefix
        self.shard_size = shard_size
        self.on_shard = on_shard
        self.shards: list[ShardRecord] = []
        self.num_samples = 0
        self._stack: contextlib.ExitStack | None = None
        self._tar: wds.TarWriter | None = None
        self._file: _HashingFile | None = None
        self._current: ShardRecord | None = None
        self._group: list[int] | None = None

    def __enter__(self) -> SplitWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self._close_shard()
        elif self._stack is not None:
            # close the tar stream into the file that is about to go: left open, tarfile's own finalizer would
            # write to the closed file later and print a traceback (an interrupted build, Ctrl-C)
            with contextlib.suppress(Exception):
                self._tar.close()
            self._tar = None
            self._stack.__exit__(exc_type, exc, tb)  # atomic_path removes the temporary file
            self._stack = None

    # -- shards ----------------------------------------------------------------------------
    def _open_shard(self) -> None:
        name = shard_name(self.prefix, len(self.shards))
        self._stack = contextlib.ExitStack()
        tmp = self._stack.enter_context(atomic_path(self.out_dir / name))  # atomic_path gives it umask permissions
        self._file = _HashingFile(self._stack.enter_context(open(tmp, "wb")))
        # encoder=False: we hand over bytes; TarWriter still writes standard ustar members
        self._tar = wds.TarWriter(self._file, encoder=False, mtime=TAR_MTIME)
        self._current = ShardRecord(name)

    def _close_shard(self) -> None:
        if self._tar is None:
            return
        self._end_group()
        self._tar.close()  # writes the end-of-archive blocks through the hashing file
        rec = self._current
        rec.bytes, rec.sha256 = self._file.bytes, self._file.sha256.hexdigest()
        self._stack.close()  # closes the file, then renames it into place
        self.shards.append(rec)
        self._tar = self._file = self._current = self._stack = None
        if self.on_shard is not None:
            self.on_shard(rec, self.out_dir / rec.file)

    # -- groups and samples ----------------------------------------------------------------
    def _end_group(self) -> None:
        if self._group is not None and self._group[1] > 0:
            self._group[3] = self._tar.tarstream.offset - self._group[2]
            self._current.groups.append(self._group)
        self._group = None

    def begin_group(self, label: int, planned: int) -> None:
        """Start the samples of one class (``planned`` of them at most)."""
        if self._tar is not None:
            self._end_group()
            if self._current.samples > 0 and self._current.samples + planned > self.shard_size:
                self._close_shard()
        self._group = [int(label), 0, -1, 0]

    def write(self, label: int, image: bytes, ext: str, meta: dict[str, Any]) -> None:
        """Append one sample of the current group; its index in the split is assigned here."""
        if self._group is None or self._group[0] != label:
            raise ValueError(f"write(label={label}) outside begin_group({label}, ...)")
        if self._tar is None:
            self._open_shard()
        if self._current.samples >= self.shard_size:  # a class bigger than a shard continues in the next one
            label_ = self._group[0]
            self._close_shard()
            self._open_shard()
            self._group = [label_, 0, -1, 0]
        if self._group[1] == 0:
            self._group[2] = self._tar.tarstream.offset
        index = self.num_samples
        key = f"{index:08d}"
        meta = {"label": int(label), **meta, "index": index}
        self._tar.write(
            {"__key__": key, ext: image, "cls": str(int(label)).encode(), "json": json.dumps(meta).encode()}
        )
        self._group[1] += 1
        self._current.samples += 1
        self.num_samples += 1
