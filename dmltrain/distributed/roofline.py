"""A roofline model of the sharded classifier's fused step: what each launch computes and moves, on paper.

:func:`plan` lists the launches one shard's forward and backward make
(:func:`~dmltrain.distributed.softmax_kernels.partials` and
:func:`~dmltrain.distributed.softmax_kernels.gradients`), chunk by chunk, with the grid and tiles the
launcher chooses: its own candidate lists, chunking constants and split count
(:func:`~dmltrain.distributed.softmax_kernels.num_splits`) are read from it, not copied. Where the
launcher times candidates on the GPU (the tuner), the model takes the candidate its own estimate says is
fastest, once per tuning key, as the tuner keeps one choice per key; ``deterministic`` takes the first
candidate, as the launcher does. For each launch it counts the tensor-core FLOPs, the exponentials, the
bytes to and from HBM, the bytes the SMs load from and store to L2, and the bytes of fp32 atomics;
:func:`cost` turns them into the time each bound implies on a :class:`GPU`.

Assumptions (what the printed figures rest on):

* Every level at its peak rate (:data:`GPUS` states each figure and its source): the time of a launch is
  the largest of its bounds (compute, exponentials, HBM, L2 with the atomics) plus :data:`LAUNCH_GAP_S`;
  launches run one after another (one stream), so the step is their sum. What a kernel loses to latency,
  pipeline bubbles and instruction issue is not modelled: for today's launches the estimate is a floor.
* HBM: each operand of a launch is read once (the programs running at once share the class tiles and the
  batch through L2: the batch, at most ``B·D`` bf16, stays there); each output is written once (the
  backward has no atomics and no gradient scratch). L2: every tile load and store of the programs, the re-reads included
  (the batch re-streamed for every class tile).
* Atomics: Triton's ``tl.atomic_add`` of fp32 tiles, resolved in the L2 slices, at the GPU's assumed atomic
  rate, on top of the L2 loads (the same slices serve both).
* Waves: a product kernel's programs fill ``SMs × CTAs per SM`` slots, each slot running at its share of
  the SM's peak; a launch takes ``⌈programs / slots⌉`` rounds of its longest program. CTAs per SM are the
  compiled binaries' (:data:`COMPILED`, registers and shared memory of an offline compile) through
  :func:`~dmltrain.kernel_occupancy.occupancy`, the function the launcher sizes its class splits with from the
  binary it launches; one CTA per SM where no compile is recorded, as the launcher where Triton does not tell.
* Not counted: the classifier's torch work on ``O(B·D)`` data around the two calls (targets, the combine,
  the target pairs' autograd), the non-exponential elementwise work of the softmax (assumed hidden under
  the products), the optimizer's row update (the targets are forward + backward).

The 3-GEMM bound is the bench's (:func:`gemm_bound`: three bf16 GEMMs over 1 GiB blocks of logits, each at
the larger of its compute and its bytes). Cut Cross-Entropy (Wijmans et al., "Cut Your Losses in
Large-Vocabulary Language Models", 2024; :func:`cce_plan`) is modelled as released: a forward kernel whose
blocks merge their log-sum-exp under a lock, no logits in memory, and one backward kernel recomputing each
logit block and adding both gradients (bf16) under locks, at its default tiles, exact or with its gradient
filter at best (every block without a target skipped).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from dmltrain.kernel_occupancy import SMLimits, occupancy
from dmltrain.kernel_tuning import LaunchConfig

#: a launch's fixed cost on the GPU beyond its bounds (the gap between back-to-back kernels of one stream)
LAUNCH_GAP_S = 2e-6
#: cuBLAS's bf16 GEMMs at this share of the tensor peak: issue 37's 3-GEMM time measured on an H100 at (10⁶, 512,
#: B = 1,024), 4.5 ms, against the same three GEMMs' bound on paper (:func:`gemm_bound`), 3.23 ms
CUBLAS_SHARE = 0.72
#: cuBLAS's output tile on Hopper and Ampere for these shapes, assumed for its L2 loads (each operand tile re-read
#: once per output tile along the other side)
CUBLAS_TILE = (128, 256)
#: small torch launches per chunk on O(B) data (the chunk's target columns, the forward's reductions of the
#: per-split partials), counted at LAUNCH_GAP_S each; read off softmax_kernels.partials / gradients
_GLUE_FORWARD, _GLUE_BACKWARD = 16, 6


@dataclass(frozen=True)
class GPU:
    """One GPU's peak rates and sizes (bytes, per second); ``notes`` say where each figure comes from."""

    name: str
    arch: int  # compute capability × 10
    sms: int
    clock_hz: float
    tensor_flops: dict[str, float]  # dense, by product precision
    hbm_bytes_s: float
    l2_bytes: int
    l2_bytes_s: float
    atomic_bytes_s: float
    exp_per_s: float
    smem_per_sm: int
    notes: tuple[str, ...]
    regs_per_sm: int = 65536
    max_threads_per_sm: int = 2048
    max_ctas_per_sm: int = 32

    @property
    def sm(self) -> SMLimits:
        """One SM's limits, for :func:`~dmltrain.kernel_occupancy.ctas_per_sm`."""
        return SMLimits(self.smem_per_sm, self.regs_per_sm, self.max_threads_per_sm, self.max_ctas_per_sm)


def _gpu(
    name: str,
    arch: int,
    sms: int,
    clock: float,
    bf16: float,
    tf32: float,
    fp32: float,
    hbm: float,
    l2: int,
    smem: int,
    *notes: str,
) -> GPU:
    l2_rate = 5120 * clock  # bytes per clock: the A100 whitepaper's L2 read bandwidth, assumed for Hopper too
    return GPU(
        name,
        arch,
        sms,
        clock,
        {"bf16": bf16, "tf32": tf32, "fp32": fp32},
        hbm,
        l2,
        l2_rate,
        l2_rate / 2,
        16 * sms * clock,
        smem,
        (*notes, *_COMMON),
    )


_COMMON = (
    "L2 bandwidth assumed 5,120 B per clock (the A100 whitepaper's L2 read figure; none is published for Hopper)",
    "fp32 atomics assumed at half the L2 bandwidth (a reduction reads and writes its sector in the L2 slice): "
    "not measured",
    "exponentials at 16 per SM per clock (the SFU rate; FlashAttention-3 quotes 3.9 TFLOP/s for the H100 SXM5)",
)
#: the GPUs of ``bench classifier --model``: datasheet peaks (dense, no sparsity)
GPUS: dict[str, GPU] = {
    "h100": _gpu(
        "H100 SXM5 80GB",
        90,
        132,
        1.83e9,
        989.4e12,
        494.7e12,
        66.9e12,
        3.35e12,
        50 * 2**20,
        228 * 1024,
        "NVIDIA H100 datasheet (SXM5): 989 TFLOP/s bf16, 495 tf32, 67 fp32 (CUDA cores), 3.35 TB/s HBM3",
        "50 MB L2, 132 SMs at 1.83 GHz (the bf16 figure's clock: 4,096 FLOP per SM per clock), "
        "228 KiB shared memory per SM",
    ),
    "h200": _gpu(
        "H200 SXM 141GB",
        90,
        132,
        1.83e9,
        989.4e12,
        494.7e12,
        66.9e12,
        4.8e12,
        50 * 2**20,
        228 * 1024,
        "NVIDIA H200 datasheet: 4.8 TB/s HBM3e; the H100 SXM's compute (989 TFLOP/s bf16), L2 and SMs",
    ),
    "a100": _gpu(
        "A100 SXM4 80GB",
        80,
        108,
        1.41e9,
        312e12,
        156e12,
        19.5e12,
        2.039e12,
        40 * 2**20,
        164 * 1024,
        "NVIDIA A100 datasheet (SXM4 80GB): 312 TFLOP/s bf16, 156 tf32, 19.5 fp32, 2,039 GB/s HBM2e",
        "40 MB L2, 108 SMs at 1.41 GHz, 164 KiB shared memory per SM",
    ),
}

#: (registers per thread, shared bytes per CTA) of the product kernels' binaries by (kernel, tiles, compute
#: capability, D), for the normalised kinds with bf16 products (the backward's with an fp32 weight, every row, no
#: bias, not accumulating), as ``python -m dmltrain.kernel_compile --all --kernel '<variant name>'`` reports them;
#: D None: any width. The log-sum-exp kernel's were recorded at commit 9a83ee9 at D = 512 (128 and 256 gave the
#: same CTAs per SM); the atomic-free backward's at its first commit ac028d6+ (Triton 3.8), where the accumulator
#: held across the loop makes the width decide the registers and shared memory. Absent: one CTA per SM (the launcher's
#: fallback where Triton does not tell), marked in the table.
COMPILED: dict[tuple[str, str, int, int | None], tuple[int, int]] = {
    ("_lse_kernel", "128×128×16 w8 s3", 90, None): (128, 24576),
    ("_lse_kernel", "128×64×32 w8 s3", 90, None): (76, 36864),
    ("_lse_kernel", "128×128×16 w8 s3", 80, None): (158, 16384),
    ("_lse_kernel", "128×64×32 w8 s3", 80, None): (128, 24576),
    ("_grad_x_kernel", "64×32×32 w8 s2", 90, 128): (96, 32768),
    ("_grad_x_kernel", "64×32×32 w8 s2", 90, 256): (128, 65536),
    ("_grad_x_kernel", "64×32×32 w8 s2", 90, 512): (216, 131072),
    ("_grad_x_kernel", "64×32×32 w8 s2", 80, 128): (99, 16384),
    ("_grad_x_kernel", "64×32×32 w8 s2", 80, 256): (128, 20480),
    ("_grad_x_kernel", "64×32×32 w8 s2", 80, 512): (253, 36864),
    ("_grad_w_kernel", "32×64×32 w8 s2", 90, 128): (102, 32768),
    ("_grad_w_kernel", "32×64×32 w8 s2", 90, 256): (125, 65536),
    ("_grad_w_kernel", "32×64×32 w8 s2", 90, 512): (219, 65536),
    ("_grad_w_kernel", "32×64×32 w8 s2", 80, 128): (118, 32768),
    ("_grad_w_kernel", "32×64×32 w8 s2", 80, 256): (160, 20480),
    ("_grad_w_kernel", "32×64×32 w8 s2", 80, 512): (230, 36864),
    # the staged backward's (Triton 3.8), the probabilities' recorded at D = 512: storing G costs the registers the
    # log-sum-exp kernel's running statistics do not
    ("_probs_kernel", "128×128×16 w8 s3", 90, None): (209, 32768),
    ("_probs_kernel", "128×128×16 w8 s3", 80, None): (220, 32768),
    ("_lse_kernel", "128×64×16 x-resident w8 s3", 90, 128): (123, 81920),
    ("_lse_kernel", "128×64×16 x-resident w8 s3", 90, 256): (128, 163840),
    ("_lse_kernel", "128×64×16 x-resident w8 s3", 80, 128): (145, 66560),
    ("_lse_kernel", "128×64×16 x-resident w8 s3", 80, 256): (118, 132096),
    ("_stage_rows_kernel", "32×64 w8 s2", 90, 128): (110, 32768),
    ("_stage_rows_kernel", "32×64 w8 s2", 90, 256): (116, 65536),
    ("_stage_rows_kernel", "32×64 w8 s2", 90, 512): (217, 73728),
    ("_stage_rows_kernel", "32×64 w8 s2", 80, 128): (106, 16384),
    ("_stage_rows_kernel", "32×64 w8 s2", 80, 256): (164, 20480),
    ("_stage_rows_kernel", "32×64 w8 s2", 80, 512): (245, 36864),
}

#: issue 37's step targets on an H100 by (classes, D, batch): 2× the bf16 3-GEMM bound measured there or Cut
#: Cross-Entropy's time, whichever is less (4.5 / 38 / 95 ms and 25 / 71 / 248 ms)
TARGETS: dict[tuple[int, int, int], float] = {
    (10**6, 512, 1024): 9e-3,
    (10**6, 512, 8192): 71e-3,
    (10**7, 128, 4096): 190e-3,
}
ISSUE_SHAPES = tuple(TARGETS)


def recorded(kernel: str, tiles: str, arch: int, call: Call) -> tuple[int, int] | None:
    """(registers a thread, shared bytes a CTA) of ``kernel``'s binary at ``tiles`` (``softmax_kernels._tiles``) on
    ``sm_{arch}`` for ``call``, as :data:`COMPILED` records it: bf16 products, normalised kinds; None otherwise."""
    if call.precision != "bf16" or not call.normalized:
        return None
    return COMPILED.get((kernel, tiles, arch, call.dim), COMPILED.get((kernel, tiles, arch, None)))


# -- the call -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Call:
    """One step of ``bench classifier``'s classifier as the largest shard (rank 0) sees it."""

    classes: int
    dim: int
    batch: int  # the global batch: the gathered N
    workers: int = 1
    sample_ratio: float = 1.0
    precision: str = "bf16"
    deterministic: bool = False
    kind: str = "normsoftmax"
    smoothing: float = 0.0
    weight_storage: str = "fp32"

    @property
    def normalized(self) -> bool:
        return self.kind != "softmax_ce"

    @property
    def sum_logits(self) -> bool:
        return bool(self.smoothing)

    def active(self) -> tuple[int, int, bool, bool]:
        """(columns the shard passes: its rows or the draw's capacity, columns expected to take part, an
        active-row list?, a device count?), as :func:`~dmltrain.distributed.class_sampling.draw_active` sizes them."""
        # imported here: the GPU table stays importable without torch (``bench --help``)
        from dmltrain.distributed.class_partition import ClassPartition
        from dmltrain.distributed.class_sampling import capacity, round_total

        part = ClassPartition(self.classes, self.workers)
        n = part.size(0)
        total = round_total(self.classes, self.sample_ratio)
        if total >= self.classes:
            return n, n, False, False
        cap, exact = capacity(part, 0, self.batch, self.sample_ratio)
        if exact:
            return cap, cap, True, False
        drawn = max(total, min(self.batch, self.classes)) * n / self.classes
        return cap, min(cap, round(drawn)), True, True


# -- launches -------------------------------------------------------------------------------------------
@dataclass
class Launch:
    """One kernel launch (or torch op) with what it computes and moves (bytes; ``exps``: exponentials and logs).

    Product kernels: ``programs`` with work, the tile units of the longest (``work_max``) and of all
    (``work_total``), for the waves; memory-bound launches leave them 0. ``launches``: how many launches the entry
    stands for (the small torch ops lumped together)."""

    phase: str
    kernel: str
    grid: tuple[int, ...] = ()
    cfg: Any = None  # LaunchConfig
    flops: float = 0.0
    exps: float = 0.0
    hbm: float = 0.0
    l2: float = 0.0
    atomic: float = 0.0
    programs: int = 0  # programs with work
    work_max: int = 0
    work_total: int = 0
    chunk: int = 0
    launches: int = 1
    occupancy: int = 0  # CTAs per SM: the launcher's split count and the waves
    occupancy_compiled: bool = False
    rate: float = 1.0  # the share of the tensor peak its products run at (cuBLAS's measured, Triton's at the peak)
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def triton(self) -> bool:
        return self.cfg is not None


@dataclass(frozen=True)
class Cost:
    """The time each bound of one launch implies on a GPU, seconds, and the launch's time."""

    compute: float
    exp: float
    hbm: float
    l2: float  # L2 loads and stores plus atomics
    wave_eff: float  # the share of the slots the grid keeps busy, at the launch's occupancy
    time: float  # the largest bound (every bound overlapped) and the launch gap
    serial: float  # compute, exponentials and memory one after another (the memory levels still overlapped)


def _wave_eff(programs: int, work_max: int, work_total: int, slots: int) -> float:
    if not programs or not work_total:
        return 1.0
    return work_total / (math.ceil(programs / slots) * slots * work_max)


def cost(launch: Launch, gpu: GPU, precision: str = "bf16") -> Cost:
    """The bounds' times of ``launch`` on ``gpu`` (products at ``precision``'s peak)."""
    eff = _wave_eff(launch.programs, launch.work_max, launch.work_total, gpu.sms * max(1, launch.occupancy))
    compute = launch.flops / (gpu.tensor_flops[precision] * launch.rate) / eff
    exp = launch.exps / gpu.exp_per_s / eff
    hbm = launch.hbm / gpu.hbm_bytes_s
    l2 = launch.l2 / gpu.l2_bytes_s + launch.atomic / gpu.atomic_bytes_s
    gap = launch.launches * LAUNCH_GAP_S
    return Cost(compute, exp, hbm, l2, eff, max(compute, exp, hbm, l2) + gap, compute + exp + max(hbm, l2) + gap)


class _Geometry:
    """Where the launcher's choices come from: a GPU (tuned or first candidates, its SMs) or, with ``gpu`` None,
    Triton's CPU interpreter (the launcher's fixed 16-wide tiles, two programs at once)."""

    def __init__(self, gpu: GPU | None, call: Call) -> None:
        from dmltrain.distributed import softmax_kernels as sk

        self.sk, self.gpu, self.call = sk, gpu, call
        self.quantum = sk._SMALL if gpu is None else 128
        small = {"BLOCK_R": sk._SMALL, "BLOCK_D": sk._SMALL}
        self.copy_meta = small if gpu is None else sk._COPY.kwargs()
        self._chosen: dict[tuple, Any] = {}

    def programs(self, kernel: str, cfg) -> int:
        """``softmax_kernels._programs``: the programs that run at once, SMs × :meth:`occupancy` (two under the
        interpreter); the tests hand the launcher the recorded binaries and compare."""
        if self.gpu is None:
            return 2
        return self.gpu.sms * self.occupancy(kernel, cfg)[0]

    def occupancy(self, kernel: str, cfg) -> tuple[int, bool]:
        """(CTAs per SM of ``kernel`` at ``cfg``, from a recorded compile?): the launcher's function of the binary's
        registers and shared memory, one CTA per SM where none is recorded."""
        if self.gpu is None:
            return 1, False
        used = recorded(kernel, self.sk._tiles(cfg), self.gpu.arch, self.call)
        return occupancy(self.gpu.sm, used, cfg.num_warps), used is not None

    def choose(self, kind: str, key: tuple, trial: Callable[[Any], Launch]):
        """``softmax_kernels._choose``: the interpreter's tiles, the first candidate when deterministic or when it is
        the only one, else the candidate of least modelled time, kept per tuning key as the tuner keeps its choice."""
        sk, call = self.sk, self.call
        if self.gpu is None:
            return sk._interpreter_config(kind, call.dim)
        sum_logits = call.sum_logits and kind == "lse"
        candidates = sk._candidates(kind, call.precision, sum_logits, call.dim)
        if call.deterministic or len(candidates) == 1:
            return candidates[0]
        k = (kind, *key, sum_logits)
        if k not in self._chosen:
            self._chosen[k] = min(candidates, key=lambda c: cost(trial(c), self.gpu, call.precision).time)
        return self._chosen[k]

    def chunks(self, K: int, elt: int) -> list[tuple[int, int]]:
        """``softmax_kernels._chunks``: column ranges within ``CHUNK_BYTES``."""
        D, q = self.call.dim, self.quantum
        step = max(q, (self.sk.CHUNK_BYTES // (D * (elt + 4))) // q * q)
        return [(c0, min(K, c0 + step)) for c0 in range(0, K, step)]


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _pad(n: int, block: int) -> int:
    return math.ceil(n / block) * block


def plan(call: Call, gpu: GPU | None, staged: bool | None = None) -> list[Launch]:
    """The launches of one forward and one backward of ``call`` on ``gpu`` (None: under Triton's CPU interpreter,
    where the launcher takes fixed 16-wide tiles; the tests compare that list with the launches it makes).
    ``staged``: the backward the launcher picks (None, :func:`~dmltrain.distributed.softmax_kernels.staged_backward`),
    or the staged one (True, bf16 only) or the fused atomic-free pair (False) in its place, for comparison."""
    if staged is None:
        from dmltrain.distributed.softmax_kernels import staged_backward

        staged = staged_backward(call.precision, call.dim, call.deterministic)
    geo = _Geometry(gpu, call)
    N, D = call.batch, call.dim
    e = 2 if call.precision == "bf16" else 4  # operand bytes
    ws = 2 if call.weight_storage == "bf16" else 4
    K, valid, has_rows, has_count = call.active()
    keep = geo.sk.keeps_copies(K, D, e)
    out: list[Launch] = []
    for phase in ("forward", "backward"):
        # the small torch ops: the batch cast to the product dtype, the embeddings' gradient zeroed, per chunk
        # its target columns and (forward) the reductions of the per-split partials
        small = Launch(phase, "torch: small ops", launches=0)
        if e != 4:
            small.hbm += N * D * (4 + e)
            small.launches += 1
        if phase == "backward":
            small.hbm += 4 * N * D
            small.launches += 1
        out.append(small)
        for i, (c0, c1) in enumerate(geo.chunks(K, e)):
            Kc = c1 - c0
            nv = max(0, min(Kc, valid - c0)) if has_count else Kc
            key = (D, _pow2(N), _pow2(max(Kc, 1)), call.precision, call.normalized, has_count)
            if phase == "forward" or not keep:  # the backward reuses the forward's copies when they are kept
                out.append(_copy(phase, i, geo, Kc, nv, e, ws, has_rows, has_count))
            if phase == "forward":
                cfg = geo.choose("lse", key, lambda c, Kc=Kc, nv=nv, i=i: _lse(geo, i, c, N, Kc, nv, e))
                launch = _lse(geo, i, cfg, N, Kc, nv, e)
                out.append(launch)
                small.hbm += 4 * N * (3 * launch.grid[1] + 8)
                small.launches += _GLUE_FORWARD
                continue
            small.hbm += 32 * N
            small.launches += _GLUE_BACKWARD
            if staged:
                out += _staged(geo, i, geo.choose("probs", key, None), geo.choose("stage_rows", key, None), N, Kc, nv, e,
                               ws, has_rows)  # fmt: skip
                continue
            # atomic-free: no scratch to zero, the rows' gradients written by _grad_w_kernel (one candidate each)
            launch = _grad_x(geo, i, geo.choose("grad_x", key, None), N, Kc, nv, e)
            S = launch.grid[1]
            out.append(launch)
            # partials.sum(0) reads them once and writes a sum, which grad_x += reads with grad_x and writes back;
            # a single partial is added as it is
            sums = (12 * N * D, 1) if S == 1 else (4 * S * N * D + 16 * N * D, 2)
            out.append(Launch(phase, "torch: grad_x += partials.sum(0)", hbm=sums[0], chunk=i, launches=sums[1]))
            out.append(_grad_w(geo, i, geo.choose("grad_w", key, None), N, Kc, nv, e, ws, has_rows))
    for x in out:
        if not x.triton and not x.l2:  # a torch op's global accesses are its HBM traffic (cuBLAS's tiles say their own)
            x.l2 = x.hbm
    return out


def _product(geo: _Geometry, launch: Launch) -> Launch:
    launch.occupancy, launch.occupancy_compiled = geo.occupancy(launch.kernel, launch.cfg)
    return launch


def _copy(phase: str, i: int, geo: _Geometry, K: int, nv: int, e: int, ws: int, rows: bool, count: bool) -> Launch:
    """``_copy_rows_kernel``: the chunk's rows in the product dtype (normalised, with ``1/‖w‖``) or with biases."""
    D, meta = geo.call.dim, geo.copy_meta
    read = nv * D * ws + (8 * nv if rows else 0) + (8 if count else 0)
    side = 4 * nv if geo.call.normalized else nv * (ws + 4)  # 1/‖w‖ written, or the bias read and written
    hbm = read + K * D * e + side  # the rows past a draw's count written as zeros
    again = nv * D * ws if geo.call.normalized else 0  # the norm pass, then the copy pass: again from L2
    cfg = LaunchConfig.of(1, 1, **meta) if geo.gpu is None else geo.sk._COPY
    return Launch(phase, "_copy_rows_kernel", (math.ceil(K / meta["BLOCK_R"]),), cfg, hbm=hbm, l2=hbm + again, chunk=i)


def _lse(geo: _Geometry, i: int, cfg, N: int, K: int, nv: int, e: int) -> Launch:
    """``_lse_kernel``: grid (sample tiles × class splits), each program an online log-sum-exp over its split."""
    sk, D = geo.sk, geo.call.dim
    BB, BC, BK = cfg["BLOCK_B"], cfg["BLOCK_C"], cfg["BLOCK_K"]
    TB = math.ceil(N / BB)
    S = sk.num_splits(TB, math.ceil(K / BC), geo.programs("_lse_kernel", cfg))
    n_tiles = math.ceil(nv / BC)
    per = math.ceil(n_tiles / S)
    busy = sum(1 for s in range(S) if s * per < n_tiles)
    flops = TB * n_tiles * 2 * BB * BC * _pad(D, BK)
    exps = TB * n_tiles * (BB * BC + BB) + TB * S * BB  # the tile's, the rescale's, the final log
    # x per class tile (resident: once a program, idle ones too), w per sample tile
    x_l2 = S * N * D * e if dict(cfg.meta).get("X_RESIDENT") else n_tiles * N * D * e
    l2 = x_l2 + TB * nv * D * e + S * N * 4 + 3 * S * N * 4
    hbm = N * D * e + nv * D * e + S * N * 4 + 3 * S * N * 4
    launch = Launch(
        "forward",
        "_lse_kernel",
        (TB, S),
        cfg,
        flops,
        exps,
        hbm,
        l2,
        programs=TB * busy,
        work_max=per,
        work_total=TB * n_tiles,
        chunk=i,
    )
    launch.extra["x_l2"] = x_l2
    return _product(geo, launch)


def _grad_x(geo: _Geometry, i: int, cfg, N: int, K: int, nv: int, e: int) -> Launch:
    """``_grad_x_kernel`` (atomic-free): grid (sample tiles × class splits), each program summing its split's
    ``G·ŵ`` in a ``BLOCK_B × D`` accumulator on chip and writing its fp32 partial once."""
    sk, D = geo.sk, geo.call.dim
    BB, BC, BK = cfg["BLOCK_B"], cfg["BLOCK_C"], cfg["BLOCK_K"]
    TB, CT, n_tiles = math.ceil(N / BB), math.ceil(K / BC), math.ceil(nv / BC)
    S = sk.num_splits(TB, CT, geo.programs("_grad_x_kernel", cfg), max(1, sk.PARTIAL_BYTES // (4 * N * D)))
    per = math.ceil(n_tiles / S)
    counts = [max(0, min(per, n_tiles - s * per)) for s in range(S)]
    busy = sum(1 for c in counts if c)
    flops = TB * n_tiles * 2 * BB * BC * (_pad(D, BK) + _pow2(D))
    # x per class tile; ŵ per sample tile twice (logits, product); every program writes its partial once
    l2 = n_tiles * N * D * e + 2 * TB * nv * D * e + n_tiles * N * 8 + S * N * D * 4
    hbm = N * D * e + nv * D * e + 8 * N + S * N * D * 4
    launch = Launch(
        "backward",
        "_grad_x_kernel",
        (TB, S),
        cfg,
        flops,
        TB * n_tiles * BB * BC,
        hbm,
        l2,
        programs=TB * busy,
        work_max=per,
        work_total=TB * n_tiles,
        chunk=i,
    )
    launch.extra["x_l2"] = n_tiles * N * D * e
    return _product(geo, launch)


def _epilogue_bytes(call: Call, v: int, ws: int, rows: bool) -> int:
    """What a rows' kernel's epilogue moves for ``v`` valid rows (weight stored in ``ws`` bytes): the row ids; then
    ``1/‖w‖``, the weight read and its gradient written, or (``softmax_ce``) the weight's and the bias's gradients."""
    ids = 8 * v if rows else 0
    if call.normalized:
        return ids + 4 * v + v * call.dim * 2 * ws
    return ids + v * call.dim * ws + v * ws


def _grad_w(geo: _Geometry, i: int, cfg, N: int, K: int, nv: int, e: int, ws: int, rows: bool) -> Launch:
    """``_grad_w_kernel`` (atomic-free): grid (class tiles), each program summing its rows' ``Gᵀx`` over every
    sample tile in a ``BLOCK_C × D`` accumulator on chip, then writing the rows' gradients into ``.grad`` through
    the normalisation's backward."""
    D = geo.call.dim
    BB, BC, BK = cfg["BLOCK_B"], cfg["BLOCK_C"], cfg["BLOCK_K"]
    TB, CT, n_tiles = math.ceil(N / BB), math.ceil(K / BC), math.ceil(nv / BC)
    tiles = TB * n_tiles
    flops = tiles * 2 * BB * BC * (_pad(D, BK) + _pow2(D))
    epilogue = _epilogue_bytes(geo.call, nv, ws, rows)
    l2 = 2 * n_tiles * N * D * e + TB * nv * D * e + n_tiles * N * 8 + epilogue
    hbm = N * D * e + nv * D * e + 8 * N + epilogue
    launch = Launch(
        "backward",
        "_grad_w_kernel",
        (CT,),
        cfg,
        flops,
        tiles * BB * BC,
        hbm,
        l2,
        programs=n_tiles,
        work_max=TB,
        work_total=tiles,
        chunk=i,
    )
    launch.extra["x_l2"] = 2 * n_tiles * N * D * e
    return _product(geo, launch)


def _staged(
    geo: _Geometry, i: int, cfg, rows_cfg, N: int, K: int, nv: int, e: int, ws: int, rows: bool
) -> list[Launch]:
    """The staged backward of one chunk (``softmax_kernels._GradCall.staged``), stage by stage: ``_probs_kernel``
    writing ``G`` and its column sums, cuBLAS's ``grad_x += G·Ŵ``, ``_stage_rows_kernel`` summing ``Gᵀx`` and writing
    the rows' gradients. ``G`` is written to HBM; its readers take it from L2 while a stage's ``G`` fits half of it,
    from HBM past that."""
    sk, D = geo.sk, geo.call.dim
    step = min(K, sk.stage_columns(N, geo.gpu is None))
    BB, BC, BK = cfg["BLOCK_B"], cfg["BLOCK_C"], cfg["BLOCK_K"]
    TB = math.ceil(N / BB)
    out = []
    for s0 in range(0, K, step):
        k, v = min(step, K - s0), max(0, min(step, nv - s0))
        CT = math.ceil(k / BC)
        g_bytes, red_bytes = N * k * e, TB * k * 4
        resident = geo.gpu is None or g_bytes <= geo.gpu.l2_bytes / 2
        # every program computes its whole tile (masked loads give zeros); x and the valid rows are loaded per tile
        flops = TB * CT * 2 * BB * BC * _pad(D, BK)
        l2 = CT * N * (D * e + 8) + TB * v * D * e + g_bytes + red_bytes
        probs = Launch(
            "backward", "_probs_kernel", (TB, CT), cfg, flops, TB * CT * BB * BC,
            N * D * e + v * D * e + 8 * N + g_bytes + red_bytes, l2,
            programs=TB * CT, work_max=1, work_total=TB * CT, chunk=i,
        )  # fmt: skip
        probs.extra["x_l2"] = CT * N * D * e
        probs.extra["columns"] = k
        probs.extra["resident"] = float(resident)
        out.append(_product(geo, probs))
        g_hbm = 0 if resident else g_bytes
        tm, tn = CUBLAS_TILE[0], min(CUBLAS_TILE[1], D)  # a narrow D: the tile as wide as D
        tiles_x = math.ceil(N / tm) * math.ceil(D / tn)
        out.append(
            Launch(
                "backward",
                "cuBLAS: grad_x += G·Ŵ",
                flops=2 * N * k * D,
                hbm=g_hbm + k * D * e + 8 * N * D,
                l2=tiles_x * (tm + tn) * k * e + 8 * N * D,
                chunk=i,
                rate=CUBLAS_SHARE,
            )  # fmt: skip
        )
        out.append(_stage_rows(geo, i, rows_cfg, N, k, v, e, ws, rows, TB, resident))
    return out


def _stage_rows(geo: _Geometry, i: int, cfg, N: int, k: int, v: int, e: int, ws: int, rows: bool, parts: int,
                resident: bool) -> Launch:  # fmt: skip
    """``_stage_rows_kernel``: grid (the stage's class tiles), each program with valid columns summing ``Gᵀx`` over
    every sample tile (the batch re-read per class tile) and writing its rows' gradients; every program adds its
    columns' ``parts`` column-sum partials."""
    D = geo.call.dim
    BB, BC = cfg["BLOCK_B"], cfg["BLOCK_C"]
    TB, CT, n_tiles = math.ceil(N / BB), math.ceil(k / BC), math.ceil(v / BC)
    epilogue = _epilogue_bytes(geo.call, v, ws, rows)
    g_read, red = N * v * e, parts * v * 4
    launch = Launch(
        "backward", "_stage_rows_kernel", (CT,), cfg, n_tiles * TB * 2 * BB * BC * _pow2(D), 0,
        N * D * e + (0 if resident else g_read) + red + epilogue, n_tiles * N * D * e + g_read + red + epilogue,
        programs=n_tiles, work_max=TB, work_total=n_tiles * TB, chunk=i,
    )  # fmt: skip
    launch.extra["x_l2"] = n_tiles * N * D * e
    launch.extra["parts"] = parts
    launch.extra["valid"] = v
    return _product(geo, launch)


# -- the bounds beside it -------------------------------------------------------------------------------------
def gemm_bound(call: Call, gpu: GPU) -> float:
    """The bench's bf16 3-GEMM bound on paper: ``B×D`` by ``D×K`` for the logits, then the two backward products,
    in column blocks while the logits pass 1 GiB (as ``bench_runs._gemm_bound``), each GEMM at the larger of its
    compute and its bytes (operands and result read or written once)."""
    N, D = call.batch, call.dim
    K = call.active()[1]
    cols = K if N * K * 2 <= 2**30 else max(1, (2**30 // 2) // (4 * N))
    total, peak = 0.0, gpu.tensor_flops["bf16"]
    for s in range(0, K, cols):
        k = min(cols, K - s)
        flops = 2 * N * k * D
        for moved in (2 * (N * D + k * D + N * k), 2 * (N * k + k * D + N * D), 2 * (N * k + N * D + k * D)):
            total += max(flops / peak, moved / gpu.hbm_bytes_s) + LAUNCH_GAP_S
    return total


#: Cut Cross-Entropy's default tiles (its tl_autotune: no autotuning unless CCE_AUTOTUNE): forward 256×128×32 with
#: 8 warps, backward 128×128×32 with 4 warps and 64-wide gradient chunks
_CCE_FORWARD = dict(BLOCK_B=256, BLOCK_V=128, BLOCK_D=32, warps=8)
_CCE_BACKWARD = dict(BLOCK_B=128, BLOCK_V=128, BLOCK_D=32, warps=4)


def cce_plan(call: Call, filtered: bool = False) -> list[Launch]:
    """Cut Cross-Entropy's kernels at ``call``'s shape on one GPU (every class, bf16 embeddings and classifier):
    the log-sum-exp forward, the target logits' indexed dot, the backward (each block's logits recomputed;
    ``∇E`` and ``∇C`` added in bf16 under locks, a read-modify-write of each block's rows). ``filtered``: its
    gradient filter at best, every block without a sample's target skipped after its logits."""
    N, D, V = call.batch, call.dim, call.classes
    f = _CCE_FORWARD
    TB, TV = math.ceil(N / f["BLOCK_B"]), math.ceil(V / f["BLOCK_V"])
    tiles = TB * TV
    fwd = Launch(
        "forward",
        "cce lse forward",
        (tiles,),
        f,
        flops=tiles * 2 * f["BLOCK_B"] * f["BLOCK_V"] * _pad(D, 32),
        exps=tiles * f["BLOCK_B"] * f["BLOCK_V"],
        hbm=2 * N * D + 2 * V * D + 4 * N,
        l2=TV * N * D * 2 + TB * V * D * 2 + tiles * f["BLOCK_B"] * 8,
        programs=tiles,
        work_max=1,
        work_total=tiles,
        occupancy=1,
    )
    dot = Launch("forward", "cce indexed dot (targets)", hbm=4 * N * D + 4 * N, l2=4 * N * D + 4 * N)
    b = _CCE_BACKWARD
    BB, BV = b["BLOCK_B"], b["BLOCK_V"]
    TB, TV = math.ceil(N / BB), math.ceil(V / BV)
    tiles = TB * TV
    full = min(tiles, N) if filtered else tiles  # blocks past the filter: at most one per sample's target
    per_full = 2 * BB * BV * 2 * _pad(D, 64)  # ∇E and ∇C products
    bwd = Launch(
        "backward",
        "cce backward" + (" (filtered, best case)" if filtered else ""),
        (tiles,),
        b,
        flops=tiles * 2 * BB * BV * _pad(D, 32) + full * per_full,
        exps=tiles * BB * BV,
        hbm=2 * N * D + 2 * V * D + 4 * N + 4 * N * D + 4 * min(V, full * BV) * D,  # E, C, LSE; ∇E, ∇C RMW
        l2=TV * N * D * 2 + TB * V * D * 2 + full * (BB + BV) * D * 2 + full * 2 * (BB + BV) * D * 2,
        programs=tiles,
        work_max=1,
        work_total=tiles,
        occupancy=1,
    )
    zeros = Launch(
        "backward", "cce zeros (∇E, ∇C, locks)", hbm=2 * N * D + 2 * V * D, l2=2 * N * D + 2 * V * D, launches=3
    )
    return [fwd, dot, zeros, bwd]


# -- the report -------------------------------------------------------------------------------------------
def _sum_time(
    launches: Sequence[Launch], gpu: GPU, precision: str, phase: str | None = None, serial: bool = False
) -> float:
    costs = [cost(x, gpu, precision) for x in launches if phase is None or x.phase == phase]
    return sum(c.serial if serial else c.time for c in costs)


@dataclass
class Summary:
    """One shape's modelled step (forward + backward) and the figures beside it, seconds and bytes."""

    call: Call
    gpu: GPU
    launches: list[Launch]
    forward: float
    backward: float
    serial: float  # the step with each launch's bounds one after another
    gemm: float
    cce: float
    cce_filtered: float
    target: float | None
    other_backward: float | None  # the backward the launcher does not pick at this shape (staged or fused), on paper
    staged: bool

    @property
    def step(self) -> float:
        return self.forward + self.backward


def summarize(call: Call, gpu: GPU) -> Summary:
    launches = plan(call, gpu)
    p = call.precision
    fwd, bwd = _sum_time(launches, gpu, p, "forward"), _sum_time(launches, gpu, p, "backward")
    cce = _sum_time(cce_plan(call), gpu, "bf16")
    cce_f = _sum_time(cce_plan(call, filtered=True), gpu, "bf16")
    at_target = call.workers == 1 and call.sample_ratio == 1
    target = TARGETS.get((call.classes, call.dim, call.batch)) if at_target else None
    serial = _sum_time(launches, gpu, p, serial=True)
    from dmltrain.distributed.softmax_kernels import staged_backward

    staged = staged_backward(p, call.dim, call.deterministic)
    other = _sum_time(plan(call, gpu, not staged), gpu, p, "backward") if p == "bf16" else None
    return Summary(call, gpu, launches, fwd, bwd, serial, gemm_bound(call, gpu), cce, cce_f, target, other, staged)


def _grouped(launches: Sequence[Launch]) -> list[list[Launch]]:
    groups: dict[tuple[str, str], list[Launch]] = {}
    for x in launches:
        groups.setdefault((x.phase, x.kernel), []).append(x)
    return list(groups.values())


def _tiles(cfg: Any) -> str:
    if cfg is None:
        return "-"
    if isinstance(cfg, dict):  # Cut Cross-Entropy's
        return f"{cfg['BLOCK_B']}×{cfg['BLOCK_V']}×{cfg['BLOCK_D']} w{cfg['warps']}"
    names = [n for n in ("BLOCK_B", "BLOCK_C", "BLOCK_K", "BLOCK_D", "BLOCK_R") if n in dict(cfg.meta)]
    resident = dict(cfg.meta).get("X_RESIDENT")
    return (
        "×".join(str(cfg[n]) for n in names if not (resident and n == "BLOCK_K"))
        + (" x-res" if resident else "")
        + (f" w{cfg.num_warps}")
    )


def table_rows(launches: Sequence[Launch], gpu: GPU, precision: str) -> list[list[str]]:
    """One row per (phase, kernel): launches, first grid, tiles, CTAs per SM (``*``: no compile recorded, one
    assumed), wave efficiency at that occupancy, TFLOP, G exponentials, GB of HBM, L2 and atomics, and the
    ms of each bound and of the launches."""
    rows = []
    for group in _grouped(launches):
        first = group[0]
        costs = [cost(x, gpu, precision) for x in group]
        work = sum(x.work_total for x in group)

        def eff(attr: str, group=group, costs=costs, work=work) -> float:
            # the launches' wave efficiency weighted by their work
            return sum(getattr(c, attr) * x.work_total for c, x in zip(costs, group)) / work if work else 1.0

        n = sum(x.launches for x in group)
        grids = {x.grid for x in group}
        grid = "×".join(map(str, first.grid)) + ("…" if len(grids) > 1 else "") if first.grid else "-"
        occ = f"{first.occupancy}{'' if first.occupancy_compiled else '*'}" if first.programs else "-"
        waves = f"{eff('wave_eff'):.0%}" if first.programs else "-"
        s = {k: sum(getattr(c, k) for c in costs) for k in ("compute", "exp", "hbm", "l2", "time")}
        rows.append(
            [
                first.phase,
                first.kernel,
                str(n),
                grid,
                _tiles(first.cfg),
                occ,
                waves,
                f"{sum(x.flops for x in group) / 1e12:.2f}",
                f"{sum(x.exps for x in group) / 1e9:.2f}",
                f"{sum(x.hbm for x in group) / 1e9:.2f}",
                f"{sum(x.l2 for x in group) / 1e9:.2f}",
                f"{sum(x.atomic for x in group) / 1e9:.2f}",
                f"{s['compute'] * 1e3:.2f}",
                f"{s['exp'] * 1e3:.2f}",
                f"{s['hbm'] * 1e3:.2f}",
                f"{s['l2'] * 1e3:.2f}",
                f"{s['time'] * 1e3:.2f}",
                max(
                    ("compute", "exp", "HBM", "L2+at"),
                    key=dict(zip(("compute", "exp", "HBM", "L2+at"), (s["compute"], s["exp"], s["hbm"], s["l2"]))).get,
                ),
            ]
        )
    return rows


HEAD = (
    "phase",
    "kernel",
    "n",
    "grid",
    "tiles",
    "CTA/SM",
    "waves",
    "TFLOP",
    "G exp",
    "HBM GB",
    "L2 GB",
    "atom GB",
    "compute ms",
    "exp ms",
    "HBM ms",
    "L2+at ms",
    "ms",
    "bound",
)


def _text_table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head))]
    left = {0, 1, 3, 4, len(head) - 1}

    def line(r: Sequence[str]) -> str:
        cells = (str(c).ljust(w) if i in left else str(c).rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
        return "  ".join(cells).rstrip()

    return "\n".join([line(head), *map(line, rows)])


def breakdown(summary: Summary) -> list[str]:
    """The issue's costs, largest first in its list, as this model counts them at this shape."""
    from dmltrain.distributed import softmax_kernels as sk

    call, gpu, launches = summary.call, summary.gpu, summary.launches
    C, D = call.active()[1], call.dim
    out = []
    atomic = sum(x.atomic for x in launches)
    if atomic:
        formula = sum(x.extra.get("atomic_formula", 0.0) for x in launches)
        out.append(
            f"fp32 atomics in the backward: {atomic / 1e9:.1f} GB ({formula / 1e9:.1f} GB by 4·B·C·D·(1/BLOCK_B + "
            f"1/BLOCK_C)), {atomic / gpu.atomic_bytes_s * 1e3:.1f} ms at the assumed {gpu.atomic_bytes_s / 1e12:.1f} TB/s"
        )
    elif summary.staged:
        probs = [x for x in launches if x.kernel == "_probs_kernel"]
        gemms = [x for x in launches if x.kernel.startswith("cuBLAS")]
        g = sum(x.extra["columns"] for x in probs) * call.batch * 2
        out.append(
            f"staged backward: no atomics; G written once ({g / 1e9:.1f} GB in bf16, {len(probs)} stages of up to "
            f"{max(x.extra['columns'] for x in probs):,} columns) and read back "
            f"{'from L2' if all(x.extra['resident'] for x in probs) else 'from HBM (a stage passes half the L2)'} by "
            f"cuBLAS's G·Ŵ ({sum(x.flops for x in gemms) / 1e12:.1f} TFLOP at the assumed {CUBLAS_SHARE:.0%} of the "
            "peak) and the rows' kernel (Gᵀx)"
        )
    else:
        rmw = sum(x.l2 for x in launches if x.kernel in ("_grad_x_kernel", "_grad_w_kernel"))
        out.append(
            f"atomic-free backward: no atomics, accumulators on chip, each output written once; its loads and stores "
            f"move {rmw / 1e9:.1f} GB through L2"
        )
    if summary.other_backward is not None:
        this, that = ("staged", "fused atomic-free pair") if summary.staged else ("fused atomic-free pair", "staged")
        out.append(
            f"backward on paper: the {this} {summary.backward * 1e3:.2f} ms, the {that} {summary.other_backward * 1e3:.2f} "
            f"ms (the launcher stages bf16 backwards from D = {sk.STAGE_MIN_DIM} unless deterministic)"
        )
    for kernel in ("_lse_kernel", "_probs_kernel", "_stage_rows_kernel", "_grad_x_kernel", "_grad_w_kernel"):
        ks = [x for x in launches if x.kernel == kernel]
        if ks:
            flops, l2 = sum(x.flops for x in ks), sum(x.l2 for x in ks)
            atomic = sum(x.atomic for x in ks)
            with_atomics = f", {flops / (l2 + atomic):.0f} with its atomics" if atomic else ""
            xs = sum(x.extra.get("x_l2", 0.0) for x in ks)
            out.append(
                f"{kernel}: {l2 / 1e9:.1f} GB of L2 loads and stores ({xs / 1e9:.1f} GB of them x, re-streamed "
                f"per class tile): "
                f"{flops / l2:.0f} FLOP/B{with_atomics}; the L2 ridge is "
                f"{gpu.tensor_flops[call.precision] / gpu.l2_bytes_s:.0f}"
            )
    x_bytes = call.batch * D * (2 if call.precision == "bf16" else 4)
    if x_bytes > gpu.l2_bytes / 2:
        out.append(
            f"the gathered batch ({x_bytes / 2**20:.0f} MiB) passes half the L2 ({gpu.l2_bytes / 2**20:.0f} MiB): "
            "the HBM figures, which keep it there, are low"
        )
    passes = [x for x in launches if x.kernel == "_copy_rows_kernel"]
    moved = sum(x.hbm for x in passes)
    twice = any(x.phase == "backward" for x in passes)
    how = "made twice" if twice else f"made once, kept for the backward within {sk.KEEP_COPY_BYTES / 2**30:g} GiB"
    out.append(
        f"separate memory passes (the normalised copy {how}; no gradient scratch since the atomic-free backward): "
        f"{moved / 1e9:.1f} GB = {moved / (C * D):.1f}·C·D bytes, {moved / gpu.hbm_bytes_s * 1e3:.2f} ms of HBM"
    )
    for kernel in ("_lse_kernel", "_probs_kernel", "_stage_rows_kernel", "_grad_x_kernel", "_grad_w_kernel"):
        ks = [x for x in launches if x.kernel == kernel]
        if ks:
            x = ks[0]
            c = cost(x, gpu, call.precision)
            how = "from the compiled binary" if x.occupancy_compiled else "no compile recorded: one assumed"
            unit = "class tile" if kernel == "_probs_kernel" else "class split"
            split = f"{x.grid[1]} {unit}{'s' if x.grid[1] > 1 else ''} for " if len(x.grid) > 1 else ""
            out.append(
                f"{kernel}: {split}{x.occupancy} CTA/SM of {x.cfg.num_warps} warps ({how}), "
                f"{gpu.sms * x.occupancy} programs at once: wave efficiency {c.wave_eff:.0%} (first chunk)"
            )
    return out


def verdict(s: Summary) -> str:
    """Whether the modelled step meets the target: ``met`` when even the serialised estimate does, ``met only with
    every bound overlapped`` when the roofline (a floor) does and the serialised one does not, else ``not met``."""
    if s.target is None:
        return "no target"
    if s.serial <= s.target:
        return "met"
    return "met only with every bound overlapped" if s.step <= s.target else "not met"


def report(call: Call, gpu: GPU) -> tuple[str, Summary]:
    """The printed table and lines for one shape, and its summary."""
    s = summarize(call, gpu)
    K, valid, _, count = call.active()
    chunks = sorted({x.chunk for x in s.launches})
    lines = [
        f"roofline {gpu.name}: {call.kind}, {call.classes:,} classes, D={call.dim}, B={call.batch:,}, W={call.workers}, "
        f"R={call.sample_ratio:g} ({K:,} columns on rank 0{f', {valid:,} expected drawn' if count else ''}), "
        f"{call.precision} products, {call.weight_storage} weight, "
        f"{'staged' if s.staged else 'atomic-free'} backward, {'fixed' if call.deterministic else 'tuned'} tiles; "
        f"{len(chunks)} chunk(s); nothing run",
        _text_table(HEAD, table_rows(s.launches, gpu, call.precision)),
        *breakdown(s),
        f"3-GEMM bf16 bound (on paper, the bench's three GEMMs with the logits' bytes): {s.gemm * 1e3:.2f} ms",
        f"Cut Cross-Entropy, its published algorithm (one GPU, every class): exact {s.cce * 1e3:.2f} ms; with its gradient "
        f"filter at best {s.cce_filtered * 1e3:.2f} ms",
        f"roofline step (forward {s.forward * 1e3:.2f} + backward {s.backward * 1e3:.2f}): {s.step * 1e3:.2f} ms with each "
        f"launch's bounds overlapped, {s.serial * 1e3:.2f} ms with compute, exponentials and memory one after another; "
        + (
            f"target {s.target * 1e3:.0f} ms (issue 37, H100): {s.step / s.target:.2f}× / {s.serial / s.target:.2f}× the "
            f"target, {verdict(s)}"
            if s.target
            else "no target at this shape"
        ),
    ]
    return "\n".join(lines), s


def render(calls: Sequence[Call], gpu: GPU) -> str:
    """``bench classifier --model``'s output: the GPU's figures, each call's table and lines, and with several calls
    one line each."""
    parts = [
        f"roofline model of the fused step on paper, {gpu.name}; the figures it takes:",
        *(f"  {note}" for note in gpu.notes),
        "  the assumptions: dmltrain/distributed/roofline.py, docs/concepts/sharded-classifier.md",
        "",
    ]
    summaries = []
    for call in calls:
        text, s = report(call, gpu)
        parts += [text, ""]
        summaries.append(s)
    if len(summaries) > 1:
        head = (
            "classes",
            "D",
            "B",
            "R",
            "step ms",
            "serialised ms",
            "3-GEMM ms",
            "CCE ms",
            "CCE filtered ms",
            "target ms",
            "step / target",
            "verdict",
        )
        rows = [
            [
                f"{s.call.classes:,}",
                str(s.call.dim),
                f"{s.call.batch:,}",
                f"{s.call.sample_ratio:g}",
                f"{s.step * 1e3:.2f}",
                f"{s.serial * 1e3:.2f}",
                f"{s.gemm * 1e3:.2f}",
                f"{s.cce * 1e3:.2f}",
                f"{s.cce_filtered * 1e3:.2f}",
                f"{s.target * 1e3:.0f}" if s.target else "-",
                f"{s.step / s.target:.2f}" if s.target else "-",
                verdict(s),
            ]
            for s in summaries
        ]
        parts.append(_text_table(head, rows))
    return "\n".join(parts).rstrip()
