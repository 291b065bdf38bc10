"""Triton kernels of the fused sharded softmax: block products fused with the softmax, logits never stored.

One shard scores the gathered batch ``x`` (``N × D``) against its ``K`` active class rows
``w[rows[j]]`` of the weight (all rows when ``rows`` is None). The logit of sample ``i`` and
active column ``j`` is ``s·inv_j·(x_i·w_j)`` for the normalised kinds (``x`` holds unit rows,
``inv_j = 1/‖w_j‖``) and ``x_i·w_j + b_j`` for ``softmax_ce``. Each sample's own target
column ``tcol[i]`` (−1 when this shard does not hold it) is *excluded*: the target logit,
with its margin, is computed apart on (embedding, class row) pairs in torch.

Kernels (each product a tensor-core ``tl.dot`` with fp32 accumulation):

* :func:`row_inv_norms`: ``inv_j`` of the active rows (one pass over them).
* :func:`lse_partials`: grid (sample tiles × class splits); each program runs an online
  log-sum-exp over its split's class tiles and writes per-sample partials (log-sum-exp,
  max, sum of logits) of its split; torch reduces the few splits. The ``N × K`` logits
  live in registers only.
* :func:`grad_embeddings`: grid (sample tiles × class splits × D chunks); recomputes each
  logit tile, turns it into ``G = (exp(z − lse) − off)·α`` and accumulates ``G·(c_j w_j)``
  into a register tile of the embeddings' gradient; each split writes its partial and torch
  sums them.
* :func:`grad_rows`: grid (class tiles × D chunks); recomputes the logit tiles of its
  classes for every sample tile and accumulates ``Gᵀx`` (plus the normalisation's
  ``Σ_i G_ij z_ij`` or the bias gradient ``Σ_i G_ij``) in registers, then writes each active
  row's gradient once, straight into ``.grad`` (scattered through ``out_rows``).

Why two backward kernels rather than one: a single kernel would have to add either the
embedding or the row gradient from many programs into the same memory (atomics: order-
dependent rounding and contention on the hot ``N × D`` rows). Split, each gradient is
accumulated in registers by exactly one program per output tile and written once: results
are deterministic (bit-identical run to run) at the cost of one more recomputation of the
logits (five products per step instead of four; the three-GEMM bound is three).

Precision (``prec``): ``fp32`` (IEEE products), ``tf32``, or ``bf16`` (operands rounded to
bf16, products and accumulation fp32); the probabilities are rounded like the operands for
the two gradient products. Under ``TRITON_INTERPRET=1`` (read when this module is imported)
the kernels run on the CPU; bf16 products are then emulated by rounding the operands to
bf16 (round-to-nearest-even) and multiplying in fp32, which is what the tensor cores compute.

Tile sizes: autotuned on CUDA over a small set per kernel (key: D, the batch's power of two,
the precision and the kind); fixed 16-wide tiles under the interpreter.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl
from torch import Tensor

from dmltrain.kernel_compile import shared_memory_prune

PRECISIONS = {"fp32": 0, "tf32": 1, "bf16": 2}
_BF16_EMULATED = 3
#: widest register tile of a gradient row (D beyond it is split over programs, each recomputing the logits)
MAX_OUT_WIDTH = 512
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
def _mma(a, b, acc, PREC: tl.constexpr):
    """``acc + a @ b`` in the requested precision, fp32 accumulation."""
    if PREC == 2:
        acc = tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16), acc)
    elif PREC == 3:
        acc = tl.dot(_round_bf16(a.to(tl.float32)), _round_bf16(b.to(tl.float32)), acc, input_precision="ieee")
    elif PREC == 1:
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="tf32")
    else:
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return acc


@triton.jit
def _class_tile(rows_ptr, inv_ptr, b_ptr, offs_c, K, scale, HAS_ROWS: tl.constexpr, NORMALIZED: tl.constexpr):
    """Weight rows (int64) of active columns ``offs_c`` and their per-column factor / bias."""
    mask_c = offs_c < K
    if HAS_ROWS:
        r = tl.load(rows_ptr + offs_c, mask=mask_c, other=0).to(tl.int64)
    else:
        r = offs_c.to(tl.int64)
    if NORMALIZED:
        col = tl.load(inv_ptr + offs_c, mask=mask_c, other=0.0) * scale  # s / ‖w_j‖
    else:
        col = tl.load(b_ptr + r, mask=mask_c, other=0.0).to(tl.float32)  # the bias
    return r, col, mask_c


@triton.jit
def _logits(
    x_ptr,
    w_ptr,
    offs_b,
    mask_b,
    r,
    mask_c,
    col,
    D,
    NORMALIZED: tl.constexpr,
    PREC: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """The ``BLOCK_B × BLOCK_C`` logit tile (finite everywhere; masked entries are 0 or the bias)."""
    acc = tl.zeros((BLOCK_B, BLOCK_C), dtype=tl.float32)
    for k0 in range(0, D, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < D
        xt = tl.load(x_ptr + offs_b[:, None] * D + offs_k[None, :], mask=mask_b[:, None] & mask_k[None, :], other=0.0)
        wt = tl.load(w_ptr + r[:, None] * D + offs_k[None, :], mask=mask_c[:, None] & mask_k[None, :], other=0.0)
        acc = _mma(xt, tl.trans(wt), acc, PREC)
    if NORMALIZED:
        z = acc * col[None, :]
    else:
        z = acc + col[None, :]
    return z


@triton.jit
def _split_range(K, BLOCK_C: tl.constexpr):
    """The class tiles ``[t0, t1)`` of this program's split (axis 1 of the grid)."""
    n_tiles = tl.cdiv(K, BLOCK_C)
    per = tl.cdiv(n_tiles, tl.num_programs(1))
    t0 = tl.program_id(1) * per
    return t0, tl.minimum(t0 + per, n_tiles)


# -- kernels ----------------------------------------------------------------------------------------
@triton.jit
def _inv_norm_kernel(
    w_ptr, rows_ptr, inv_ptr, K, D, eps, HAS_ROWS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr
):
    offs = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    mask = offs < K
    if HAS_ROWS:
        r = tl.load(rows_ptr + offs, mask=mask, other=0).to(tl.int64)
    else:
        r = offs.to(tl.int64)
    ss = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for k0 in range(0, D, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        v = tl.load(w_ptr + r[:, None] * D + offs_k[None, :], mask=mask[:, None] & (offs_k[None, :] < D), other=0.0).to(
            tl.float32
        )
        ss += tl.sum(v * v, 1)
    tl.store(inv_ptr + offs, 1.0 / tl.maximum(tl.sqrt(ss), eps), mask=mask)


@triton.jit
def _lse_kernel(
    x_ptr,
    w_ptr,
    rows_ptr,
    inv_ptr,
    b_ptr,
    tcol_ptr,
    lse_ptr,
    max_ptr,
    sum_ptr,
    N,
    K,
    D,
    scale,
    N_KEY,
    HAS_ROWS: tl.constexpr,
    NORMALIZED: tl.constexpr,
    SUM_LOGITS: tl.constexpr,
    PREC: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    offs_b = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    mask_b = offs_b < N
    tcol = tl.load(tcol_ptr + offs_b, mask=mask_b, other=-1)
    m = tl.full((BLOCK_B,), _NEG_INF, dtype=tl.float32)
    sum_exp = tl.zeros((BLOCK_B,), dtype=tl.float32)
    s = tl.zeros((BLOCK_B,), dtype=tl.float32)
    t0, t1 = _split_range(K, BLOCK_C)
    for t in range(t0, t1):
        offs_c = t * BLOCK_C + tl.arange(0, BLOCK_C)
        r, col, mask_c = _class_tile(rows_ptr, inv_ptr, b_ptr, offs_c, K, scale, HAS_ROWS, NORMALIZED)
        z = _logits(x_ptr, w_ptr, offs_b, mask_b, r, mask_c, col, D, NORMALIZED, PREC, BLOCK_B, BLOCK_C, BLOCK_K)
        keep = mask_c[None, :] & (offs_c[None, :] != tcol[:, None])
        zk = tl.where(keep, z, _NEG_INF)
        m_new = tl.maximum(m, tl.max(zk, 1))
        m_ref = tl.where(m_new == _NEG_INF, 0.0, m_new)  # rows with nothing kept yet stay at sum_exp = 0
        sum_exp = sum_exp * tl.exp(m - m_ref) + tl.sum(tl.exp(zk - m_ref[:, None]), 1)
        m = m_new
        if SUM_LOGITS:
            s += tl.sum(tl.where(keep, z, 0.0), 1)
    out = tl.program_id(1) * N + offs_b
    tl.store(lse_ptr + out, tl.where(sum_exp > 0, m + tl.log(tl.maximum(sum_exp, 1e-30)), _NEG_INF), mask=mask_b)
    tl.store(max_ptr + out, m, mask=mask_b)
    if SUM_LOGITS:
        tl.store(sum_ptr + out, s, mask=mask_b)


@triton.jit
def _grad_x_kernel(
    x_ptr,
    w_ptr,
    rows_ptr,
    inv_ptr,
    b_ptr,
    tcol_ptr,
    lse_ptr,
    part_ptr,
    N,
    K,
    D,
    scale,
    off,
    alpha,
    N_KEY,
    HAS_ROWS: tl.constexpr,
    NORMALIZED: tl.constexpr,
    PREC: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_DO: tl.constexpr,
):
    offs_b = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    mask_b = offs_b < N
    tcol = tl.load(tcol_ptr + offs_b, mask=mask_b, other=-1)
    lse = tl.load(lse_ptr + offs_b, mask=mask_b, other=0.0)
    offs_d = tl.program_id(2) * BLOCK_DO + tl.arange(0, BLOCK_DO)
    mask_d = offs_d < D
    acc = tl.zeros((BLOCK_B, BLOCK_DO), dtype=tl.float32)
    t0, t1 = _split_range(K, BLOCK_C)
    for t in range(t0, t1):
        offs_c = t * BLOCK_C + tl.arange(0, BLOCK_C)
        r, col, mask_c = _class_tile(rows_ptr, inv_ptr, b_ptr, offs_c, K, scale, HAS_ROWS, NORMALIZED)
        z = _logits(x_ptr, w_ptr, offs_b, mask_b, r, mask_c, col, D, NORMALIZED, PREC, BLOCK_B, BLOCK_C, BLOCK_K)
        keep = mask_b[:, None] & mask_c[None, :] & (offs_c[None, :] != tcol[:, None])
        g = tl.where(keep, (tl.exp(z - lse[:, None]) - off) * alpha, 0.0)
        if NORMALIZED:
            g = g * col[None, :]  # dL/d(x·w_j)
        wv = tl.load(w_ptr + r[:, None] * D + offs_d[None, :], mask=mask_c[:, None] & mask_d[None, :], other=0.0)
        acc = _mma(g, wv, acc, PREC)
    out = (tl.program_id(1) * N + offs_b).to(tl.int64)
    tl.store(part_ptr + out[:, None] * D + offs_d[None, :], acc, mask=mask_b[:, None] & mask_d[None, :])


@triton.jit
def _grad_w_kernel(
    x_ptr,
    w_ptr,
    rows_ptr,
    inv_ptr,
    b_ptr,
    tcol_ptr,
    lse_ptr,
    gw_ptr,
    gb_ptr,
    out_rows_ptr,
    N,
    K,
    D,
    scale,
    off,
    alpha,
    N_KEY,
    HAS_ROWS: tl.constexpr,
    OUT_ROWS: tl.constexpr,
    NORMALIZED: tl.constexpr,
    PREC: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_DO: tl.constexpr,
):
    offs_c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    r, col, mask_c = _class_tile(rows_ptr, inv_ptr, b_ptr, offs_c, K, scale, HAS_ROWS, NORMALIZED)
    offs_d = tl.program_id(1) * BLOCK_DO + tl.arange(0, BLOCK_DO)
    mask_d = offs_d < D
    acc = tl.zeros((BLOCK_C, BLOCK_DO), dtype=tl.float32)
    red = tl.zeros((BLOCK_C,), dtype=tl.float32)  # Σ_i G_ij z_ij (normalised) or Σ_i G_ij (bias)
    for b0 in range(0, N, BLOCK_B):
        offs_b = b0 + tl.arange(0, BLOCK_B)
        mask_b = offs_b < N
        tcol = tl.load(tcol_ptr + offs_b, mask=mask_b, other=-1)
        lse = tl.load(lse_ptr + offs_b, mask=mask_b, other=0.0)
        z = _logits(x_ptr, w_ptr, offs_b, mask_b, r, mask_c, col, D, NORMALIZED, PREC, BLOCK_B, BLOCK_C, BLOCK_K)
        keep = mask_b[:, None] & mask_c[None, :] & (offs_c[None, :] != tcol[:, None])
        g = tl.where(keep, (tl.exp(z - lse[:, None]) - off) * alpha, 0.0)
        if NORMALIZED:
            red += tl.sum(g * z, 0)
        else:
            red += tl.sum(g, 0)
        xv = tl.load(x_ptr + offs_b[:, None] * D + offs_d[None, :], mask=mask_b[:, None] & mask_d[None, :], other=0.0)
        acc = _mma(tl.trans(g), xv, acc, PREC)
    if OUT_ROWS:
        dst = tl.load(out_rows_ptr + offs_c, mask=mask_c, other=0).to(tl.int64)
    else:
        dst = offs_c.to(tl.int64)
    mask = mask_c[:, None] & mask_d[None, :]
    if NORMALIZED:
        # dL/dw_j = (s/‖w_j‖)·Σ_i G_ij x_i − (Σ_i G_ij z_ij)/‖w_j‖² · w_j   (the row normalisation's backward)
        inv = col / scale
        wv = tl.load(w_ptr + r[:, None] * D + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
        acc = acc * col[:, None] - (inv * inv * red)[:, None] * wv
    else:
        if tl.program_id(1) == 0:
            tl.store(gb_ptr + dst, red.to(gb_ptr.dtype.element_ty), mask=mask_c)
    tl.store(gw_ptr + dst[:, None] * D + offs_d[None, :], acc.to(gw_ptr.dtype.element_ty), mask=mask)


#: the kernels run under the CPU interpreter (Triton decided so when they were defined, from TRITON_INTERPRET)
INTERPRET = not isinstance(_lse_kernel, triton.runtime.JITFunction)


# -- tile choice ------------------------------------------------------------------------------------
def _config(bb: int, bc: int, bk: int, warps: int, stages: int) -> triton.Config:
    return triton.Config({"BLOCK_B": bb, "BLOCK_C": bc, "BLOCK_K": bk}, num_warps=warps, num_stages=stages)


_LSE_CONFIGS = [
    _config(128, 128, 64, 8, 3),
    _config(128, 64, 64, 4, 4),
    _config(64, 128, 64, 4, 4),
    _config(128, 256, 64, 8, 3),
]
#: gradient kernels: the register accumulator is (BLOCK_B or BLOCK_C) × BLOCK_DO, so wide rows take short tiles
_GRAD_CONFIGS = {
    128: [
        _config(128, 128, 64, 8, 3),
        _config(64, 128, 64, 4, 3),
        _config(128, 64, 64, 4, 3),
        _config(64, 64, 64, 4, 4),
    ],
    256: [_config(128, 64, 64, 8, 3), _config(64, 128, 64, 8, 3), _config(64, 64, 64, 4, 3)],
    512: [_config(64, 32, 64, 8, 2), _config(32, 64, 64, 8, 2), _config(32, 32, 64, 4, 2)],
}
_TUNERS: dict[tuple[str, int], object] = {}
_KEY = ["D", "N_KEY", "PREC", "NORMALIZED"]


def _out_width(D: int, max_width: int) -> tuple[int, int]:
    """(register width of a gradient row tile, number of such chunks covering D)."""
    width = min(triton.next_power_of_2(D), max_width)
    return max(width, 16), triton.cdiv(D, width)


def _launcher(name: str, kernel, out_width: int):
    """The kernel to launch and the fixed tiles to pass: the raw kernel with small tiles under
    the interpreter, else an autotuned wrapper (built once per kernel and row width)."""
    if INTERPRET:
        return kernel, {"BLOCK_B": _SMALL, "BLOCK_C": _SMALL, "BLOCK_K": _SMALL}
    configs = _LSE_CONFIGS if name == "lse" else _GRAD_CONFIGS[min(max(out_width, 128), 512)]
    key = (name, out_width)
    if key not in _TUNERS:
        # configs whose shared memory exceeds this GPU's (the widest ones on an A100) are dropped before tuning
        prune = {"early_config_prune": shared_memory_prune(kernel)}
        _TUNERS[key] = triton.autotune(configs=configs, key=_KEY, prune_configs_by=prune)(kernel)
    return _TUNERS[key], {}


def num_splits(N: int, K: int, device: torch.device) -> int:
    """Class splits of the sample-tiled kernels: enough programs to fill the GPU (four per
    multiprocessor for 64-sample tiles), never more than one per 64 classes."""
    if INTERPRET or device.type != "cuda":
        return max(1, min(2, triton.cdiv(K, _SMALL)))
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(triton.cdiv(4 * sms, triton.cdiv(N, 64)), triton.cdiv(K, 64)))


def _device(t: Tensor):
    return torch.cuda.device(t.device) if t.device.type == "cuda" else contextlib.nullcontext()


# -- launchers --------------------------------------------------------------------------------------
def row_inv_norms(weight: Tensor, rows: Tensor | None, eps: float) -> Tensor:
    """``1 / max(‖w_r‖, eps)`` (fp32) for each active row ``r`` (``rows`` None: every row)."""
    K = weight.shape[0] if rows is None else rows.numel()
    inv = torch.empty(K, device=weight.device, dtype=torch.float32)
    if K == 0:
        return inv
    block = _SMALL if INTERPRET else 64
    with _device(weight):
        _inv_norm_kernel[(triton.cdiv(K, block),)](
            weight,
            weight if rows is None else rows,
            inv,
            K,
            weight.shape[1],
            eps,
            HAS_ROWS=rows is not None,
            BLOCK_R=block,
            BLOCK_K=_SMALL if INTERPRET else 64,  # 128 spilled on an A100 (64 x 128 fp32 and int64 offsets)
        )
    return inv


def _common(
    x: Tensor, weight: Tensor, rows: Tensor | None, inv: Tensor | None, bias: Tensor | None, tcol: Tensor
) -> tuple:
    """Pointer arguments shared by the three softmax kernels (absent ones replaced by a dummy)."""
    return (
        x,
        weight,
        weight if rows is None else rows,
        weight if inv is None else inv,
        weight if bias is None else bias,
        tcol,
    )


def lse_partials(
    x: Tensor,
    weight: Tensor,
    rows: Tensor | None,
    inv: Tensor | None,
    bias: Tensor | None,
    tcol: Tensor,
    scale: float,
    prec: int,
    sum_logits: bool,
    splits: int,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Per split and sample: log-sum-exp, max and (``sum_logits``) sum of the non-target logits,
    each ``splits × N`` fp32 (−inf / −inf / 0 where a split holds nothing for a sample)."""
    N, D = x.shape
    K = weight.shape[0] if rows is None else rows.numel()
    lse = torch.empty(splits, N, device=x.device, dtype=torch.float32)
    mx = torch.empty_like(lse)
    sm = torch.empty_like(lse) if sum_logits else lse
    kernel, tiles = _launcher("lse", _lse_kernel, 0)
    normalized = inv is not None
    with _device(x):
        kernel[lambda meta: (triton.cdiv(N, meta["BLOCK_B"]), splits)](
            *_common(x, weight, rows, inv, bias, tcol),
            lse,
            mx,
            sm,
            N,
            K,
            D,
            float(scale),
            triton.next_power_of_2(N),
            HAS_ROWS=rows is not None,
            NORMALIZED=normalized,
            SUM_LOGITS=sum_logits,
            PREC=prec,
            **tiles,
        )
    return lse, mx, (sm if sum_logits else None)


def grad_embeddings(
    x: Tensor,
    weight: Tensor,
    rows: Tensor | None,
    inv: Tensor | None,
    bias: Tensor | None,
    tcol: Tensor,
    lse: Tensor,
    scale: float,
    off: float,
    alpha: float,
    prec: int,
    splits: int,
    max_width: int = MAX_OUT_WIDTH,
) -> Tensor:
    """``Σ_j G_ij c_j w_j`` over the non-target active columns (``N × D`` fp32)."""
    N, D = x.shape
    K = weight.shape[0] if rows is None else rows.numel()
    width, chunks = _out_width(D, max_width)
    part = torch.empty(splits, N, D, device=x.device, dtype=torch.float32)
    kernel, tiles = _launcher("grad_x", _grad_x_kernel, width)
    with _device(x):
        kernel[lambda meta: (triton.cdiv(N, meta["BLOCK_B"]), splits, chunks)](
            *_common(x, weight, rows, inv, bias, tcol),
            lse,
            part,
            N,
            K,
            D,
            float(scale),
            float(off),
            float(alpha),
            triton.next_power_of_2(N),
            HAS_ROWS=rows is not None,
            NORMALIZED=inv is not None,
            PREC=prec,
            BLOCK_DO=width,
            **tiles,
        )
    return part[0] if splits == 1 else part.sum(0)


def grad_rows(
    x: Tensor,
    weight: Tensor,
    rows: Tensor | None,
    inv: Tensor | None,
    bias: Tensor | None,
    tcol: Tensor,
    lse: Tensor,
    scale: float,
    off: float,
    alpha: float,
    prec: int,
    gw: Tensor,
    gb: Tensor | None,
    out_rows: Tensor | None,
    max_width: int = MAX_OUT_WIDTH,
) -> None:
    """Write each active column's row gradient (non-target entries) into ``gw[out_rows[j]]``
    (``gw[j]`` when ``out_rows`` is None), and its bias gradient into ``gb`` (softmax_ce)."""
    N, D = x.shape
    K = weight.shape[0] if rows is None else rows.numel()
    if K == 0:
        return
    width, chunks = _out_width(D, max_width)
    kernel, tiles = _launcher("grad_w", _grad_w_kernel, width)
    with _device(x):
        kernel[lambda meta: (triton.cdiv(K, meta["BLOCK_C"]), chunks)](
            *_common(x, weight, rows, inv, bias, tcol),
            lse,
            gw,
            gw if gb is None else gb,
            gw if out_rows is None else out_rows,
            N,
            K,
            D,
            float(scale),
            float(off),
            float(alpha),
            triton.next_power_of_2(N),
            HAS_ROWS=rows is not None,
            OUT_ROWS=out_rows is not None,
            NORMALIZED=inv is not None,
            PREC=prec,
            BLOCK_DO=width,
            **tiles,
        )


def kernel_precision(precision: str) -> int:
    """The kernels' ``prec`` code of ``fp32``, ``tf32`` or ``bf16`` (emulated under the interpreter)."""
    code = PRECISIONS[precision]
    return _BF16_EMULATED if INTERPRET and code == PRECISIONS["bf16"] else code


# -- the offline compile tests' list (dmltrain.kernel_compile) --------------------------------------------
#: the stack frame (bytes per thread) each kernel may reach at each precision on sm_80 or sm_90: every config
#: spills at the 255-register cap, the fp32/tf32 products most (ptxas even falls back to 32 registers). The
#: largest frames among the about 550 compiles so far (every config; most with bf16 products, about 100 with
#: fp32 or tf32), rounded up to a KiB; `python -m dmltrain.kernel_compile --all` reports any variant past them.
#: Issue 27 rewrites these kernels without spills; then this table goes.
_STACK_TODAY: dict[tuple[str, str], int] = {
    ("lse", "bf16"): 2_048,  # 1,416 seen
    ("lse", "tf32"): 6_144,  # 6,040
    ("lse", "fp32"): 22_528,  # 22,496
    ("grad_x", "bf16"): 6_144,  # 5,736
    ("grad_x", "tf32"): 3_072,  # 2,488
    ("grad_x", "fp32"): 22_528,  # 21,536
    ("grad_w", "bf16"): 4_096,  # 4,064
    ("grad_w", "tf32"): 3_072,  # 2,032
    ("grad_w", "fp32"): 23_552,  # 23,360
}


def compile_variants() -> list:
    """Every compile the launchers above can ask for on CUDA: each autotune config (and, for the gradient
    kernels, each output width ``BLOCK_DO`` the embedding dimension gives), each precision (bf16 products
    take bf16 embeddings, fp32/tf32 fp32 ones), each weight storage (fp32, bf16), each kind (normalised:
    inverse norms; softmax_ce: bias, with or without label smoothing's sum of logits), with and without
    subsampled rows, and each way the row gradients are written (straight into ``.grad``, through
    ``out_rows`` or not, or chunk by chunk through fp32 scratch). An absent tensor is passed as the
    weight (``_common``), so its pointer type is the weight's. Within a config the defaults come first
    (bf16 products, fp32 weight, the width of D = 128): what the covering compile picks once every value
    is covered. Today's configs all spill: marked ``spills_allowed``, bounded by ``_STACK_TODAY``."""
    from dmltrain.kernel_compile import KernelVariant

    out: list[KernelVariant] = []

    def add(fn, short, prec, cfg: triton.Config | None, sig: dict, cx: dict, flags: str, group=0, tags=()) -> None:
        if cfg is None:
            config, warps, stages = "fixed", 4, 3
        else:
            k = cfg.kwargs
            config = f"{k['BLOCK_B']}x{k['BLOCK_C']}x{k['BLOCK_K']} w{cfg.num_warps} s{cfg.num_stages}"
            config += f" (D<={group})" if group else ""
            warps, stages = cfg.num_warps, cfg.num_stages
        bound = _STACK_TODAY.get((short, prec))
        out.append(
            KernelVariant(
                f"{short} {config} {prec} {flags}",
                fn,
                {**sig, **dict.fromkeys(cx, "constexpr")},
                cx,
                num_warps=warps,
                num_stages=stages,
                spills_allowed=bound is not None,  # issue 27: a rewrite without spills drops this
                max_stack_bytes=bound,
                config=config,
                tags=tags,
            )
        )

    scalars = {"N": "i32", "K": "i32", "D": "i32", "scale": "fp32"}
    for lists, width in ((128, 128), (128, 64), (128, 32), (128, 16), (256, 256), (512, 512)):
        for prec in ("bf16", "tf32", "fp32"):
            xt = "*bf16" if prec == "bf16" else "*fp32"
            for wt in ("*fp32", "*bf16"):
                for has_rows in (True, False):
                    for normalized in (True, False):
                        common = {
                            "x_ptr": xt,
                            "w_ptr": wt,
                            "rows_ptr": "*i64" if has_rows else wt,
                            "inv_ptr": "*fp32" if normalized else wt,
                            "b_ptr": wt,  # the bias (softmax_ce, the weight's dtype) or the weight itself
                            "tcol_ptr": "*i32",
                        }
                        base = {"HAS_ROWS": has_rows, "NORMALIZED": normalized, "PREC": PRECISIONS[prec]}
                        where = f"w={wt[1:]} {'rows' if has_rows else 'all'} {'normalized' if normalized else 'bias'}"
                        if width == 128:  # the forward kernel has no output width: once
                            # label smoothing's sum of logits: softmax_ce only
                            for sum_logits in (False, True) if not normalized else (False,):
                                sig = {**common, "lse_ptr": "*fp32", "max_ptr": "*fp32", "sum_ptr": "*fp32"}
                                sig |= {**scalars, "N_KEY": "i32"}
                                flags = where + (" smoothing" if sum_logits else "")
                                for cfg in _LSE_CONFIGS:
                                    cx = {**base, "SUM_LOGITS": sum_logits, **cfg.kwargs}
                                    add(_lse_kernel, "lse", prec, cfg, sig, cx, flags)
                        grad = {**scalars, "off": "fp32", "alpha": "fp32", "N_KEY": "i32"}
                        for cfg in _GRAD_CONFIGS[lists]:
                            cx = {**base, **cfg.kwargs, "BLOCK_DO": width}
                            sig = {**common, "lse_ptr": "*fp32", "part_ptr": "*fp32", **grad}
                            add(_grad_x_kernel, "grad_x", prec, cfg, sig, cx, f"do{width} {where}", lists)
                            # rows' gradients: into .grad (the weight's dtype; through out_rows when
                            # subsampled), or a chunk at a time into fp32 scratch (no out_rows)
                            writes = [(wt, has_rows, "into .grad")]
                            if wt != "*fp32" or has_rows:
                                writes.append(("*fp32", False, "via scratch"))
                            for gt, out_rows, how in writes:
                                sig = {**common, "lse_ptr": "*fp32", "gw_ptr": gt, "gb_ptr": gt}
                                sig |= {"out_rows_ptr": "*i64" if out_rows else gt, **grad}
                                cxw = {**cx, "OUT_ROWS": out_rows}
                                flags = f"do{width} {where} {how}"
                                add(_grad_w_kernel, "grad_w", prec, cfg, sig, cxw, flags, lists, (how,))
    for wt in ("*fp32", "*bf16"):
        for has_rows in (True, False):
            sig = {"w_ptr": wt, "rows_ptr": "*i64" if has_rows else wt, "inv_ptr": "*fp32", "K": "i32", "D": "i32"}
            cx = {"HAS_ROWS": has_rows, "BLOCK_R": 64, "BLOCK_K": 64}
            add(
                _inv_norm_kernel,
                "inv_norm",
                "fp32",
                None,
                {**sig, "eps": "fp32"},
                cx,
                f"w={wt[1:]} {'rows' if has_rows else 'all'}",
            )
    return out
