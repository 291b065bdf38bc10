"""Triton kernels of the evaluation on the GPU: pair ranks in a score block, and Hamming distances.

* :func:`pair_ranks`: the rank of (query, relevant item) pairs in their rows of a dense score
  block (the rule of :mod:`.ranks`: score, then lower column). One program per query row
  loads up to ``RB`` of its pairs' scores into registers and streams the row once, counting for
  each pair the columns ordered before it; rows with more pairs stream the row once per
  ``RB`` of them. Nothing is sorted and no top-k is taken, so ties straddling a cut-off
  cannot be mishandled; the block is read ``ceil(pairs / RB)`` times, about the traffic of
  the GEMM writing it once.
* :func:`hamming_block`: all-pairs Hamming distances of packed codes (int32 words, stored
  word-major so that a word of ``BM`` codes is one coalesced load), ``BM × BN`` register
  tiles, ``popc`` per XORed word on CUDA (libdevice), a SWAR bit count elsewhere (Triton's
  interpreter cannot call libdevice; the two count the same bits).

Under ``TRITON_INTERPRET=1`` (read when this module is imported) both run on CPU tensors,
which is how the tests check them against brute-force references.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra import libdevice

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
_MAX_RB = 32  # pairs held in registers per pass over a row
_RANK_TILE = 4096  # RB × BN compared per step: 32 per thread at 4 warps, whatever RB is
# the interpreter pays per program and per loop step, not per element: wide tiles there
_BM, _BN = (32, 32) if INTERPRET else (64, 64)


@triton.jit
def _pair_ranks_kernel(
    S, stride_row, n_cols, group_rows, group_starts, cols, out, LARGER: tl.constexpr, RB: tl.constexpr, BN: tl.constexpr
):
    g = tl.program_id(0)
    start = tl.load(group_starts + g)
    end = tl.load(group_starts + g + 1)
    base = S + tl.load(group_rows + g).to(tl.int64) * stride_row
    for p0 in range(start, end, RB):
        offs_p = p0 + tl.arange(0, RB)
        pmask = offs_p < end
        c = tl.load(cols + offs_p, mask=pmask, other=0)
        v = tl.load(base + c, mask=pmask, other=0)
        count = tl.zeros([RB], dtype=tl.int32)
        for n0 in range(0, n_cols, BN):
            offs_n = n0 + tl.arange(0, BN)
            nmask = offs_n < n_cols
            s = tl.load(base + offs_n, mask=nmask, other=0)[None, :]
            if LARGER:
                better = s > v[:, None]
            else:
                better = s < v[:, None]
            # an equal score counts only from a lower column; the pair's own column never counts
            earlier_tie = (s == v[:, None]) & (offs_n[None, :] < c[:, None])
            count += tl.sum(((better | earlier_tie) & nmask[None, :]).to(tl.int32), axis=1)
        tl.store(out + offs_p, (count + 1).to(tl.int64), mask=pmask)


def pair_ranks(block: Tensor, group_rows: Tensor, group_starts: Tensor, cols: Tensor, larger_is_better: bool) -> Tensor:
    """1-based ranks (int64, on the block's device) of the pairs ``cols[group_starts[i]:group_starts[i+1]]``
    in row ``group_rows[i]`` of ``block`` (float32, int32 or int16, unit column stride); the
    index tensors are int32, on the block's device."""
    if block.stride(1) != 1:
        raise ValueError("pair_ranks: the block needs unit column stride")
    n_pairs = len(cols)
    out = torch.empty(n_pairs, dtype=torch.int64, device=block.device)
    if n_pairs == 0:
        return out
    most = int((group_starts[1:] - group_starts[:-1]).max())
    rb = min(_MAX_RB, triton.next_power_of_2(max(most, 2)))
    _pair_ranks_kernel[(len(group_rows),)](
        block,
        block.stride(0),
        block.shape[1],
        group_rows,
        group_starts,
        cols,
        out,
        LARGER=bool(larger_is_better),
        RB=rb,
        BN=_RANK_TILE // rb,
    )
    return out


@triton.jit
def _popcount(x, HW: tl.constexpr):
    """Set bits of each int32: the hardware ``popc``, or the same count by SWAR (logical shifts on uint32)."""
    if HW:
        count = libdevice.popc(x)
    else:
        u = x.to(tl.uint32, bitcast=True)
        u = u - ((u >> 1) & 0x55555555)
        u = (u & 0x33333333) + ((u >> 2) & 0x33333333)
        u = (u + (u >> 4)) & 0x0F0F0F0F
        count = ((u * 0x01010101) >> 24).to(tl.int32)
    return count


@triton.jit
def _hamming_kernel(
    Q, G, out, nq, ng, n_words, stride_qw, stride_gw, stride_o, BM: tl.constexpr, BN: tl.constexpr, HW: tl.constexpr
):
    offs_m = tl.program_id(0) * BM + tl.arange(0, BM)
    offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
    mmask, nmask = offs_m < nq, offs_n < ng
    acc = tl.zeros([BM, BN], dtype=tl.int32)
    for w in range(0, n_words):
        a = tl.load(Q + w * stride_qw + offs_m, mask=mmask, other=0)
        b = tl.load(G + w * stride_gw + offs_n, mask=nmask, other=0)
        acc += _popcount(a[:, None] ^ b[None, :], HW)
    ptrs = out + offs_m[:, None].to(tl.int64) * stride_o + offs_n[None, :]
    tl.store(ptrs, acc, mask=mmask[:, None] & nmask[None, :])


def hamming_block(q_words: Tensor, g_words: Tensor) -> Tensor:
    """``nq × ng`` int32 Hamming distances of codes stored word-major: ``q_words`` is ``W × nq``,
    ``g_words`` is ``W × ng`` (int32, unit stride along the codes)."""
    if q_words.dtype != torch.int32 or g_words.dtype != torch.int32 or q_words.shape[0] != g_words.shape[0]:
        raise ValueError("hamming_block: expected int32 word-major codes of the same width")
    n_words, nq = q_words.shape
    ng = g_words.shape[1]
    out = torch.empty((nq, ng), dtype=torch.int32, device=q_words.device)
    if nq == 0 or ng == 0:
        return out
    grid = (triton.cdiv(nq, _BM), triton.cdiv(ng, _BN))
    _hamming_kernel[grid](
        q_words,
        g_words,
        out,
        nq,
        ng,
        n_words,
        q_words.stride(0),
        g_words.stride(0),
        out.stride(0),
        BM=_BM,
        BN=_BN,
        HW=q_words.device.type == "cuda" and not INTERPRET,
    )
    return out


def compile_variants() -> list:
    """Every compile the launchers above can ask for on CUDA (``dmltrain.kernel_compile``): the rank
    kernel for each block dtype (float32, int32, int16), direction and pair tile ``RB`` (2-32, with its
    ``BN``); the Hamming kernel with the hardware ``popc``, which its PTX must show. Neither may spill."""
    from dmltrain.kernel_compile import KernelVariant

    out = []
    rb = 2
    while rb <= _MAX_RB:
        for dtype in ("fp32", "i32", "i16"):
            for larger in (True, False):
                ints = dict.fromkeys(("group_rows", "group_starts", "cols"), "*i32")
                sig = {"S": f"*{dtype}", "stride_row": "i32", "n_cols": "i32", **ints, "out": "*i64"}
                cx = {"LARGER": larger, "RB": rb, "BN": _RANK_TILE // rb}
                name = f"pair_ranks RB={rb} {dtype} {'larger' if larger else 'smaller'} is better"
                out.append(
                    KernelVariant(
                        name, _pair_ranks_kernel, {**sig, **dict.fromkeys(cx, "constexpr")}, cx, config=f"RB={rb}"
                    )
                )
        rb *= 2
    sig = {"Q": "*i32", "G": "*i32", "out": "*i32", **dict.fromkeys(("nq", "ng", "n_words"), "i32")}
    sig |= dict.fromkeys(("stride_qw", "stride_gw", "stride_o"), "i32")
    cx = {"BM": 64, "BN": 64, "HW": True}
    sig |= dict.fromkeys(cx, "constexpr")
    out.append(KernelVariant("hamming 64x64 popc", _hamming_kernel, sig, cx, config="64x64", ptx_has=("popc.b32",)))
    return out
