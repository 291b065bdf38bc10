"""The sharded softmax's compute in fused Triton kernels: the CUDA path.

Two functions over one shard's :class:`~dmltrain.distributed.shard_operands.ShardOperands`, the
same two the torch backend (:mod:`~dmltrain.distributed.softmax_torch`) exposes:
:func:`partials` (each sample's log-sum-exp, max and sum of its non-target logits on this shard)
and :func:`gradients` (the embeddings' and the active rows' gradients). The ``N × K`` logits only
ever live in registers.

Operands. The gathered batch ``x`` (``N × D``, unit rows for the normalised kinds) and a per-step
copy of the active rows in the product precision (bf16 by default), *normalised* for the
normalised kinds, made by :func:`_copy_rows_kernel` one chunk of classes at a time (a chunk's copy
stays within :data:`CHUNK_BYTES`); the kernels then read dense rows in
half the bytes, and no separate row-norm pass or per-column factor is left in them. Logit of
sample ``i`` and active column ``j``: ``s·(x_i·ŵ_j)``, or ``x_i·w_j + b_j`` for ``softmax_ce``.
Each sample's own target column ``tcol[i]`` (−1 when this shard does not hold it) and the padding
columns past ``count`` are left out.

Kernels (each product a tensor-core ``tl.dot`` with fp32 accumulation; ``D`` a compile-time
constant, padded to a power of two ``D_PAD`` for the backward's accumulators):

* :func:`_lse_kernel` (forward, one product): grid (sample tiles × class splits); an online
  log-sum-exp over the split's class tiles, per-split partials reduced by torch.
* The backward, atomic-free (two kernels, two products each, five in all with the forward's): each
  recomputes its logit tiles and turns them into ``G = (exp(z − lse) − off)·α``.
  :func:`_grad_x_kernel` (grid: sample tiles × class splits) sums ``G·ŵ`` over its split's class
  tiles in a ``BLOCK_B × D_PAD`` fp32 accumulator held in registers and writes its partial once;
  torch sums the partials in a fixed order. :func:`_grad_w_kernel` (grid: class tiles) sums ``Gᵀx``
  over every sample tile in a ``BLOCK_C × D_PAD`` accumulator in registers, then applies the
  normalisation's backward ``∂L/∂w_j = (h_j − S_j ŵ_j)/‖w_j‖`` (``h_j = s·Σ_i G_ij x_i``, ``S_j =
  Σ_i G_ij z_ij``) and writes (or adds) the rows' gradients straight into ``.grad`` at the active
  rows, the bias's from ``Σ_i G_ij``. No atomics, no scratch in global memory, every sum in a fixed
  order set by the tiles: with the same tiles (``deterministic`` fixes them; otherwise the forward's
  are tuned) a rerun gives the same bits on the same GPU model with the same Triton (the split counts follow the
  binaries' registers and shared memory).

* The staged backward (bf16 products: :func:`staged_backward`; fp32 and tf32 take the fused pair), per stage of
  :func:`stage_columns` classes: :func:`_probs_kernel` (grid: sample tiles × class tiles; one product) writes the
  stage's ``G·s`` in bf16 and per-sample-tile column sums; cuBLAS computes ``grad_x += G·Ŵ`` with fp32
  accumulation and result; :func:`_stage_rows_kernel` (grid: class tiles) sums ``h = Gᵀx`` over every sample tile
  in a ``BLOCK_C × D_PAD`` accumulator, adds the column sums in order and writes ``(h_j − S_j ŵ_j)/‖w_j‖`` (or
  ``h_j`` and the bias's ``S_j``) into ``.grad`` at the rows. Four products, one a dense GEMM, at the price of ``G``
  written and read twice (``6·N·C`` bytes, ``D`` multiply-adds a byte).
  Deterministic as well: cuBLAS gives the same bits for the same shapes on the same GPU.

Precision (``precision``): ``fp32`` (IEEE products), ``tf32``, or ``bf16`` (operands stored in
bf16, products and accumulation in fp32); the probabilities are rounded like the operands for the
gradient products. Under ``TRITON_INTERPRET=1`` (read when this module is imported) the kernels run
on the CPU with 16-wide tiles; bf16 products are then emulated by multiplying the bf16 values in
fp32, which is what the tensor cores compute.

Launch geometry: on CUDA each kernel's tiles are chosen per shape key (``D``, the batch's and the
class count's powers of two, precision, kind, padding) by timing its candidates once, the choice
kept across ranks and runs (:class:`~dmltrain.kernel_tuning.Tuner`); the class splits follow from
the chosen sample tile so that the grid fills whole waves of ``SMs × CTAs per SM``, the CTAs per SM of
the binary launched from its registers and shared memory (:mod:`~dmltrain.kernel_occupancy`; one where
Triton does not tell them). ``deterministic`` takes each
kernel's first candidate instead, untuned: the tiles set the order of the sums, and a tuned choice may
differ between ranks tuning at once and between runs, fixed ones are the same on every rank and in
every run, so a rerun gives the same bits (on the same GPU model and Triton version, which fix the
binaries and so the split counts). Every candidate fits the shared
memory of an A100 (sm_80) and an H100 (sm_90): :func:`compile_variants` lists them for the offline
compile tests.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from dmltrain.distributed.row_sparse import RowGradTarget
from dmltrain.distributed.shard_operands import ShardOperands
from dmltrain.kernel_compile import KernelVariant
from dmltrain.kernel_occupancy import SMLimits, device_limits, occupancy, resources
from dmltrain.kernel_tuning import LaunchConfig, Tuner, time_launch

PREC_CODE = {"fp32": 0, "tf32": 1, "bf16": 2}  # the kernels' PREC constexpr of each product precision
_BF16_EMULATED = 3
#: bytes of a chunk's row copy counted with 4 more bytes a number, the fp32 gradient scratch the atomic backward
#: had (kept so that the chunk sizes and tuning keys stay as they were; the transients stay well inside 1 GiB)
CHUNK_BYTES = 384 * 2**20
#: bytes of the backward's per-split embedding-gradient partials
PARTIAL_BYTES = 256 * 2**20
NORM_EPS = 1e-12
_SMALL = 16  # interpreter tiles
_NEG_INF = tl.constexpr(float("-inf"))


# -- device helpers -------------------------------------------------------------------------------
@triton.jit
def _round_bf16(v):
    """fp32 rounded to the nearest bf16 (ties to even), kept in fp32."""
    u = v.to(tl.uint32, bitcast=True)
    u = u + 0x7FFF + ((u >> 16) & 1)
    return ((u >> 16) << 16).to(tl.float32, bitcast=True)


@triton.jit
def _operand(v, PREC: tl.constexpr):
    """An fp32 tile as a product operand of precision ``PREC``."""
    if PREC == 2:
        return v.to(tl.bfloat16)
    elif PREC == 3:
        return _round_bf16(v)
    else:
        return v


@triton.jit
def _mma(a, b, acc, PREC: tl.constexpr):
    """``acc + a @ b`` in the requested precision, fp32 accumulation (operands already in it)."""
    if PREC == 2:
        acc = tl.dot(a, b, acc)
    elif PREC == 1:
        acc = tl.dot(a, b, acc, input_precision="tf32")
    else:
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return acc


@triton.jit
def _valid_columns(count_ptr, c0, K, HAS_COUNT: tl.constexpr):
    """Columns of this chunk that take part: ``K``, or fewer when the draw's count ends inside it."""
    if HAS_COUNT:
        return tl.maximum(tl.minimum(K, tl.load(count_ptr).to(tl.int32) - c0), 0)
    else:
        return K


@triton.jit
def _chunk_rows(rows_ptr, count_ptr, c0, K, HAS_ROWS: tl.constexpr, HAS_COUNT: tl.constexpr, BLOCK_R: tl.constexpr):
    """This program's ``BLOCK_R`` columns of the chunk at ``c0``: their offsets, which take part, and their rows
    of the weight (``rows[c0 + offs]``, or the columns themselves without an active-row list)."""
    offs = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    mask = offs < _valid_columns(count_ptr, c0, K, HAS_COUNT)
    if HAS_ROWS:
        r = tl.load(rows_ptr + c0 + offs, mask=mask, other=0).to(tl.int64)
    else:
        r = (c0 + offs).to(tl.int64)
    return offs, mask, r


@triton.jit
def _logits(
    x_ptr,
    w_ptr,
    b_ptr,
    offs_b,
    mask_b,
    offs_c,
    mask_c,
    scale,
    D: tl.constexpr,
    NORMALIZED: tl.constexpr,
    PREC: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """The ``BLOCK_B × BLOCK_C`` logit tile (finite everywhere; masked entries are 0 or the bias)."""
    acc = tl.zeros((BLOCK_B, BLOCK_C), dtype=tl.float32)
    xb = x_ptr + offs_b.to(tl.int64)[:, None] * D
    wb = w_ptr + offs_c.to(tl.int64)[:, None] * D
    for k0 in tl.range(0, D, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mk = offs_k[None, :] < D
        xt = tl.load(xb + offs_k[None, :], mask=mask_b[:, None] & mk, other=0.0)
        wt = tl.load(wb + offs_k[None, :], mask=mask_c[:, None] & mk, other=0.0)
        acc = _mma(xt, tl.trans(wt), acc, PREC)
    return _scaled(acc, b_ptr, offs_c, mask_c, scale, NORMALIZED)


@triton.jit
def _scaled(acc, b_ptr, offs_c, mask_c, scale, NORMALIZED: tl.constexpr):
    """Products ``x·ŵ`` (or ``x·w``) as logits: times the scale, or plus the bias."""
    if NORMALIZED:
        return acc * scale
    else:
        return acc + tl.load(b_ptr + offs_c, mask=mask_c, other=0.0)[None, :]


@triton.jit
def _softmax_grad(z, lse, keep, coef_ptr, scale, NORMALIZED: tl.constexpr):
    """(``G·s`` for the products, the per-column reduction ``Σ_i G_ij z_ij`` or ``Σ_i G_ij``)."""
    alpha = tl.load(coef_ptr)
    off = tl.load(coef_ptr + 1)
    g = tl.where(keep, (tl.exp(z - lse[:, None]) - off) * alpha, 0.0)
    if NORMALIZED:
        return g * scale, tl.sum(g * z, 0)
    else:
        return g, tl.sum(g, 0)


@triton.jit
def _split_range(n_valid, BLOCK_C: tl.constexpr):
    """The class tiles ``[t0, t1)`` of this program's split (axis 1 of the grid)."""
    n_tiles = tl.cdiv(n_valid, BLOCK_C)
    per = tl.cdiv(n_tiles, tl.num_programs(1))
    t0 = tl.program_id(1) * per
    return t0, tl.minimum(t0 + per, n_tiles)


# -- kernels ----------------------------------------------------------------------------------------
@triton.jit
def _copy_rows_kernel(
    w_ptr,
    rows_ptr,
    b_ptr,
    count_ptr,
    out_ptr,
    inv_ptr,
    bout_ptr,
    c0,
    K,
    eps,
    D: tl.constexpr,
    HAS_ROWS: tl.constexpr,
    HAS_COUNT: tl.constexpr,
    NORMALIZED: tl.constexpr,
    TO_BF16: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Active columns ``c0 … c0+K−1``: their rows (normalised, with ``1/‖w‖``) or rows and biases, dense; the rows of
    columns past a draw's count are zeros (the staged backward's GEMMs multiply them by ``G``'s zeros)."""
    offs, mask, r = _chunk_rows(rows_ptr, count_ptr, c0, K, HAS_ROWS, HAS_COUNT, BLOCK_R)
    in_k = offs < K
    src = w_ptr + r[:, None] * D
    dst = out_ptr + offs.to(tl.int64)[:, None] * D
    if NORMALIZED:
        ss = tl.zeros((BLOCK_R,), dtype=tl.float32)
        for d0 in tl.range(0, D, BLOCK_D):
            offs_d = d0 + tl.arange(0, BLOCK_D)
            m = mask[:, None] & (offs_d[None, :] < D)
            v = tl.load(src + offs_d[None, :], mask=m, other=0.0).to(tl.float32)
            ss += tl.sum(v * v, 1)
        inv = 1.0 / tl.maximum(tl.sqrt(ss), eps)
        tl.store(inv_ptr + offs, inv, mask=mask)
    else:
        inv = tl.full((BLOCK_R,), 1.0, dtype=tl.float32)
        tl.store(bout_ptr + offs, tl.load(b_ptr + r, mask=mask, other=0.0).to(tl.float32), mask=mask)
    for d0 in tl.range(0, D, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        m = mask[:, None] & (offs_d[None, :] < D)
        v = tl.load(src + offs_d[None, :], mask=m, other=0.0).to(tl.float32) * inv[:, None]
        if TO_BF16:  # round to nearest even explicitly: Triton's interpreter would truncate
            v = _round_bf16(v)
        tl.store(dst + offs_d[None, :], v.to(out_ptr.dtype.element_ty), mask=in_k[:, None] & (offs_d[None, :] < D))


@triton.jit
def _lse_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    tcol_ptr,
    count_ptr,
    out_ptr,
    N,
    K,
    c0,
    scale,
    D: tl.constexpr,
    HAS_COUNT: tl.constexpr,
    NORMALIZED: tl.constexpr,
    SUM_LOGITS: tl.constexpr,
    PREC: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_K: tl.constexpr,
    X_RESIDENT: tl.constexpr = False,
):
    """Grid (sample tiles × class splits): each program an online log-sum-exp (and max, and the logits' sum) over its
    split's class tiles, written as its split's partials. ``X_RESIDENT`` (``D`` a power of two): FlashAttention-style,
    the batch block is loaded once and kept in shared memory while the class rows stream past it (one product of
    depth ``D`` a tile), so the batch is not re-read from L2 for every class tile."""
    offs_b = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    mask_b = offs_b < N
    tcol = tl.load(tcol_ptr + offs_b, mask=mask_b, other=-1)
    n_valid = _valid_columns(count_ptr, c0, K, HAS_COUNT)
    m = tl.full((BLOCK_B,), _NEG_INF, dtype=tl.float32)
    sum_exp = tl.zeros((BLOCK_B,), dtype=tl.float32)
    s = tl.zeros((BLOCK_B,), dtype=tl.float32)
    t0, t1 = _split_range(n_valid, BLOCK_C)
    if X_RESIDENT:
        offs_d = tl.arange(0, D)
        xt = tl.load(x_ptr + offs_b.to(tl.int64)[:, None] * D + offs_d[None, :], mask=mask_b[:, None], other=0.0)
    for t in range(t0, t1):
        offs_c = t * BLOCK_C + tl.arange(0, BLOCK_C)
        mask_c = offs_c < n_valid
        if X_RESIDENT:
            wt = tl.load(w_ptr + offs_c.to(tl.int64)[:, None] * D + offs_d[None, :], mask=mask_c[:, None], other=0.0)
            z = _mma(xt, tl.trans(wt), tl.zeros((BLOCK_B, BLOCK_C), dtype=tl.float32), PREC)
            z = _scaled(z, b_ptr, offs_c, mask_c, scale, NORMALIZED)
        else:
            z = _logits(x_ptr, w_ptr, b_ptr, offs_b, mask_b, offs_c, mask_c, scale, D, NORMALIZED, PREC,
                        BLOCK_B, BLOCK_C, BLOCK_K)  # fmt: skip
        keep = mask_c[None, :] & (offs_c[None, :] != tcol[:, None])
        zk = tl.where(keep, z, _NEG_INF)
        m_new = tl.maximum(m, tl.max(zk, 1))
        m_ref = tl.where(m_new == _NEG_INF, 0.0, m_new)  # rows with nothing kept yet stay at sum_exp = 0
        sum_exp = sum_exp * tl.exp(m - m_ref) + tl.sum(tl.exp(zk - m_ref[:, None]), 1)
        m = m_new
        if SUM_LOGITS:
            s += tl.sum(tl.where(keep, z, 0.0), 1)
    out = out_ptr + tl.program_id(1) * 3 * N + offs_b
    tl.store(out, tl.where(sum_exp > 0, m + tl.log(tl.maximum(sum_exp, 1e-30)), _NEG_INF), mask=mask_b)
    tl.store(out + N, m, mask=mask_b)
    tl.store(out + 2 * N, s, mask=mask_b)


@triton.jit
def _grad_x_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    tcol_ptr,
    count_ptr,
    lse_ptr,
    coef_ptr,
    part_ptr,
    N,
    K,
    c0,
    scale,
    D: tl.constexpr,
    HAS_COUNT: tl.constexpr,
    NORMALIZED: tl.constexpr,
    PREC: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_K: tl.constexpr,
    D_PAD: tl.constexpr,
):
    """This program's partial of the embeddings' gradient over its class split: a ``BLOCK_B × D_PAD`` fp32
    accumulator in registers across every class tile of the split, written once (zeros for an empty split)."""
    offs_b = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    mask_b = offs_b < N
    tcol = tl.load(tcol_ptr + offs_b, mask=mask_b, other=-1)
    lse = tl.load(lse_ptr + offs_b, mask=mask_b, other=0.0)
    n_valid = _valid_columns(count_ptr, c0, K, HAS_COUNT)
    offs_d = tl.arange(0, D_PAD)
    md = offs_d[None, :] < D
    acc = tl.zeros((BLOCK_B, D_PAD), dtype=tl.float32)
    t0, t1 = _split_range(n_valid, BLOCK_C)
    for t in range(t0, t1):
        offs_c = t * BLOCK_C + tl.arange(0, BLOCK_C)
        mask_c = offs_c < n_valid
        z = _logits(x_ptr, w_ptr, b_ptr, offs_b, mask_b, offs_c, mask_c, scale, D, NORMALIZED, PREC,
                    BLOCK_B, BLOCK_C, BLOCK_K)  # fmt: skip
        keep = mask_b[:, None] & mask_c[None, :] & (offs_c[None, :] != tcol[:, None])
        g, _ = _softmax_grad(z, lse, keep, coef_ptr, scale, NORMALIZED)
        wv = tl.load(w_ptr + offs_c.to(tl.int64)[:, None] * D + offs_d[None, :], mask=mask_c[:, None] & md, other=0.0)
        acc = _mma(_operand(g, PREC), wv, acc, PREC)
    out = part_ptr + (tl.program_id(1) * N + offs_b).to(tl.int64)[:, None] * D
    tl.store(out + offs_d[None, :], acc, mask=mask_b[:, None] & md)


@triton.jit
def _grad_w_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    tcol_ptr,
    count_ptr,
    lse_ptr,
    coef_ptr,
    inv_ptr,
    wt_ptr,
    rows_ptr,
    gw_ptr,
    gb_ptr,
    N,
    K,
    c0,
    scale,
    D: tl.constexpr,
    HAS_COUNT: tl.constexpr,
    NORMALIZED: tl.constexpr,
    PREC: tl.constexpr,
    HAS_ROWS: tl.constexpr,
    WRITE_W: tl.constexpr,
    WRITE_B: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_K: tl.constexpr,
    D_PAD: tl.constexpr,
):
    """The gradients of this program's ``BLOCK_C`` active rows, summed over every sample tile in order in a
    ``BLOCK_C × D_PAD`` fp32 accumulator in registers, then, in the epilogue, through the normalisation's
    backward (``g·inv − inv²·red·w``) straight into ``.grad`` (``wt_ptr`` is the weight) at the rows."""
    offs_c, mask_c, r = _chunk_rows(rows_ptr, count_ptr, c0, K, HAS_ROWS, HAS_COUNT, BLOCK_C)
    offs_d = tl.arange(0, D_PAD)
    md = offs_d[None, :] < D
    acc = tl.zeros((BLOCK_C, D_PAD), dtype=tl.float32)
    red = tl.zeros((BLOCK_C,), dtype=tl.float32)
    if tl.program_id(0) * BLOCK_C < _valid_columns(count_ptr, c0, K, HAS_COUNT):
        for b0 in range(0, N, BLOCK_B):
            offs_b = b0 + tl.arange(0, BLOCK_B)
            mask_b = offs_b < N
            tcol = tl.load(tcol_ptr + offs_b, mask=mask_b, other=-1)
            lse = tl.load(lse_ptr + offs_b, mask=mask_b, other=0.0)
            # the transposed tile (classes × samples): the class side is the products' M, 64 rows for wgmma
            if NORMALIZED:
                zt = _logits(w_ptr, x_ptr, b_ptr, offs_c, mask_c, offs_b, mask_b, scale, D, True, PREC,
                             BLOCK_C, BLOCK_B, BLOCK_K)  # fmt: skip
            else:  # the bias per row of this tile (times 1.0: exact)
                zt = _logits(w_ptr, x_ptr, b_ptr, offs_c, mask_c, offs_b, mask_b, 1.0, D, True, PREC,
                             BLOCK_C, BLOCK_B, BLOCK_K) + tl.load(b_ptr + offs_c, mask=mask_c, other=0.0)[:, None]  # fmt: skip
            keep = mask_c[:, None] & mask_b[None, :] & (offs_c[:, None] != tcol[None, :])
            alpha = tl.load(coef_ptr)
            off = tl.load(coef_ptr + 1)
            gt = tl.where(keep, (tl.exp(zt - lse[None, :]) - off) * alpha, 0.0)
            if NORMALIZED:
                red += tl.sum(gt * zt, 1)
                gt = gt * scale
            else:
                red += tl.sum(gt, 1)
            if WRITE_W:
                xv = tl.load(x_ptr + offs_b.to(tl.int64)[:, None] * D + offs_d[None, :], mask=mask_b[:, None] & md,
                             other=0.0)  # fmt: skip
                acc = _mma(_operand(gt, PREC), xv, acc, PREC)
    if WRITE_B:
        _bias_store(red, r, mask_c, gb_ptr, ACCUMULATE)
    if WRITE_W:
        inv = tl.load(inv_ptr + offs_c, mask=mask_c, other=0.0) if NORMALIZED else red
        _rows_epilogue(acc, red, inv, r, mask_c, wt_ptr, gw_ptr, D, NORMALIZED, ACCUMULATE, BLOCK_C, D_PAD)


@triton.jit
def _bias_store(red, r, mask_c, gb_ptr, ACCUMULATE: tl.constexpr):
    """The bias's gradient of rows ``r``, the column sums ``red`` (``Σ_i G_ij``), into ``gb_ptr`` (added to what is
    there if ``ACCUMULATE``)."""
    gb = red
    if ACCUMULATE:
        gb += tl.load(gb_ptr + r, mask=mask_c, other=0.0).to(tl.float32)
    tl.store(gb_ptr + r, gb.to(gb_ptr.dtype.element_ty), mask=mask_c)


@triton.jit
def _rows_epilogue(acc, red, inv, r, mask_c, wt_ptr, gw_ptr, D: tl.constexpr, NORMALIZED: tl.constexpr,
                   ACCUMULATE: tl.constexpr, BLOCK_C: tl.constexpr, D_PAD: tl.constexpr):  # fmt: skip
    """The rows' gradients (``acc``, ``BLOCK_C × D_PAD``) through the normalisation's backward into ``.grad`` at rows
    ``r`` (:func:`_rows_store`), in quarters from ``D_PAD = 256``: a full-width weight tile beside the accumulator
    would spill."""
    if D_PAD >= 256:
        a0, a1 = tl.split(tl.permute(tl.reshape(acc, (BLOCK_C, 2, D_PAD // 2)), (0, 2, 1)))
        a00, a01 = tl.split(tl.permute(tl.reshape(a0, (BLOCK_C, 2, D_PAD // 4)), (0, 2, 1)))
        a10, a11 = tl.split(tl.permute(tl.reshape(a1, (BLOCK_C, 2, D_PAD // 4)), (0, 2, 1)))
        _rows_store(a00, 0, red, inv, r, mask_c, wt_ptr, gw_ptr, D, NORMALIZED, ACCUMULATE, D_PAD // 4)
        _rows_store(a01, D_PAD // 4, red, inv, r, mask_c, wt_ptr, gw_ptr, D, NORMALIZED, ACCUMULATE, D_PAD // 4)
        _rows_store(a10, D_PAD // 2, red, inv, r, mask_c, wt_ptr, gw_ptr, D, NORMALIZED, ACCUMULATE, D_PAD // 4)
        _rows_store(a11, 3 * D_PAD // 4, red, inv, r, mask_c, wt_ptr, gw_ptr, D, NORMALIZED, ACCUMULATE, D_PAD // 4)
    else:
        _rows_store(acc, 0, red, inv, r, mask_c, wt_ptr, gw_ptr, D, NORMALIZED, ACCUMULATE, D_PAD)


@triton.jit
def _rows_store(acc, d0, red, inv, r, mask_c, wt_ptr, gw_ptr, D: tl.constexpr, NORMALIZED: tl.constexpr,
                ACCUMULATE: tl.constexpr, WIDTH: tl.constexpr):  # fmt: skip
    """Columns ``d0 … d0+WIDTH−1`` of the rows' gradients (``acc``) into ``.grad`` at rows ``r``: the
    normalisation's backward ``acc·inv − inv²·red·w`` applied, added to what is there if ``ACCUMULATE``."""
    offs_d = d0 + tl.arange(0, WIDTH)
    m = mask_c[:, None] & (offs_d[None, :] < D)
    dst = gw_ptr + r[:, None] * D + offs_d[None, :]
    if NORMALIZED:
        w = tl.load(wt_ptr + r[:, None] * D + offs_d[None, :], mask=m, other=0.0).to(tl.float32)
        acc = acc * inv[:, None] - (inv * inv * red)[:, None] * w
    if ACCUMULATE:
        acc += tl.load(dst, mask=m, other=0.0).to(tl.float32)
    tl.store(dst, acc.to(gw_ptr.dtype.element_ty), mask=m)


@triton.jit
def _probs_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    tcol_ptr,
    count_ptr,
    lse_ptr,
    coef_ptr,
    g_ptr,
    red_ptr,
    N,
    K,
    c0,
    s0,
    scale,
    D: tl.constexpr,
    HAS_COUNT: tl.constexpr,
    NORMALIZED: tl.constexpr,
    PREC: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """The staged backward's one product: the ``BLOCK_B × BLOCK_C`` tile of ``G·s`` (``G`` for ``softmax_ce``) of
    the ``K`` columns starting at ``s0`` in the chunk at ``c0`` (``w_ptr``/``b_ptr`` start at column ``s0``), in the
    operands' precision into ``g_ptr`` (``N × K``, zeros at targets and padding), and this sample tile's column
    sums (``Σ_i G_ij z_ij``, or ``Σ_i G_ij``) into row ``program_id(0)`` of ``red_ptr``."""
    offs_b = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask_b = offs_b < N
    mask_c = offs_c < _valid_columns(count_ptr, c0 + s0, K, HAS_COUNT)
    tcol = tl.load(tcol_ptr + offs_b, mask=mask_b, other=-1)
    lse = tl.load(lse_ptr + offs_b, mask=mask_b, other=0.0)
    z = _logits(x_ptr, w_ptr, b_ptr, offs_b, mask_b, offs_c, mask_c, scale, D, NORMALIZED, PREC,
                BLOCK_B, BLOCK_C, BLOCK_K)  # fmt: skip
    keep = mask_b[:, None] & mask_c[None, :] & (s0 + offs_c[None, :] != tcol[:, None])
    g, red = _softmax_grad(z, lse, keep, coef_ptr, scale, NORMALIZED)
    in_k = offs_c < K
    dst = g_ptr + offs_b.to(tl.int64)[:, None] * K + offs_c[None, :]
    tl.store(dst, _operand(g, PREC).to(g_ptr.dtype.element_ty), mask=mask_b[:, None] & in_k[None, :])
    tl.store(red_ptr + tl.program_id(0) * K + offs_c, red, mask=in_k)


@triton.jit(do_not_specialize=["n_parts"])  # the probabilities' sample tiles, 1 to hundreds: one binary for all
def _stage_rows_kernel(
    g_ptr,
    x_ptr,
    red_ptr,
    inv_ptr,
    wt_ptr,
    rows_ptr,
    count_ptr,
    gw_ptr,
    gb_ptr,
    N,
    K,
    c0,
    n_parts,
    D: tl.constexpr,
    HAS_ROWS: tl.constexpr,
    HAS_COUNT: tl.constexpr,
    NORMALIZED: tl.constexpr,
    PREC: tl.constexpr,
    WRITE_W: tl.constexpr,
    WRITE_B: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_C: tl.constexpr,
    D_PAD: tl.constexpr,
):
    """The staged backward's rows, for this program's ``BLOCK_C`` of the stage's ``K`` active columns from ``c0``:
    ``h = Gᵀx`` summed over every sample tile in order in a ``BLOCK_C × D_PAD`` fp32 accumulator (``G``, ``N × K`` in
    the operands' precision, scaled by ``s`` for the normalised kinds), the column sums' ``n_parts`` partials added in
    order, then the fused pair's epilogue into ``.grad`` at the rows; columns past the count are left alone."""
    offs_c, mask_c, r = _chunk_rows(rows_ptr, count_ptr, c0, K, HAS_ROWS, HAS_COUNT, BLOCK_C)
    red = tl.zeros((BLOCK_C,), dtype=tl.float32)
    for p in range(0, n_parts):
        red += tl.load(red_ptr + p * K + offs_c, mask=mask_c, other=0.0)
    if WRITE_B:
        _bias_store(red, r, mask_c, gb_ptr, ACCUMULATE)
    if WRITE_W:
        offs_d = tl.arange(0, D_PAD)
        md = offs_d[None, :] < D
        acc = tl.zeros((BLOCK_C, D_PAD), dtype=tl.float32)
        if tl.program_id(0) * BLOCK_C < _valid_columns(count_ptr, c0, K, HAS_COUNT):
            for b0 in range(0, N, BLOCK_B):
                offs_b = b0 + tl.arange(0, BLOCK_B)
                mask_b = offs_b < N
                gt = tl.load(g_ptr + offs_b.to(tl.int64)[None, :] * K + offs_c[:, None],
                             mask=mask_c[:, None] & mask_b[None, :], other=0.0)  # fmt: skip
                xv = tl.load(x_ptr + offs_b.to(tl.int64)[:, None] * D + offs_d[None, :], mask=mask_b[:, None] & md,
                             other=0.0)  # fmt: skip
                acc = _mma(gt, xv, acc, PREC)
        inv = tl.load(inv_ptr + offs_c, mask=mask_c, other=0.0) if NORMALIZED else red
        _rows_epilogue(acc, red, inv, r, mask_c, wt_ptr, gw_ptr, D, NORMALIZED, ACCUMULATE, BLOCK_C, D_PAD)


#: the kernels run under the CPU interpreter (Triton decided so when they were defined, from TRITON_INTERPRET)
INTERPRET = not isinstance(_lse_kernel, triton.runtime.JITFunction)


# -- tiles ------------------------------------------------------------------------------------------
def _cfg(warps: int, stages: int, **meta: int) -> LaunchConfig:
    return LaunchConfig.of(warps, stages, **meta)


#: candidates per kernel and precision, each compiled without register spills for an A100 (sm_80) and an
#: H100 (sm_90) and within their shared memory (the offline compile tests). What keeps a 128-row tile's
#: softmax in registers is a narrow D chunk in the products and the gradient stores (16 to 32 numbers),
#: and a 64-wide second tile side where a 128 × 128 tile would spill on one of the two. fp32 (IEEE)
#: products run on the CUDA cores: a reference precision, with small tiles.
_CONFIGS: dict[tuple[str, str], list[LaunchConfig]] = {
    ("lse", "bf16"): [
        _cfg(8, 3, BLOCK_B=128, BLOCK_C=128, BLOCK_K=16),
        _cfg(8, 3, BLOCK_B=128, BLOCK_C=64, BLOCK_K=32),
    ],
    ("lse", "tf32"): [_cfg(8, 3, BLOCK_B=128, BLOCK_C=128, BLOCK_K=16)],
    ("lse", "fp32"): [_cfg(4, 2, BLOCK_B=64, BLOCK_C=64, BLOCK_K=16)],
    ("grad_x", "bf16"): [_cfg(8, 2, BLOCK_B=64, BLOCK_C=32, BLOCK_K=32)],
    ("grad_x", "tf32"): [_cfg(8, 2, BLOCK_B=64, BLOCK_C=32, BLOCK_K=16)],
    ("grad_x", "fp32"): [_cfg(4, 2, BLOCK_B=32, BLOCK_C=32, BLOCK_K=16)],
    ("grad_w", "bf16"): [_cfg(8, 2, BLOCK_B=32, BLOCK_C=64, BLOCK_K=32)],
    ("grad_w", "tf32"): [_cfg(8, 2, BLOCK_B=16, BLOCK_C=64, BLOCK_K=16)],
    ("grad_w", "fp32"): [_cfg(4, 2, BLOCK_B=32, BLOCK_C=32, BLOCK_K=16)],
    # the staged backward (bf16 only): the log-sum-exp kernel's tile, storing G instead of reducing it
    ("probs", "bf16"): [_cfg(8, 3, BLOCK_B=128, BLOCK_C=128, BLOCK_K=16)],
    # and its rows' gradients from G: the rows' kernel's tile, a BLOCK_C × D accumulator in registers
    ("stage_rows", "bf16"): [_cfg(8, 2, BLOCK_B=32, BLOCK_C=64)],
}
#: the log-sum-exp kernel with the logits' sum (``softmax_ce`` with label smoothing) keeps a third running
#: row: with a 128 × 128 tile it spills on sm_80 (255 registers, 16-32 bytes of stack at every width, in the
#: binaries a launch builds), so that path takes the 64-wide class tile
_SUM_CONFIGS: dict[str, list[LaunchConfig]] = {
    "bf16": [_cfg(8, 3, BLOCK_B=128, BLOCK_C=64, BLOCK_K=32)],
    "tf32": [_cfg(8, 3, BLOCK_B=128, BLOCK_C=64, BLOCK_K=16)],
    "fp32": _CONFIGS[("lse", "fp32")],
}
_COPY = _cfg(4, 2, BLOCK_R=32, BLOCK_D=128)


#: under the interpreter the log-sum-exp kernel takes the batch-resident path (at power-of-two widths) when set: the
#: tests run both paths
INTERPRET_RESIDENT = False


def _interpreter_config(kind: str, D: int) -> LaunchConfig:
    if kind == "stage_rows":  # no D chunk: the accumulator is the whole width
        return LaunchConfig.of(1, 1, BLOCK_B=_SMALL, BLOCK_C=_SMALL)
    if kind == "lse" and INTERPRET_RESIDENT and D & (D - 1) == 0:
        return LaunchConfig.of(1, 1, BLOCK_B=_SMALL, BLOCK_C=_SMALL, BLOCK_K=_SMALL, X_RESIDENT=1)
    return LaunchConfig.of(1, 1, BLOCK_B=_SMALL, BLOCK_C=_SMALL, BLOCK_K=_SMALL)


def _device(t: Tensor):
    return torch.cuda.device(t.device) if t.device.type == "cuda" else contextlib.nullcontext()


@functools.cache
def _tuner(device_index: int) -> Tuner:
    return Tuner(torch.cuda.get_device_name(device_index), triton.__version__)


@functools.cache
def _sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.cache
def _sm_limits(device_index: int) -> SMLimits:
    return device_limits(torch.cuda.get_device_properties(device_index))


#: the log-sum-exp kernel with the batch block resident in shared memory (``X_RESIDENT``), for bf16 at the widths
#: whose block and three stages of 64 class rows fit both chips' shared memory (a power of two up to 256: 80 / 160 KiB)
_RESIDENT = _cfg(8, 3, BLOCK_B=128, BLOCK_C=64, BLOCK_K=16, X_RESIDENT=1)
RESIDENT_MAX_DIM = 256


def _candidates(kind: str, precision: str, sum_logits: bool = False, D: int | None = None) -> list[LaunchConfig]:
    """The tile configs a launch of ``kind`` may take at width ``D`` (:data:`_SUM_CONFIGS` for the log-sum-exp kernel
    with the logits' sum; the batch-resident one, :data:`_RESIDENT`, after the streaming ones where it fits)."""
    if kind == "lse" and sum_logits:
        return _SUM_CONFIGS[precision]
    out = _CONFIGS[(kind, precision)]
    if kind == "lse" and precision == "bf16" and D is not None and D <= RESIDENT_MAX_DIM and D & (D - 1) == 0:
        out = [*out, _RESIDENT]
    return out


def _choose(
    kind: str,
    key: tuple,
    precision: str,
    device: torch.device,
    launch,
    deterministic: bool = False,
    sum_logits: bool = False,
) -> LaunchConfig:
    """The tiles of ``kind`` for ``key``: fixed under the interpreter, else tuned once among
    :func:`_candidates` (``launch(cfg)`` runs the kernel on scratch outputs) and remembered across ranks and
    runs.

    ``deterministic``: the kind's first candidate, never tuned. The tiles set the order of the kernels'
    sums, and a tuned choice may differ between ranks that tune at once and between runs (timings vary, a
    tuning file is rewritten or lost); fixed tiles give the same bits on every rank and in every run."""
    if INTERPRET or device.type != "cuda":
        return _interpreter_config(kind, key[0])
    candidates = _candidates(kind, precision, sum_logits, key[0])
    if deterministic or len(candidates) == 1:
        return candidates[0]
    return _tuner(device.index or 0).choose(
        kind, (*key, sum_logits), candidates, functools.partial(time_launch, launch)
    )


@functools.lru_cache(maxsize=4096)
def num_splits(sample_tiles: int, class_tiles: int, programs: int, most: int | None = None) -> int:
    """Class splits of the sample-tiled kernels: the fewest that minimise the time in tile units,
    ``waves × tiles per split`` = ``⌈sample_tiles·s / programs⌉ · ⌈class_tiles / s⌉`` (``programs``
    run at once), at most ``most``."""
    best, best_cost = 1, math.inf
    for s in range(1, max(1, min(class_tiles, 8 * programs, most or class_tiles)) + 1):
        cost = math.ceil(sample_tiles * s / programs) * math.ceil(class_tiles / s)
        if cost < best_cost:
            best, best_cost = s, cost
    return best


def _programs(kernel, cfg: LaunchConfig, args: Sequence[Any], kwargs: dict[str, Any], device: torch.device) -> int:
    """Programs the GPU runs at once for a launch of ``kernel`` with ``args`` and ``kwargs`` (``cfg``'s among them):
    SMs × the CTAs per SM of the binary that launch runs (its registers and shared memory; one where Triton does not
    tell them). Two under the interpreter.

    The binary is Triton's for those arguments (``warmup`` compiles it if need be and caches it for the launch), so
    the split count is a function of the shape, the GPU model and the Triton version, as the kernel's bits are: an
    output the launch will allocate may be passed as its dtype (a stand-in tensor, aligned as a fresh one is)."""
    if INTERPRET or device.type != "cuda":
        return 2
    index = device.index or 0
    used = resources(kernel.warmup(*args, grid=(1,), **kwargs))
    return _sms(index) * occupancy(_sm_limits(index), used, cfg.num_warps)


# -- the chunks -------------------------------------------------------------------------------------
class _Chunk:
    """Active columns ``c0 … c1−1`` as dense operands: rows (normalised), inverse norms or biases, targets."""

    def __init__(self, op: ShardOperands, c0: int, c1: int, dtype: torch.dtype) -> None:
        w, dev, D = op.weight, op.weight.device, op.weight.shape[1]
        self.c0, self.K = c0, c1 - c0
        self.w = torch.empty(self.K, D, device=dev, dtype=dtype)
        self.inv = torch.empty(self.K, device=dev, dtype=torch.float32) if op.normalized else None
        self.b = None if op.normalized else torch.empty(self.K, device=dev, dtype=torch.float32)
        self.tcol = torch.where((op.tcol >= c0) & (op.tcol < c1), op.tcol - c0, -1).to(torch.int32)
        if self.K:
            with _device(w):
                _copy_rows_kernel[(triton.cdiv(self.K, _COPY["BLOCK_R"] if not INTERPRET else _SMALL),)](
                    w, _or(op.rows, w), _or(op.bias, w), _or(op.count, w), self.w, _or(self.inv, w), _or(self.b, w),
                    c0, self.K, NORM_EPS, D=D, HAS_ROWS=op.rows is not None, HAS_COUNT=op.count is not None,
                    NORMALIZED=op.normalized, TO_BF16=dtype == torch.bfloat16, **_copy_meta(),
                )  # fmt: skip


def _copy_meta() -> dict[str, int]:
    if INTERPRET:
        return {"BLOCK_R": _SMALL, "BLOCK_D": _SMALL}
    return _COPY.kwargs()


def _or(t: Tensor | None, dummy: Tensor) -> Tensor:
    return dummy if t is None else t


#: the forward's row copies are kept for the backward (made once a step, not twice: 0.93 ms of HBM at 10⁶ × 512 in
#: bf16 on an H100, 1 GB held from the forward to the backward) while they total at most this many bytes
KEEP_COPY_BYTES = 2**31


def keeps_copies(K: int, D: int, elt: int) -> bool:
    """Whether the forward keeps the row copies of ``K`` columns of width ``D`` (``elt`` bytes a number, and a 4-byte
    inverse norm or bias each) for the backward."""
    return K * (D * elt + 4) <= KEEP_COPY_BYTES


class KeptCopies(NamedTuple):
    """The forward's chunks for the backward, and the weight's and bias's versions they were copied at."""

    chunks: list[_Chunk]
    versions: tuple[int, int]


def _versions(op: ShardOperands) -> tuple[int, int]:
    return op.weight._version, -1 if op.bias is None else op.bias._version


def _columns(op: ShardOperands) -> int:
    return op.weight.shape[0] if op.rows is None else op.rows.numel()


def _chunks(op: ShardOperands, elt: int):
    """Column ranges whose copy (``elt`` bytes a number, plus 4: see :data:`CHUNK_BYTES`) fits :data:`CHUNK_BYTES`."""
    K, D = _columns(op), op.weight.shape[1]
    quantum = _SMALL if INTERPRET else 128  # whole class tiles
    step = max(quantum, (CHUNK_BYTES // (D * (elt + 4))) // quantum * quantum)
    for c0 in range(0, K, step):
        yield c0, min(K, c0 + step)


def _operands(op: ShardOperands, precision: str) -> tuple[Tensor, torch.dtype, int, int]:
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    prec = PREC_CODE[precision]
    if INTERPRET and prec == PREC_CODE["bf16"]:
        prec = _BF16_EMULATED
    return op.x.to(dtype).contiguous(), dtype, prec, torch.finfo(dtype).bits // 8


def _key(op: ShardOperands, K: int, precision: str) -> tuple:
    N, D = op.x.shape
    return (
        D,
        triton.next_power_of_2(N),
        triton.next_power_of_2(max(K, 1)),
        precision,
        op.normalized,
        op.count is not None,
    )


# -- the backend's two functions --------------------------------------------------------------------
def partials(
    op: ShardOperands, sum_logits: bool, precision: str, deterministic: bool = False, keep_copies: bool = False
) -> tuple[Tensor, Tensor, Tensor | None, KeptCopies | None]:
    """Per sample: log-sum-exp, max and sum of the logits of the active columns but its target
    (−inf, −inf, 0 where there is none), fp32. ``deterministic``: fixed tiles (:func:`_choose`).
    ``keep_copies`` (a backward will follow): the chunks' row copies are returned for :func:`gradients`, which
    then does not make them again, while they total at most :data:`KEEP_COPY_BYTES`; None otherwise."""
    N, D = op.x.shape
    dev = op.x.device
    x, dtype, prec, elt = _operands(op, precision)
    kept: list[_Chunk] | None = [] if keep_copies and keeps_copies(_columns(op), D, elt) else None
    lse = torch.full((N,), -math.inf, device=dev)
    mx = torch.full((N,), -math.inf, device=dev)
    sm = torch.zeros(N, device=dev)
    for c0, c1 in _chunks(op, elt):
        ch = _Chunk(op, c0, c1, dtype)
        count = _or(op.count, ch.w)

        def launch(cfg: LaunchConfig, ch: _Chunk = ch, count: Tensor = count) -> Tensor:
            args = [x, ch.w, _or(ch.b, ch.w), ch.tcol, count, torch.float32, N, ch.K, ch.c0, float(op.scale)]
            kwargs = dict(D=D, HAS_COUNT=op.count is not None, NORMALIZED=op.normalized, SUM_LOGITS=sum_logits,
                          PREC=prec, **cfg.kwargs())  # fmt: skip
            with _device(x):
                programs = _programs(_lse_kernel, cfg, args, kwargs, dev)
                splits = num_splits(triton.cdiv(N, cfg["BLOCK_B"]), triton.cdiv(ch.K, cfg["BLOCK_C"]), programs)
                args[5] = out = torch.empty(splits, 3, N, device=dev)
                _lse_kernel[(triton.cdiv(N, cfg["BLOCK_B"]), splits)](*args, **kwargs)
            return out

        part = launch(_choose("lse", _key(op, ch.K, precision), precision, dev, launch, deterministic, sum_logits))
        lse = torch.logaddexp(lse, torch.logsumexp(part[:, 0], 0))
        mx = torch.maximum(mx, part[:, 1].amax(0))
        sm += part[:, 2].sum(0)
        if kept is not None:
            kept.append(ch)
    return lse, mx, (sm if sum_logits else None), None if kept is None else KeptCopies(kept, _versions(op))


def gradients(
    op: ShardOperands,
    saved: Any,
    lse: Tensor,
    alpha: Tensor,
    off: Tensor | None,
    need_x: bool,
    out: RowGradTarget | None,
    precision: str,
    deterministic: bool = False,
) -> Tensor | None:
    """The embeddings' gradient (None unless ``need_x``; fp32) and, into ``out`` at ``op.rows``, the
    active rows' gradients, of the non-target, non-padding columns with ``G = (exp(z − lse) − off)·α``."""
    N, D = op.x.shape
    dev = op.x.device
    x, dtype, prec, elt = _operands(op, precision)
    need_w = out is not None and (out.weight is not None or out.bias is not None)
    if not (need_x or need_w):
        return None
    coef = torch.stack([alpha.float(), torch.zeros((), device=dev) if off is None else off.float()])
    lse = lse.float().contiguous()
    grad_x = torch.zeros(N, D, device=dev) if need_x else None
    staged = staged_backward(precision, D, deterministic)
    # the forward's copies, unless the weight (or bias) changed in place since
    kept = saved.chunks if isinstance(saved, KeptCopies) and saved.versions == _versions(op) else None
    for i, (c0, c1) in enumerate(_chunks(op, elt)):
        ch = kept[i] if kept is not None else _Chunk(op, c0, c1, dtype)
        assert (ch.c0, ch.K) == (c0, c1 - c0), "the forward's copies are of other chunks"
        call = _GradCall(
            (x, ch.w, _or(ch.b, ch.w), ch.tcol, _or(op.count, ch.w), lse, coef),
            (N, ch.K, ch.c0, float(op.scale)),
            dict(D=D, HAS_COUNT=op.count is not None, NORMALIZED=op.normalized, PREC=prec),
        )
        key = _key(op, ch.K, precision)
        if staged:  # one candidate each, never timed (the rows' kernel writes into .grad)
            call.staged(_choose("probs", key, precision, dev, _untimed, deterministic),
                        _choose("stage_rows", key, precision, dev, _untimed, deterministic), op, ch, out, grad_x)  # fmt: skip
            continue
        if need_x:
            part = call.split_x(_choose("grad_x", key, precision, dev, call.split_x, deterministic))
            # one reduction launch over the splits (not one add each: 272 at 10^6 x 512, B = 1,024); torch's sum
            # uses no atomics, so its order is fixed for a given shape on CPU and CUDA
            grad_x += part[0] if part.shape[0] == 1 else part.sum(0)
        if need_w:  # one candidate, never timed (a trial would write into .grad)
            call.rows(_choose("grad_w", key, precision, dev, _untimed, deterministic), op, ch, out)
    return grad_x


def _untimed(cfg: LaunchConfig) -> None:
    raise AssertionError("a kernel with a single candidate is never timed")


class _GradCall:
    """The backward kernels of one chunk: their common arguments, launched with a config."""

    def __init__(self, args: tuple, tail: tuple, common: dict[str, Any]) -> None:
        self.args, self.tail, self.common = args, tail, common
        self.N, self.K = tail[0], tail[1]

    def split_x(self, cfg: LaunchConfig) -> Tensor:
        """The embeddings' gradient: one partial per class split, each written once by one program."""
        x, D = self.args[0], self.args[0].shape[1]
        most = max(1, PARTIAL_BYTES // max(1, 4 * self.N * D))
        kwargs = {**self.common, **cfg.kwargs(), "D_PAD": triton.next_power_of_2(D)}
        with _device(x):
            programs = _programs(_grad_x_kernel, cfg, (*self.args, torch.float32, *self.tail), kwargs, x.device)
            splits = num_splits(
                triton.cdiv(self.N, cfg["BLOCK_B"]), triton.cdiv(self.K, cfg["BLOCK_C"]), programs, most
            )
            part = torch.empty(splits, self.N, D, device=x.device)  # every program writes its whole partial
            _grad_x_kernel[(triton.cdiv(self.N, cfg["BLOCK_B"]), splits)](*self.args, part, *self.tail, **kwargs)
        return part

    def rows(self, cfg: LaunchConfig, op: ShardOperands, ch: _Chunk, out: RowGradTarget) -> None:
        """The chunk's rows' gradients into ``out`` at its rows: each class tile summed over the samples by one
        program, which applies the normalisation's backward and writes (or adds) them once."""
        w = op.weight
        with _device(w):
            _grad_w_kernel[(triton.cdiv(self.K, cfg["BLOCK_C"]),)](
                *self.args, _or(ch.inv, w), w, _or(op.rows, w), _or(out.weight, w), _or(out.bias, w), *self.tail,
                **self.common, HAS_ROWS=op.rows is not None, WRITE_W=out.weight is not None,
                WRITE_B=out.bias is not None, ACCUMULATE=out.accumulate, **cfg.kwargs(),
                D_PAD=triton.next_power_of_2(w.shape[1]),
            )  # fmt: skip

    def staged(self, cfg: LaunchConfig, rows_cfg: LaunchConfig, op: ShardOperands, ch: _Chunk,
               out: RowGradTarget | None, grad_x: Tensor | None) -> None:  # fmt: skip
        """The staged backward of the chunk, :func:`stage_columns` columns at a time: ``G`` by :func:`_probs_kernel`
        (tiles ``cfg``), ``grad_x += G·Ŵ`` by cuBLAS (fp32 accumulation and result), and the rows' gradients from
        ``Gᵀx`` by :func:`_stage_rows_kernel` (tiles ``rows_cfg``)."""
        x, w, b, tcol, count, lse, coef = self.args
        N, K, c0, scale = self.tail
        D, dev = x.shape[1], x.device
        write_w = out is not None and out.weight is not None
        write_b = out is not None and out.bias is not None
        step = min(K, stage_columns(N, INTERPRET))
        TB = triton.cdiv(N, cfg["BLOCK_B"])
        g_buf = torch.empty(N * step, device=dev, dtype=w.dtype)
        red = torch.empty(TB * step, device=dev)
        weight = op.weight
        for s0 in range(0, K, step):
            k = min(step, K - s0)
            g = g_buf[: N * k].view(N, k)
            with _device(x):
                _probs_kernel[(TB, triton.cdiv(k, cfg["BLOCK_C"]))](
                    x, w[s0:], b[s0:], tcol, count, lse, coef, g, red, N, k, c0, s0, scale, **self.common,
                    **cfg.kwargs(),
                )  # fmt: skip
            if grad_x is not None:
                _gemm(g, w[s0 : s0 + k], grad_x)
            if write_w or write_b:
                with _device(weight):
                    _stage_rows_kernel[(triton.cdiv(k, rows_cfg["BLOCK_C"]),)](
                        g, x, red, _or(ch.inv, w)[s0:], weight, _or(op.rows, weight), count, _or(out.weight, weight),
                        _or(out.bias, weight), N, k, c0 + s0, TB, D=D, HAS_ROWS=op.rows is not None,
                        HAS_COUNT=op.count is not None, NORMALIZED=op.normalized, PREC=self.common["PREC"],
                        WRITE_W=write_w, WRITE_B=write_b, ACCUMULATE=out.accumulate, **rows_cfg.kwargs(),
                        D_PAD=triton.next_power_of_2(D),
                    )  # fmt: skip


#: bf16 backwards are staged (:func:`staged_backward`); off, they take the fused atomic-free pair as fp32 and tf32 do
STAGE_BF16 = True
#: the narrowest embedding staged: at D = 64 the roofline puts the fused pair ahead (10⁶ classes, B = 1,024: 1.87
#: against 2.33 ms on an H100), each byte of G carrying too few multiply-adds
STAGE_MIN_DIM = 128
#: a stage's ``G`` (``N × columns``, bf16), transient: few stages (launches and their host cost) while the memory
#: stays small beside the classifier's; ``G`` goes through HBM, which does not bound its readers (each of its bytes
#: carries ``D`` multiply-adds)
STAGE_BYTES = 256 * 2**20
#: the fewest columns a stage takes on a GPU, however large the batch: fewer leave cuBLAS a short inner dimension
#: for ``G·Ŵ`` and the embeddings' gradient read and written once more per stage
STAGE_MIN_COLUMNS = 1024


def staged_backward(precision: str, D: int, deterministic: bool = False) -> bool:
    """Whether :func:`gradients` stages ``G`` (bf16 products at ``D ≥`` :data:`STAGE_MIN_DIM`, not ``deterministic``,
    while :data:`STAGE_BF16`) rather than running the fused atomic-free pair. Staged, ``G·Ŵ`` is a dense GEMM at
    cuBLAS's rate and no logit is recomputed for the rows, and the price is ``G`` written and read twice (``6·N·C``
    bytes, ``D`` multiply-adds a byte of it): on paper it wins from ``D = 128`` (``bench classifier --model`` prints
    both) and loses at 64. ``deterministic`` takes the fused pair, whose sums all run in an order its tiles fix:
    cuBLAS promises the same bits only while one stream is active. fp32 and tf32 stay fused: cuBLAS would need the
    global TF32 switch, and they are the reference precisions."""
    return precision == "bf16" and D >= STAGE_MIN_DIM and not deterministic and STAGE_BF16


def stage_columns(N: int, interpret: bool) -> int:
    """Columns of one stage of the staged backward: its ``G`` within :data:`STAGE_BYTES`, whole class tiles, at least
    :data:`STAGE_MIN_COLUMNS` on a GPU (one tile under the interpreter)."""
    q = _SMALL if interpret else 128
    fit = STAGE_BYTES // (2 * N) // q * q
    return max(q if interpret else STAGE_MIN_COLUMNS, fit)


#: whether this torch's ``addmm`` takes an fp32 input with bf16 operands and ``out_dtype`` (learnt on the first call)
_ADDMM_FP32_INPUT = [True]


def _gemm(a: Tensor, b: Tensor, acc: Tensor | None = None) -> Tensor:
    """``a @ b`` with fp32 accumulation and an fp32 result, added into ``acc`` in place when given: cuBLAS with bf16
    operands on CUDA (``out_dtype``), elsewhere an fp32 product (the interpreter's operands: bf16 values, exact in
    fp32)."""
    if a.device.type == "cuda" and a.dtype != torch.float32:
        if acc is None:
            return torch.mm(a, b, out_dtype=torch.float32)
        if _ADDMM_FP32_INPUT[0]:
            try:
                return torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
            except RuntimeError:  # a torch before pytorch#167931 wants acc in the operands' dtype: its check, no launch
                _ADDMM_FP32_INPUT[0] = False
        return acc.add_(torch.mm(a, b, out_dtype=torch.float32))
    r = a.float() @ b.float()
    if acc is None:
        return r
    acc += r
    return acc


# -- the offline compile contract ---------------------------------------------------------------------
#: D is a compile-time constant: every embedding width compiles its own binary (the loops over it unrolled),
#: so the list holds the widths people train (ArcFace/PartialFC 512, CLIP-style 256, the 10⁷-class 128).
_D_VARIANTS = (128, 256, 512)
#: the width at which the binaries of ragged sizes (integers not multiples of 16) are listed too
_D_RAGGED = 512


def _sig(names: str, types: dict[str, str]) -> dict[str, str]:
    return {n: types.get(n, "constexpr") for n in names.split()}


def compile_variants() -> list[KernelVariant]:
    """Every (candidate tiles × constexpr combination) the launchers pass, at each width of
    :data:`_D_VARIANTS`, as a launch at the benchmark shapes specialises them (integers multiples of 16),
    and at D = 512 also as a ragged size does.

    ``spills_allowed`` only for fp32 (IEEE) products: they run on the CUDA cores, a reference
    precision for exactness checks whose small tiles still spill a little in the backward kernels;
    every bf16 and tf32 (tensor-core) variant must compile without spills. The product kernels must
    pipeline their loads (``cp.async``), and on sm_90 the tensor-core ones must use ``wgmma``.
    """
    out = [v for D in _D_VARIANTS for v in _variants_at(D)]
    # a ragged batch or draw: N and K not multiples of 16; the chunk offset c0 still is (whole class tiles:
    # every variant names it in aligned_ints)
    out += [dataclasses.replace(v, name=f"{v.name} ragged", divisible=False) for v in _variants_at(_D_RAGGED)]
    return out


def _variants_at(D: int) -> list[KernelVariant]:
    out: list[KernelVariant] = []
    for precision, op_t in (("bf16", "bf16"), ("tf32", "fp32"), ("fp32", "fp32")):
        for normalized in (True, False):
            for has_count in (False, True):
                flags = dict(D=D, HAS_COUNT=has_count, NORMALIZED=normalized, PREC=PREC_CODE[precision])
                tag = f"D={D} {precision} {'normalized' if normalized else 'bias'}{' count' if has_count else ''}"
                out += _lse_variants(op_t, precision, flags, tag)
                out += _grad_variants(op_t, precision, flags, tag)
                if precision == "bf16":  # the staged backward's precision
                    out += _staged_variants(op_t, precision, flags, tag)
    for w_t in ("fp32", "bf16"):
        for op_t in ("bf16", "fp32"):
            for normalized in (True, False):
                for has_rows in (False, True):
                    for has_count in (False, True) if has_rows else (False,):  # a count comes with drawn rows
                        out.append(_copy_variant(w_t, op_t, D, normalized, has_rows, has_count))
    return out


def _main_types(op_t: str, flags: dict) -> dict[str, str]:
    """The argument types of the product kernels as the launchers pass them: an argument a path does not use
    gets a stand-in tensor (the chunk's rows, in the operand type ``op_t``), whose type is part of the
    binary Triton compiles."""
    return {
        "x_ptr": f"*{op_t}", "w_ptr": f"*{op_t}", "b_ptr": f"*{op_t}" if flags["NORMALIZED"] else "*fp32",
        "tcol_ptr": "*i32", "count_ptr": "*i64" if flags["HAS_COUNT"] else f"*{op_t}", "lse_ptr": "*fp32",
        "coef_ptr": "*fp32", "out_ptr": "*fp32", "part_ptr": "*fp32", "N": "i32", "K": "i32", "c0": "i32",
        "scale": "fp32",
    }  # fmt: skip


def _variant(name: str, fn, sig: dict, consts: dict, cfg: LaunchConfig, precision: str) -> KernelVariant:
    tensor_cores = ("wgmma.mma_async",) if precision != "fp32" else ()
    # what costs registers: the bias and count paths, the logits' sum, the rows' gradients added to .grad in an fp32
    # weight's type, a wide D (fp32 IEEE products may spill: no variant of theirs is singled out)
    costly = (not consts["NORMALIZED"], consts["HAS_COUNT"], consts.get("SUM_LOGITS"), consts.get("ACCUMULATE"),
              consts.get("WRITE_W") and sig.get("gw_ptr") == "*fp32")  # fmt: skip
    return KernelVariant(f"{name} {_tiles(cfg)}", fn, sig, {**consts, **dict(cfg.meta)}, cfg.num_warps,
                         cfg.num_stages, spills_allowed=precision == "fp32", config=_tiles(cfg),
                         ptx_has=("cp.async",), hopper_ptx_has=tensor_cores, aligned_ints=("c0",),
                         pressure=0 if precision == "fp32" else sum(map(bool, costly)) + consts["D"] // 128)  # fmt: skip


def _lse_variants(op_t: str, precision: str, flags: dict, tag: str) -> list[KernelVariant]:
    sig = _sig("x_ptr w_ptr b_ptr tcol_ptr count_ptr out_ptr N K c0 scale D HAS_COUNT NORMALIZED SUM_LOGITS PREC "
               "BLOCK_B BLOCK_C BLOCK_K X_RESIDENT", _main_types(op_t, flags))  # fmt: skip
    out = []
    for sum_logits in (False, True) if not flags["NORMALIZED"] else (False,):
        for cfg in _candidates("lse", precision, sum_logits, flags["D"]):
            name = f"_lse_kernel {tag}{' sum' if sum_logits else ''}"
            consts = {**flags, "SUM_LOGITS": sum_logits, "X_RESIDENT": False}
            out.append(_variant(name, _lse_kernel, sig, consts, cfg, precision))
    return out


def _grad_variants(op_t: str, precision: str, flags: dict, tag: str) -> list[KernelVariant]:
    head = "x_ptr w_ptr b_ptr tcol_ptr count_ptr lse_ptr coef_ptr"
    tail = "N K c0 scale D HAS_COUNT NORMALIZED"
    det_x = _sig(f"{head} part_ptr {tail} PREC BLOCK_B BLOCK_C BLOCK_K D_PAD", _main_types(op_t, flags))
    det_w = _sig(f"{head} inv_ptr wt_ptr rows_ptr gw_ptr gb_ptr {tail} PREC HAS_ROWS WRITE_W WRITE_B ACCUMULATE "
                 "BLOCK_B BLOCK_C BLOCK_K D_PAD", _main_types(op_t, flags))  # fmt: skip
    out = []
    for cfg in _CONFIGS[("grad_x", precision)]:
        consts = {**flags, "D_PAD": triton.next_power_of_2(flags["D"])}
        out.append(_variant(f"_grad_x_kernel {tag}", _grad_x_kernel, det_x, consts, cfg, precision))
    writes = [(True, False)] if flags["NORMALIZED"] else [(True, True), (True, False), (False, True)]
    for cfg in _CONFIGS[("grad_w", precision)]:
        for w_t in ("fp32", "bf16"):
            # the weight (``w_t``) stands in for the arguments a path does not use
            types = {**det_w, "inv_ptr": "*fp32" if flags["NORMALIZED"] else f"*{w_t}", "wt_ptr": f"*{w_t}",
                     "gw_ptr": f"*{w_t}", "gb_ptr": f"*{w_t}"}  # fmt: skip
            for has_rows in (True,) if flags["HAS_COUNT"] else (False, True):  # a count comes with drawn rows
                types["rows_ptr"] = "*i64" if has_rows else f"*{w_t}"
                for write_w, write_b in writes:
                    for acc in (False, True):
                        consts = {**flags, "D_PAD": triton.next_power_of_2(flags["D"]), "HAS_ROWS": has_rows,
                                  "WRITE_W": write_w, "WRITE_B": write_b, "ACCUMULATE": acc}  # fmt: skip
                        name = (f"_grad_w_kernel {tag} {w_t} weight rows={has_rows} write_w={write_w} "
                                f"write_b={write_b} accumulate={acc}")  # fmt: skip
                        out.append(_variant(name, _grad_w_kernel, dict(types), consts, cfg, precision))
    return out


def _staged_variants(op_t: str, precision: str, flags: dict, tag: str) -> list[KernelVariant]:
    """The staged backward's two kernels as :meth:`_GradCall.staged` launches them (``G`` in the operands' type; the
    epilogue's stand-ins the weight, as in the fused pair)."""
    sig = _sig("x_ptr w_ptr b_ptr tcol_ptr count_ptr lse_ptr coef_ptr g_ptr red_ptr N K c0 s0 scale D HAS_COUNT "
               "NORMALIZED PREC BLOCK_B BLOCK_C BLOCK_K", {**_main_types(op_t, flags), "g_ptr": f"*{op_t}",
                                                          "red_ptr": "*fp32", "s0": "i32"})  # fmt: skip
    # s0, a stage's first column, is a multiple of the stage (whole class tiles) even where N and K are ragged
    out = [dataclasses.replace(_variant(f"_probs_kernel {tag}", _probs_kernel, sig, flags, cfg, precision),
                               aligned_ints=("c0", "s0")) for cfg in _candidates("probs", precision)]  # fmt: skip
    writes = [(True, False)] if flags["NORMALIZED"] else [(True, True), (True, False), (False, True)]
    for cfg in _candidates("stage_rows", precision):
        for w_t in ("fp32", "bf16"):
            types = {"g_ptr": f"*{op_t}", "x_ptr": f"*{op_t}", "red_ptr": "*fp32",
                     "inv_ptr": "*fp32" if flags["NORMALIZED"] else f"*{op_t}", "wt_ptr": f"*{w_t}",
                     "count_ptr": "*i64" if flags["HAS_COUNT"] else f"*{op_t}", "gw_ptr": f"*{w_t}", "gb_ptr": f"*{w_t}",
                     "N": "i32", "K": "i32", "c0": "i32", "n_parts": "i32"}  # fmt: skip
            for has_rows in (True,) if flags["HAS_COUNT"] else (False, True):
                types["rows_ptr"] = "*i64" if has_rows else f"*{w_t}"
                for write_w, write_b in writes:
                    for acc in (False, True):
                        sig = _sig("g_ptr x_ptr red_ptr inv_ptr wt_ptr rows_ptr count_ptr gw_ptr gb_ptr N K c0 n_parts D "
                                   "HAS_ROWS HAS_COUNT NORMALIZED PREC WRITE_W WRITE_B ACCUMULATE BLOCK_B BLOCK_C D_PAD",
                                   types)  # fmt: skip
                        consts = {**flags, "D_PAD": triton.next_power_of_2(flags["D"]), "HAS_ROWS": has_rows,
                                  "WRITE_W": write_w, "WRITE_B": write_b, "ACCUMULATE": acc}  # fmt: skip
                        name = (f"_stage_rows_kernel {tag} {w_t} weight rows={has_rows} write_w={write_w} "
                                f"write_b={write_b} accumulate={acc}")  # fmt: skip
                        v = _variant(name, _stage_rows_kernel, sig, consts, cfg, precision)
                        # the bias's gradient alone is the column sums: no product to pipeline or run on tensor cores
                        out.append(v if write_w else dataclasses.replace(v, ptx_has=(), hopper_ptx_has=()))
    return out


def _copy_variant(w_t: str, op_t: str, D: int, normalized: bool, has_rows: bool, has_count: bool) -> KernelVariant:
    """The row copy from the weight (stored in ``w_t``; its bias too) into the chunk's operands (``op_t``); the
    arguments a path does not use get the weight as stand-in."""
    types = {"w_ptr": f"*{w_t}", "rows_ptr": "*i64" if has_rows else f"*{w_t}", "b_ptr": f"*{w_t}",
             "count_ptr": "*i64" if has_count else f"*{w_t}", "out_ptr": f"*{op_t}",
             "inv_ptr": "*fp32" if normalized else f"*{w_t}", "bout_ptr": f"*{w_t}" if normalized else "*fp32",
             "c0": "i32", "K": "i32", "eps": "fp32"}  # fmt: skip
    sig = _sig("w_ptr rows_ptr b_ptr count_ptr out_ptr inv_ptr bout_ptr c0 K eps D HAS_ROWS HAS_COUNT NORMALIZED "
               "TO_BF16 BLOCK_R BLOCK_D", types)  # fmt: skip
    consts = dict(D=D, HAS_ROWS=has_rows, HAS_COUNT=has_count, NORMALIZED=normalized, TO_BF16=op_t == "bf16",
                  **dict(_COPY.meta))  # fmt: skip
    name = f"_copy_rows_kernel D={D} {w_t} to {op_t} normalized={normalized} rows={has_rows} count={has_count}"
    return KernelVariant(name, _copy_rows_kernel, sig, consts, _COPY.num_warps, _COPY.num_stages, config=_tiles(_COPY),
                         aligned_ints=("c0",))  # fmt: skip


def _tiles(cfg: LaunchConfig) -> str:
    meta = dict(cfg.meta)
    resident = " x-resident" if meta.pop("X_RESIDENT", 0) else ""
    return "×".join(str(v) for _, v in sorted(meta.items())) + f"{resident} w{cfg.num_warps} s{cfg.num_stages}"
