"""All-pairs Hamming distances between packed binary codes on the CPU: the binary path's score blocks there.

Two engines, identical results (distances are exact integers): the native AVX2 kernel
(:mod:`.native`, int16 output) and ``faiss.hammings``, faiss's all-pairs routine behind its
flat binary index (int32 output), used when the kernel cannot be built, for codes longer
than :data:`MAX_NATIVE_BITS`, or with ``DMLTRAIN_HAMMING=faiss``. The GPU engines
(``mma``, ``popcount``) live in :mod:`.gallery`.
"""

from __future__ import annotations

import os
import warnings

import numpy as np
import torch

from dmltrain.evaluate import native
from dmltrain.evaluate.threads import parallel_ranges

# Codes are zero-padded to a multiple of this many bytes (zero bits add nothing to a distance).
ALIGN_BYTES = 32
# The native kernel writes int16 distances (half the memory traffic of the passes that read them).
MAX_NATIVE_BITS = 32736
_warned = False


def engine_name() -> str:
    """``native`` or ``faiss``: the engine :func:`hamming_block` uses in this process (the GPU
    engines ``mma`` and ``popcount`` leave the CPU's choice to ``auto``)."""
    global _warned
    choice = os.environ.get("DMLTRAIN_HAMMING", "auto")
    if choice not in ("auto", "native", "faiss", "mma", "popcount"):
        raise ValueError(f"DMLTRAIN_HAMMING: expected auto, native, faiss, mma or popcount, got '{choice}'")
    if choice == "faiss":
        return "faiss"
    if native.library() is not None:
        return "native"
    if choice == "native":
        raise RuntimeError(f"DMLTRAIN_HAMMING=native: {native.unavailable_reason()}")
    if not _warned:
        _warned = True
        warnings.warn(
            f"native Hamming kernel unavailable ({native.unavailable_reason()}); using faiss.hammings",
            RuntimeWarning,
            stacklevel=2,
        )
    return "faiss"


def pad_codes(codes: np.ndarray) -> np.ndarray:
    """C-contiguous uint8 codes, zero-padded on the right to a multiple of :data:`ALIGN_BYTES`."""
    codes = np.ascontiguousarray(codes, dtype=np.uint8)
    extra = -codes.shape[1] % ALIGN_BYTES
    if extra:
        codes = np.ascontiguousarray(np.pad(codes, ((0, 0), (0, extra))))
    return codes


def hamming_block(
    query: np.ndarray, gallery: np.ndarray, threads: int | None = None, engine: str | None = None
) -> np.ndarray:
    """``nq × ng`` Hamming distances between packed codes (both padded by :func:`pad_codes`).

    int16 from the native engine, int32 from faiss. ``threads`` defaults to
    ``torch.get_num_threads()``.
    """
    if query.dtype != np.uint8 or gallery.dtype != np.uint8 or query.ndim != 2 or gallery.ndim != 2:
        raise ValueError("hamming_block: expected 2-D uint8 code arrays")
    if query.shape[1] != gallery.shape[1] or query.shape[1] % ALIGN_BYTES:
        raise ValueError(
            f"hamming_block: code widths {query.shape[1]} and {gallery.shape[1]} must be equal multiples of {ALIGN_BYTES}"
        )
    if not (query.flags.c_contiguous and gallery.flags.c_contiguous):
        raise ValueError("hamming_block: codes must be C-contiguous (use pad_codes)")
    nq, ng, nbytes = query.shape[0], gallery.shape[0], query.shape[1]
    engine = engine or engine_name()
    if nbytes * 8 > MAX_NATIVE_BITS:
        engine = "faiss"
    out = np.empty((nq, ng), dtype=np.int16 if engine == "native" else np.int32)
    if nq == 0 or ng == 0:
        return out
    if engine == "faiss":
        import faiss

        previous = faiss.omp_get_max_threads()
        faiss.omp_set_num_threads(max(1, threads or torch.get_num_threads()))
        try:
            faiss.hammings(faiss.swig_ptr(query), faiss.swig_ptr(gallery), nq, ng, nbytes, faiss.swig_ptr(out))
        finally:
            faiss.omp_set_num_threads(previous)
        return out
    lib = native.library()
    if lib is None:
        raise RuntimeError(f"native Hamming kernel unavailable: {native.unavailable_reason()}")

    def run(lo: int, hi: int) -> None:  # ctypes releases the GIL for the call
        lib.dml_hamming_all_pairs(
            query[lo:].ctypes.data, hi - lo, gallery.ctypes.data, ng, nbytes, out[lo:].ctypes.data, ng
        )

    parallel_ranges(run, np.linspace(0, nq, max(1, min(threads or _threads(), nq)) + 1).astype(np.int64))
    return out


def _threads() -> int:
    return torch.get_num_threads()
