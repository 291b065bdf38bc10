"""Random access to the samples of a split's class groups: tar headers walked within byte ranges.

The manifest gives each class group's byte range in its shard (a class's samples are
contiguous there). :class:`GroupReader` reads such a range, or walks its ustar headers, and
returns a sample's image bytes, never holding an index of all images. Where the bytes come
from is one small interface, :class:`ByteSource` (``read(shard, offset, size)``, ``name``,
``close``); :class:`LocalFiles` reads local or shared-file-system shards, and
:class:`shards.storage.remote_reads.RemoteSource` ranged GETs from a URL (chosen by the split's location).
:meth:`GroupReader.read_ahead` tells a source that can prefetch the byte ranges of the next batch
while the current one decodes (a local source has nothing to gain and is not told).
"""

from __future__ import annotations

import io
from collections.abc import Iterable, Iterator
from typing import Any, BinaryIO, Protocol

import webdataset as wds

from shards.manifest import IMAGE_EXTENSIONS, GroupTable, SplitInfo, open_shard
from shards.read.sampler import Piece
from shards.storage.remote_reads import RemoteSource

Sample = tuple[str, str, bytes]  # (key, image extension, image bytes)
MemberTable = list[dict[str, tuple[int, int]]]  # per sample position: extension -> (data offset, size)


class ByteSource(Protocol):
    """Byte ranges of a split's shards, by shard index (``SplitInfo.shards``).

    ``read`` returns at most ``size`` bytes starting at ``offset`` (fewer at the end of the
    shard) and raises :class:`OSError` when the shard cannot be read. ``name`` is what
    messages call the shard. Opened lazily, so an instance may be built in one process and
    used in another (each loader process builds its own).
    """

    def read(self, shard: int, offset: int, size: int) -> bytes: ...

    def name(self, shard: int) -> str: ...

    def close(self) -> None: ...


class LocalFiles:
    """:class:`ByteSource` over the shard files of ``split`` on a local or shared file system."""

    def __init__(self, split: SplitInfo):
        self.split = split
        self._files: dict[int, BinaryIO] = {}

    def read(self, shard: int, offset: int, size: int) -> bytes:
        f = self._files.get(shard)
        if f is None:
            f = self._files[shard] = open_shard(self.split.shards[shard].path)  # never through a link
        f.seek(offset)
        return f.read(size)

    def name(self, shard: int) -> str:
        return self.split.shards[shard].file

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()


def parse_header(h: bytes) -> tuple[str, int, bytes] | None:
    """(name, size, typeflag) of a 512-byte ustar header; None for an end block, a short read or a bad checksum."""
    if len(h) < 512 or not any(h):
        return None
    try:
        stored = int(h[148:156].split(b"\0")[0].strip() or b"0", 8)
        size = int(h[124:136].split(b"\0")[0].strip() or b"0", 8)
    except ValueError:
        return None
    if stored != sum(h) - sum(h[148:156]) + 256:  # the checksum counts its own field as spaces
        return None
    name = h[0:100].split(b"\0")[0].decode("utf-8", "replace")
    prefix = h[345:500].split(b"\0")[0].decode("utf-8", "replace") if h[257:262] == b"ustar" else ""
    return (f"{prefix}/{name}" if prefix else name), size, h[156:157]


class _Unsupported(Exception):
    """A tar feature our ustar walker leaves to the tarfile module (pax or GNU long-name headers)."""


def walk_members(read, offset: int, end: int, start: int, count: int, where: str, notes: list[str]) -> MemberTable:
    """Member table of a class group whose samples are keyed ``start .. start + count - 1``.

    ``read(offset, n)`` returns bytes of the shard. Stops (with a note) at a garbled or short
    header; raises ``_Unsupported`` at a pax or GNU header.
    """
    table: MemberTable = [{} for _ in range(count)]
    while offset + 512 <= end:
        head = parse_header(read(offset, 512))
        if head is None:
            notes.append(f"{where}: bad or missing tar header at byte {offset}; the rest of the group is unreadable")
            break
        name, size, kind = head
        if kind not in (b"0", b"\0"):
            raise _Unsupported(kind)
        key, _, ext = name.rpartition("/")[2].partition(".")
        if key.isdigit() and 0 <= int(key) - start < count:
            table[int(key) - start][ext.lower()] = (offset + 512, size)
        offset += 512 + -(-size // 512) * 512
    return table


def _image_field(fields: dict[str, Any]) -> str | None:
    return next((x for x in fields if x in IMAGE_EXTENSIONS), None)


class GroupReader:
    """Random access to the samples of a split's class groups (byte ranges of the shards).

    A small group (<= ``whole_group_bytes``) is read in one go and its members located by
    walking the ustar headers in memory; a large one is walked through the source (the member
    table is cached per group) and only the samples asked for are read, so picking K images of
    a big class, or one image for the random sampler, does not read the whole class. Header
    checksums are verified; a missing, truncated or garbled member gives ``None`` and a note
    naming the shard (in :attr:`notes`, for the caller to report and clear). Tars with pax/GNU
    headers (not written by :mod:`shards.build.writer`) go through WebDataset's tar iterator instead.
    ``source`` defaults to :class:`LocalFiles` of ``split``.
    """

    def __init__(
        self,
        split: SplitInfo,
        table: GroupTable,
        whole_group_bytes: int = 1 << 20,
        cache_bytes: int = 64 << 20,
        cache_indexes: int = 4096,
        source: ByteSource | None = None,
    ):
        self.split, self.table = split, table
        if source is None:
            remote = split.location is not None and split.location.remote
            source = RemoteSource(split) if remote else LocalFiles(split)
        self.source: ByteSource = source
        self.whole_group_bytes, self.cache_bytes, self.cache_indexes = whole_group_bytes, cache_bytes, cache_indexes
        self._groups: dict[int, tuple[list[Sample | None], int]] = {}  # decoded small groups, LRU by bytes
        self._group_bytes = 0
        self._indexes: dict[int, MemberTable | None] = {}  # member tables of large groups
        self.notes: list[str] = []  # problems met while reading, for the batch being built

    def close(self) -> None:
        self.source.close()
        self._groups.clear()
        self._group_bytes = 0
        self._indexes.clear()

    # -- reading ahead (sources that fetch remotely) --------------------------------------------
    def ranges(self, pieces: Iterable[Piece]) -> list[tuple[int, int, int]]:
        """``(shard, offset, size)`` byte ranges that :meth:`sample` will read for ``pieces``: a small group
        not in memory whole, a large one's members when its member table is known, else (its first use)
        the whole group, from which the member table is then walked without further reads."""
        t, out = self.table, []
        for p in pieces:
            g = p.group
            shard, off, length = int(t.shard[g]), int(t.offset[g]), int(t.length[g])
            if length <= self.whole_group_bytes:
                if g not in self._groups:
                    out.append((shard, off, length))
                continue
            members = self._indexes.get(g)
            if members is None:
                out.append((shard, off, length))
                continue
            for pos in p.positions:
                ext = _image_field(members[pos])
                if ext is not None:
                    out.append((shard, *members[pos][ext]))
        return out

    def read_ahead(self, batches: Iterable[tuple[int, list[Piece]]]) -> Iterator[tuple[int, list[Piece]]]:
        """``batches`` unchanged; before each is handed out, a prefetching source is given the next one's ranges."""
        prefetch = getattr(self.source, "prefetch", None)
        it = iter(batches)
        if prefetch is None:
            yield from it
            return
        nxt = next(it, None)
        if nxt is not None:
            prefetch(self.ranges(nxt[1]))
        while nxt is not None:
            cur, nxt = nxt, next(it, None)
            if nxt is not None:
                prefetch(self.ranges(nxt[1]))
            yield cur

    def take_io(self) -> dict[str, int]:
        """The source's request and retry counts since the last call (empty for local files)."""
        stats = getattr(self.source, "stats", None)
        return stats.take() if stats is not None else {}

    def shard_name(self, g: int) -> str:
        """The shard file holding group ``g``, as messages name it."""
        return self.source.name(int(self.table.shard[g]))

    def key(self, g: int, pos: int) -> str:
        """The tar key of sample ``pos`` of group ``g`` (its index in the split, 8 digits)."""
        return f"{int(self.table.start[g]) + pos:08d}"

    def _read(self, g: int, offset: int, size: int) -> bytes:
        try:
            return self.source.read(int(self.table.shard[g]), offset, size)
        except OSError as e:
            self.notes.append(f"{self.shard_name(g)}: cannot read ({e})")
            return b""

    def _whole(self, g: int) -> list[Sample | None]:
        hit = self._groups.pop(g, None)
        if hit is not None:
            self._groups[g] = hit  # most recently used goes last
            return hit[0]
        t = self.table
        count, start, base = int(t.count[g]), int(t.start[g]), int(t.offset[g])
        buf = self._read(g, base, int(t.length[g]))
        samples: list[Sample | None] = [None] * count
        try:
            members = walk_members(
                lambda o, n: buf[o - base : o - base + n],
                base,
                base + len(buf),
                start,
                count,
                self.shard_name(g),
                self.notes,
            )
            for pos, fields in enumerate(members):
                ext = _image_field(fields)
                if ext is not None:
                    off, size = fields[ext]
                    data = buf[off - base : off - base + size]
                    if len(data) == size:
                        samples[pos] = (self.key(g, pos), ext, data)
        except _Unsupported:
            samples = self._whole_with_tarfile(g, buf)
        self._groups[g] = (samples, len(buf))
        self._group_bytes += len(buf)
        while self._group_bytes > self.cache_bytes and len(self._groups) > 1:
            self._group_bytes -= self._groups.pop(next(iter(self._groups)))[1]
        return samples

    def _whole_with_tarfile(self, g: int, buf: bytes) -> list[Sample | None]:
        t = self.table
        count, start = int(t.count[g]), int(t.start[g])
        members: dict[str, dict[str, bytes]] = {}
        try:
            for m in wds.tariterators.tar_file_iterator(io.BytesIO(buf)):
                key, _, ext = m["fname"].rpartition("/")[2].partition(".")
                members.setdefault(key, {})[ext.lower()] = m["data"]
        except Exception as e:  # noqa: BLE001 — truncated or garbled: keep the samples before the damage
            self.notes.append(
                f"{self.shard_name(g)}: tar stops after {len(members)} of {count} samples ({type(e).__name__}: {e})"
            )
        samples: list[Sample | None] = [None] * count
        for key, fields in members.items():
            ext = _image_field(fields)
            if key.isdigit() and 0 <= int(key) - start < count and ext is not None:
                samples[int(key) - start] = (key, ext, fields[ext])
        return samples

    def _index(self, g: int) -> MemberTable | None:
        if g not in self._indexes:
            t = self.table
            try:
                off, end = int(t.offset[g]), int(t.offset[g]) + int(t.length[g])
                members = walk_members(
                    lambda o, n: self._read(g, o, n),
                    off,
                    end,
                    int(t.start[g]),
                    int(t.count[g]),
                    self.shard_name(g),
                    self.notes,
                )
            except _Unsupported:
                members = None
            if len(self._indexes) >= self.cache_indexes:
                self._indexes.pop(next(iter(self._indexes)))
            self._indexes[g] = members
        return self._indexes[g]

    def sample(self, g: int, pos: int) -> Sample | None:
        """Sample ``pos`` (0-based within the group) of group ``g``, or None when unreadable."""
        if int(self.table.length[g]) <= self.whole_group_bytes:
            return self._whole(g)[pos]
        members = self._index(g)
        if members is None:
            return self._whole(g)[pos]
        fields = members[pos]
        ext = _image_field(fields)
        if ext is None:
            return None
        off, size = fields[ext]
        data = self._read(g, off, size)
        return (self.key(g, pos), ext, data) if len(data) == size else None
