"""What an ``index.faiss`` may declare before faiss reads it.

``faiss.read_index`` trusts the sizes a file declares: each vector is allocated at its declared length before
its bytes are read (faiss 1.15's ``READVECTOR`` accepts up to 1 TB), so an 11 KB file can make it allocate
gigabytes; and the file picks the classes it builds, among them ``OnDiskInvertedLists`` (``ilod``), which
memory-map another path read-write, and ID maps (``IxMp``, ``IxM2``) whose ids point anywhere.

:func:`check_index_file` walks the file in faiss's own layout (``faiss/impl/index_read.cpp``) for exactly the
index types ``dmltrain index build`` writes, without allocating what it declares:

* ``IxFI`` ``IndexFlatIP``: the index header (``d`` int32, ``ntotal`` int64, two unused int64, ``is_trained`` byte,
  ``metric_type`` int32), then the vectors (a uint64 count of 4-byte words, ``ntotal * d`` of them);
* ``IBxF`` ``IndexBinaryFlat``: ``d``, ``code_size`` int32, ``ntotal`` int64, ``is_trained``, ``metric_type``,
  then ``ntotal * d / 8`` bytes;
* ``IHNf`` ``IndexHNSWFlat``: the header, the graph (level probabilities, cumulative neighbour counts, levels,
  offsets, neighbours: five counted vectors; entry point, max level, efConstruction, efSearch and an unused
  int32), then its storage, an ``IxFI`` of the same ``d`` and ``ntotal``;
* ``IwPQ`` ``IndexIVFPQ``: the header, ``nlist`` and ``nprobe`` (uint64), the coarse quantizer (an ``IxFI`` with
  ``nlist`` vectors), the direct map (a type byte, a counted int64 vector, and a counted pair vector for a hash
  table), ``by_residual`` byte, ``code_size`` uint64, the product quantizer (``d``, ``M``, ``nbits`` uint64 and
  ``d * 2^nbits`` float centroids), then ``ilar`` array inverted lists (``nlist``, ``code_size``, ``full`` or
  ``sprs`` list sizes, then each list's codes and int64 ids).

Every count must fit in the bytes left, the structure must end exactly at the end of the file, the metric must
be the inner product the project builds, ``d`` and ``ntotal`` must be what ``index.json`` says, and any other
type (``ilod``, ``IxMp``, ...) is refused: one :class:`UserError` naming the file and what is wrong. What faiss
then allocates is bounded by the file's size.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import BinaryIO

import numpy as np

from dmltrain.errors import UserError

METRIC_INNER_PRODUCT = 0
MAX_D = 1 << 20  # faiss's own bound on d
MAX_NBITS = 16


class _Refused(Exception):
    """What is wrong with the file; turned into one UserError naming it."""


class _Reader:
    """Reads the file's fields in order, each checked against the bytes left; never allocates a declared size."""

    def __init__(self, f: BinaryIO, size: int):
        self.f, self.size = f, size

    @property
    def left(self) -> int:
        return self.size - self.f.tell()

    def take(self, n: int, what: str) -> bytes:
        if n > self.left:
            raise _Refused(f"{what} declares {n:,} bytes, beyond the {self.left:,} left in the file")
        return self.f.read(n)

    def skip(self, n: int, what: str) -> None:
        if n > self.left:
            raise _Refused(f"{what} declares {n:,} bytes, beyond the {self.left:,} left in the file")
        self.f.seek(n, os.SEEK_CUR)

    def unpack(self, fmt: str, what: str) -> int:
        return struct.unpack("<" + fmt, self.take(struct.calcsize(fmt), what))[0]

    def fourcc(self, what: str) -> str:
        return self.take(4, what).decode("latin-1")

    def counted(self, item: int, what: str, *, keep: bool = False) -> int | np.ndarray:
        """A faiss vector: a uint64 count, then ``count * item`` bytes (kept as uint64/int64 words with ``keep``)."""
        count = self.unpack("Q", what)
        if count > self.left // item:
            raise _Refused(
                f"{what} declares {count:,} items of {item} bytes, beyond the {self.left:,} left in the file"
            )
        if keep:
            return np.frombuffer(self.take(count * item, what), dtype="<u8")
        self.skip(count * item, what)
        return count


def check_index_file(path: str | os.PathLike[str], *, binary: bool, dim: int, count: int) -> None:
    """Refuse ``path`` unless it is a faiss index of a type ``dmltrain index build`` writes (module doc) over
    ``count`` vectors of ``dim`` dimensions (bits with ``binary``), whose declared sizes fit in the file."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            reader = _Reader(f, size)
            if binary:
                d, ntotal = _binary_flat(reader)
            else:
                d, ntotal = _float_index(reader)
            if reader.left:
                raise _Refused(f"{reader.left:,} bytes after the index")
    except OSError as e:
        raise UserError(f"{path}: cannot read the index ({e.strerror or e})") from None
    except _Refused as e:
        raise UserError(f"{path}: refused: {e} (not an index dmltrain index build writes)") from None
    if (d, ntotal) != (dim, count):
        raise UserError(
            f"{path}: holds {ntotal:,} vectors of {d} {'bits' if binary else 'dimensions'}, index.json says "
            f"{count:,} of {dim}"
        )


def _float_index(r: _Reader) -> tuple[int, int]:
    kind = r.fourcc("the index type")
    if kind == "IxFI":
        return _flat(r)
    if kind == "IHNf":
        d, ntotal = _header(r, "IndexHNSWFlat")
        for name, item in (
            ("assign_probas", 8),
            ("cum_nneighbor_per_level", 4),
            ("levels", 4),
            ("offsets", 8),
            ("neighbors", 4),
        ):
            r.counted(item, f"the HNSW {name}")
        r.skip(5 * 4, "the HNSW entry point and parameters")
        if r.fourcc("the HNSW storage type") != "IxFI":
            raise _Refused("an HNSW storage that is not IndexFlatIP")
        if _flat(r) != (d, ntotal):
            raise _Refused("an HNSW storage of another size than the graph")
        return d, ntotal
    if kind == "IwPQ":
        return _ivf_pq(r)
    raise _Refused(f"index type {kind!r} (dmltrain writes IxFI, IHNf and IwPQ; not on-disk lists, ID maps, ...)")


def _header(r: _Reader, what: str) -> tuple[int, int]:
    d = r.unpack("i", f"the {what} dimension")
    ntotal = r.unpack("q", f"the {what} vector count")
    r.skip(16 + 1, f"the {what} header")
    metric = r.unpack("i", f"the {what} metric")
    if not 0 < d <= MAX_D or ntotal < 0:
        raise _Refused(f"{what} of d = {d}, ntotal = {ntotal}")
    if metric != METRIC_INNER_PRODUCT:
        raise _Refused(f"{what} with metric {metric} (dmltrain builds inner-product indexes)")
    return d, ntotal


def _flat(r: _Reader) -> tuple[int, int]:
    d, ntotal = _header(r, "IndexFlatIP")
    words = r.counted(4, "the IndexFlatIP vectors")
    if words != ntotal * d:
        raise _Refused(f"IndexFlatIP of {ntotal:,} × {d} with {words:,} floats")
    return d, ntotal


def _binary_flat(r: _Reader) -> tuple[int, int]:
    if (kind := r.fourcc("the index type")) != "IBxF":
        raise _Refused(f"binary index type {kind!r} (dmltrain writes IBxF)")
    d = r.unpack("i", "the dimension")
    code_size = r.unpack("i", "the code size")
    ntotal = r.unpack("q", "the vector count")
    r.skip(1 + 4, "the header")
    if not 0 < d <= MAX_D or d % 8 or code_size != d // 8 or ntotal < 0:
        raise _Refused(f"IndexBinaryFlat of d = {d}, code size {code_size}, ntotal = {ntotal}")
    if r.counted(1, "the codes") != ntotal * code_size:
        raise _Refused(f"IndexBinaryFlat of {ntotal:,} × {code_size} bytes with another number of bytes")
    return d, ntotal


def _ivf_pq(r: _Reader) -> tuple[int, int]:
    d, ntotal = _header(r, "IndexIVFPQ")
    nlist = r.unpack("Q", "nlist")
    r.unpack("Q", "nprobe")
    if r.fourcc("the coarse quantizer type") != "IxFI":
        raise _Refused("a coarse quantizer that is not IndexFlatIP")
    if _flat(r) != (d, nlist):
        raise _Refused(f"a coarse quantizer that is not {nlist:,} centroids of {d} dimensions")
    direct_map = r.unpack("B", "the direct map type")
    r.counted(8, "the direct map")
    if direct_map == 2:  # a hash table: (id, offset) pairs
        r.counted(16, "the direct map's hash table")
    elif direct_map != 0 and direct_map != 1:
        raise _Refused(f"direct map type {direct_map}")
    r.skip(1, "by_residual")
    code_size = r.unpack("Q", "the code size")
    pq_d, m, nbits = (r.unpack("Q", f"the product quantizer's {k}") for k in ("d", "M", "nbits"))
    if pq_d != d or not 0 < m <= d or d % m or not 1 <= nbits <= MAX_NBITS or code_size != (m * nbits + 7) // 8:
        raise _Refused(f"a product quantizer of d = {pq_d}, M = {m}, nbits = {nbits}, code size {code_size}")
    if r.counted(4, "the product quantizer's centroids") != d << nbits:
        raise _Refused("product quantizer centroids of another size than d × 2^nbits")
    if (lists := r.fourcc("the inverted lists type")) != "ilar":
        raise _Refused(f"inverted lists {lists!r} (dmltrain writes ilar arrays; not on-disk lists)")
    if r.unpack("Q", "the lists' nlist") != nlist or r.unpack("Q", "the lists' code size") != code_size:
        raise _Refused("inverted lists of another nlist or code size than the index")
    layout = r.fourcc("the list sizes' layout")
    if layout == "full":
        sizes = r.counted(8, "the list sizes", keep=True)
        if len(sizes) != nlist:
            raise _Refused(f"{len(sizes):,} list sizes for {nlist:,} lists")
    elif layout == "sprs":
        pairs = r.counted(8, "the list sizes", keep=True)
        if len(pairs) % 2 or (len(pairs) and int(pairs[::2].max()) >= nlist):
            raise _Refused("sparse list sizes naming lists beyond nlist")
        sizes = pairs[1::2]
    else:
        raise _Refused(f"list sizes layout {layout!r}")
    if int(sizes.sum(dtype=np.float64)) != ntotal or (len(sizes) and int(sizes.max()) > ntotal):
        raise _Refused(f"inverted lists holding {int(sizes.sum(dtype=np.float64)):,} vectors, the index {ntotal:,}")
    for n in sizes.tolist():
        r.skip(n * (code_size + 8), "an inverted list")
    return d, ntotal
