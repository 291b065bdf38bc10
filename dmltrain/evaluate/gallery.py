"""A gallery prepared for dense scoring, float (cosine) or binary (Hamming of the sign bits), on a device.

Every metric and :func:`.knn.knn` work on dense score blocks ``queries × gallery`` built here:

* **float**: identical rows folded (bit-identical raw rows, then bit-identical normalized rows,
  since ``x`` and ``2x`` are the same direction), L2-normalized, one full-precision fp32 GEMM per
  block (no TF32: a tie must stay a tie), expanded back to every gallery column. Folding makes
  every exact cosine tie exact: BLAS kernels may round the same dot product differently
  depending on the column it lands in. On a GPU the folding and normalization run there too.
* **binary**, engines (``DMLTRAIN_HAMMING``: ``auto``, ``native``, ``faiss``, ``mma``, ``popcount``):

  - ``native`` / ``faiss``: packed codes on the CPU (:mod:`.hamming`), int16/int32 distances;
    ``auto`` on a CPU device.
  - ``mma``: the sign bits as ±1 int8, one int8 tensor-core GEMM per block
    (``torch._int_mm``, exact int32): ``⟨a, b⟩ = D − 2·Hamming(a, b)``, so ranking by the
    product (larger first) is ranking by Hamming distance (smaller first), ties included.
    ``auto`` on CUDA.
  - ``popcount``: packed codes as int32 words on the device, XOR + popcount in a Triton
    kernel (:mod:`.gpu_kernels`); ``auto`` on CUDA when ``torch._int_mm`` is unavailable.

Scores are larger-is-better for ``float`` and ``mma`` and smaller-is-better for the Hamming
engines; :attr:`Gallery.larger_is_better` says which, :meth:`Gallery.hamming` turns an ``mma``
product back into a distance.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from dmltrain.evaluate.hamming import engine_name, hamming_block, pad_codes
from dmltrain.evaluate.ranks import gpu_kernels  # None where the Triton kernels cannot run
from dmltrain.models.binary import pack_sign_bits

# Bytes of one dense score block (float32 or int32). Temporaries of the passes add ~2× this.
DEFAULT_BLOCK_BYTES = 256 << 20
# On a GPU fewer, larger blocks: each block costs a few launches and one host round trip.
CUDA_BLOCK_BYTES = 1 << 30
HAMMING_ENGINES = ("auto", "native", "faiss", "mma", "popcount")


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``None``/``"auto"``: the current CUDA device when available, else CPU."""
    if device is None or str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def default_block_bytes(device: torch.device) -> int:
    return CUDA_BLOCK_BYTES if device.type == "cuda" else DEFAULT_BLOCK_BYTES


@contextlib.contextmanager
def _fp32_matmul() -> Iterator[None]:
    """Full-precision float32 GEMMs (no TF32) for the duration of a search."""
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(previous)


# -- duplicate rows ----------------------------------------------------------------------------
def _fingerprint_columns(d: int) -> np.ndarray:
    return np.unique(np.linspace(0, d - 1, num=min(d, 64)).astype(np.int64))


def unique_rows(x: np.ndarray | Tensor) -> tuple[np.ndarray, np.ndarray] | tuple[Tensor, Tensor]:
    """``(first, inverse)``: indices of the first occurrence of each distinct row, and for every
    row the position of its distinct row in ``first`` (``x[first][inverse]`` equals ``x``).

    Rows are compared bit for bit (so ``-0.0`` and ``0.0`` differ, which only splits a tie).
    An exact integer fingerprint of a few columns groups candidates; groups are then verified
    on the full rows, so the result never depends on hash luck. A NumPy array is folded with
    NumPy (the fastest on a CPU), a tensor on its own device (the same result).
    """
    if isinstance(x, Tensor):
        return _unique_rows_torch(x)
    n, d = x.shape
    if n == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    bits = np.ascontiguousarray(x).view(np.uint32 if x.itemsize == 4 else np.uint8)
    cols = _fingerprint_columns(bits.shape[1])
    weights = np.random.default_rng(1234).integers(1, 2**63, size=len(cols), dtype=np.uint64) | np.uint64(1)
    finger = (bits[:, cols].astype(np.uint64) * weights).sum(1)  # wraps mod 2**64: exact and order-free
    _, group_first, group = np.unique(finger, return_index=True, return_inverse=True)
    if len(group_first) == n:
        return np.arange(n, dtype=np.int64), np.arange(n, dtype=np.int64)
    # Verify each multi-row group on the full rows.
    rep = np.arange(n, dtype=np.int64)  # rep[i]: lowest index of a row bit-identical to row i
    sizes = np.bincount(group)
    order = np.argsort(group, kind="stable")
    starts = np.concatenate(([0], np.cumsum(sizes)))
    row_view = np.ascontiguousarray(x).view(np.dtype((np.void, d * x.itemsize))).ravel()
    for gid in np.flatnonzero(sizes > 1):
        members = order[starts[gid] : starts[gid + 1]]  # ascending row index
        _, first_in, inv_in = np.unique(row_view[members], return_index=True, return_inverse=True)
        rep[members] = members[first_in][inv_in]
    first, inverse = np.unique(rep, return_inverse=True)
    return first.astype(np.int64), inverse.astype(np.int64)


def _unique_rows_torch(x: Tensor) -> tuple[Tensor, Tensor]:
    """:func:`unique_rows` of a float32 tensor on its device. The fingerprint's weights stay
    below 2**25, so 64 products of 32-bit words sum below 2**63 in int64 without wrapping."""
    n, d = x.shape
    rows = torch.arange(n, device=x.device)
    if n == 0:
        return rows, rows
    bits = x.contiguous().view(torch.int32)
    cols = torch.from_numpy(_fingerprint_columns(d)).to(x.device)
    weights = torch.randint(1, 1 << 25, (len(cols),), generator=torch.Generator().manual_seed(1234)).to(x.device)
    finger = ((bits[:, cols].long() & 0xFFFFFFFF) * weights).sum(1)
    distinct, group = torch.unique(finger, return_inverse=True)
    if len(distinct) == n:
        return rows, rows
    shared = torch.nonzero(torch.bincount(group)[group] > 1).flatten()  # rows whose fingerprint repeats
    _, cls = torch.unique(torch.cat([finger[shared, None], bits[shared].long()], 1), dim=0, return_inverse=True)
    lowest = torch.full((len(shared),), n, dtype=torch.int64, device=x.device).scatter_reduce_(0, cls, shared, "amin")
    rep = rows.clone()
    rep[shared] = lowest[cls]
    return torch.unique(rep, return_inverse=True)


def l2_normalize(x: Tensor, eps: float = 1e-12) -> Tensor:
    """Rows divided by their L2 norm; an all-zero row stays zero (cosine 0 with everything)."""
    return x / x.norm(dim=1, keepdim=True).clamp_min(eps)


# -- the gallery -------------------------------------------------------------------------------
@dataclass
class Gallery:
    """A gallery prepared for dense scoring; build it with :func:`float_gallery` or :func:`binary_gallery`."""

    kind: str  # "float" or "binary"
    engine: str  # "gemm" (float), or a binary engine: "native", "faiss", "mma", "popcount"
    size: int
    device: torch.device
    data: (
        Tensor | np.ndarray
    )  # float: unique normalized rows; native/faiss: padded codes; mma: ±1 int8; popcount: words
    inverse: Tensor | None = None  # float: gallery row -> unique row, None when all rows are distinct
    bits: int = 0  # binary: code length in bits

    @property
    def larger_is_better(self) -> bool:
        return self.engine in ("gemm", "mma")

    def query_rows(self, rows: np.ndarray) -> Tensor | np.ndarray:
        """Prepared queries for gallery rows ``rows`` (self-retrieval)."""
        if self.inverse is not None:
            return self.data[self.inverse[torch.as_tensor(rows, device=self.device)]]
        return self.take(self.data, rows)

    def take(self, prepared: Tensor | np.ndarray, rows: np.ndarray) -> Tensor | np.ndarray:
        """The queries ``rows`` of ``prepared`` queries (codes are word-major for ``popcount``)."""
        if isinstance(prepared, np.ndarray):
            return prepared[rows]
        idx = torch.as_tensor(rows, device=prepared.device)
        return prepared[:, idx] if self.engine == "popcount" else prepared[idx]

    def queries(self, emb: np.ndarray) -> Tensor | np.ndarray:
        """Prepared queries for embeddings ``emb`` (query→gallery), in this gallery's engine."""
        if self.kind == "float":
            return l2_normalize(torch.from_numpy(np.ascontiguousarray(emb)).to(self.device))
        return _binary_data(emb, self.engine, self.device, pad_rows=False)

    def scores(self, queries: Tensor | np.ndarray) -> Tensor:
        """Dense ``len(queries) × size`` block: cosines (float32), ±1 products (int32, ``mma``) or
        Hamming distances (int16/int32)."""
        if self.engine == "gemm":
            with _fp32_matmul():
                s = torch.mm(queries, self.data.t())  # type: ignore[arg-type, union-attr]
            return s[:, self.inverse] if self.inverse is not None else s
        if self.engine == "mma":
            return _int8_products(queries, self.data)[:, : self.size]  # type: ignore[arg-type]
        if self.engine == "popcount":
            return gpu_kernels.hamming_block(queries, self.data)  # type: ignore[union-attr, arg-type]
        return torch.from_numpy(hamming_block(np.ascontiguousarray(queries), self.data, engine=self.engine))  # type: ignore[arg-type]

    def rows(self, ids: Tensor) -> Tensor:
        """The prepared (float: normalized) rows of gallery items ``ids``, any shape of indices."""
        return self.data[self.inverse[ids]] if self.inverse is not None else self.data[ids]  # type: ignore[index]

    def hamming(self, scores: Tensor) -> Tensor:
        """Hamming distances from this gallery's binary scores (``mma`` products converted)."""
        return (self.bits - scores.long()) // 2 if self.engine == "mma" else scores

    def rows_per_block(self, block_bytes: int) -> int:
        per_row = 4 * self.size * (2 if self.inverse is not None else 1)
        return max(1, block_bytes // max(per_row, 1))


def fold_rows(x: Tensor, with_numpy: bool) -> tuple[Tensor, Tensor]:
    """:func:`unique_rows` of ``x`` as tensors on its device; ``with_numpy`` (a CPU tensor) folds
    with NumPy, the fastest there."""
    if with_numpy:
        first, inverse = unique_rows(x.numpy())
        return torch.from_numpy(first), torch.from_numpy(inverse)
    return unique_rows(x)  # type: ignore[return-value]


def float_gallery(emb: np.ndarray, device: torch.device) -> Gallery:
    """Fold identical rows, L2-normalize the distinct ones, on ``device`` (see the module doc)."""
    on_cpu = device.type == "cpu"
    x = torch.from_numpy(np.ascontiguousarray(emb)).to(device)
    first, inverse = fold_rows(x, on_cpu)
    rows = l2_normalize(x[first] if len(first) < len(x) else x)
    first2, inverse2 = fold_rows(rows, on_cpu)
    if len(first2) < len(first):
        rows, inverse = rows[first2], inverse2[inverse]
    inv = inverse if len(rows) < len(emb) else None
    return Gallery("float", "gemm", len(emb), device, rows.contiguous(), inv)


# -- binary engines ----------------------------------------------------------------------------
@functools.lru_cache(maxsize=8)
def int8_mm_available(device: torch.device) -> bool:
    """Whether ``torch._int_mm`` runs on ``device`` (CUDA: cuBLASLt int8, compute capability 7.5+)."""
    try:
        a = torch.ones((32, 32), dtype=torch.int8, device=device)
        return int(torch._int_mm(a, a.t())[0, 0]) == 32
    except (RuntimeError, AttributeError):
        return False


def hamming_engine(device: torch.device) -> str:
    """The binary engine for ``device``: ``DMLTRAIN_HAMMING`` when set, else ``mma`` on CUDA (``popcount``
    without int8 GEMMs) and the CPU engine (:func:`.hamming.engine_name`) elsewhere."""
    choice = os.environ.get("DMLTRAIN_HAMMING", "auto")
    if choice not in HAMMING_ENGINES:
        raise ValueError(f"DMLTRAIN_HAMMING: expected one of {', '.join(HAMMING_ENGINES)}, got '{choice}'")
    if choice == "mma" and not int8_mm_available(device):
        raise RuntimeError(f"DMLTRAIN_HAMMING=mma: torch._int_mm does not run on {device}")
    if choice == "popcount" and (gpu_kernels is None or (device.type != "cuda" and not gpu_kernels.INTERPRET)):
        raise RuntimeError(
            f"DMLTRAIN_HAMMING=popcount: the Triton kernel needs CUDA (or TRITON_INTERPRET=1), not {device}"
        )
    if choice in ("mma", "popcount"):
        return choice
    if choice == "auto" and device.type == "cuda":
        if int8_mm_available(device):
            return "mma"
        if gpu_kernels is not None:
            return "popcount"
    return engine_name()


def _binary_data(emb: np.ndarray, engine: str, device: torch.device, pad_rows: bool) -> Tensor | np.ndarray:
    """Sign codes of ``emb`` in the layout ``engine`` scores (see :class:`Gallery`)."""
    if engine == "mma":
        # ±1 per bit (x > 0 is bit 1, as in pack_sign_bits); zero columns and rows pad to the
        # shapes the int8 GEMM accepts and add nothing to a product
        x = torch.from_numpy(np.ascontiguousarray(emb)).to(device)
        n, d = x.shape
        codes = torch.zeros((n + (-n % 8 if pad_rows else 0), d + (-d % 32)), dtype=torch.int8, device=device)
        codes[:n, :d] = torch.where(x > 0, 1, -1).to(torch.int8)
        return codes
    packed = pack_sign_bits(emb)
    if engine == "popcount":  # int32 words, word-major: one coalesced load per word of a tile of codes
        packed = np.pad(packed, ((0, 0), (0, -packed.shape[1] % 4)))
        return torch.from_numpy(np.ascontiguousarray(packed).view(np.int32).T.copy()).to(device)
    return pad_codes(packed)


def _int8_products(q: Tensor, g: Tensor) -> Tensor:
    """``q @ g.T`` in int32 for ±1 int8 codes; ``torch._int_mm`` needs more than 16 query rows."""
    n = q.shape[0]
    if n <= 16:
        q = torch.cat([q, q.new_zeros((17 - n, q.shape[1]))])
    return torch._int_mm(q, g.t())[:n]


def binary_gallery(emb: np.ndarray, device: torch.device, engine: str | None = None) -> Gallery:
    """Sign codes of ``emb`` for the binary ``engine`` (default :func:`hamming_engine`); the CPU
    engines keep theirs on the CPU whatever ``device`` says."""
    engine = engine or hamming_engine(device)
    dev = device if engine in ("mma", "popcount") else torch.device("cpu")
    return Gallery("binary", engine, len(emb), dev, _binary_data(emb, engine, dev, pad_rows=True), bits=emb.shape[1])


def mask_self(block: Tensor, rows: Tensor, larger_is_better: bool) -> None:
    """Give each query's own gallery column a score worse than any real one (self-retrieval):
    -inf for similarities, the dtype's extreme for integer scores."""
    if block.dtype.is_floating_point:
        worst = float("-inf") if larger_is_better else float("inf")
    else:
        worst = torch.iinfo(block.dtype).min if larger_is_better else torch.iinfo(block.dtype).max
    block[torch.arange(len(rows), device=block.device), rows.to(block.device)] = worst
