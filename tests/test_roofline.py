"""The roofline model of the fused classifier (dmltrain/distributed/roofline.py) against the code it models.

* Counts: every product launch's FLOPs, exponentials, L2 bytes and atomic bytes equal a loop-by-loop count
  over its programs and tiles, transcribed from the kernels' loops (ragged sizes, a draw's count, tuned and
  fixed tiles); the backward moves no atomic bytes at issue 37's shapes (it was 49 / 393 / 492 GB).
* Launches: the list the model makes equals the launches the real launcher makes, (a) under Triton's CPU
  interpreter at tiny shapes, kernels run (a spawned process: the interpreter must be on before Triton is
  imported), and (b) at the issue's shapes with the GPU's geometry, on meta tensors with the kernels
  recorded and not run (the tuner's choice handed over from the model: nothing here can time a kernel; each
  kernel's binary, whose registers and shared memory set the split counts, one of the model's recorded compiles);
  the launcher's ``_programs`` and ``_choose`` for the deterministic path are called for real.
* Splits: the launcher's class splits follow the CTAs per SM its binary's registers and shared memory allow.
* The command prints its table and exits 0.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dmltrain.distributed import roofline
from dmltrain.distributed.roofline import GPUS, Call, plan
from dmltrain.kernel_occupancy import SMLimits, ctas_per_sm, device_limits, occupancy, resources
from dmltrain.kernel_tuning import LaunchConfig

REPO = Path(__file__).resolve().parents[1]
KERNELS = (
    "_copy_rows_kernel",
    "_lse_kernel",
    "_grad_x_kernel",
    "_grad_w_kernel",
    "_probs_kernel",
    "_stage_rows_kernel",
)


def _model_launches(call: Call, gpu) -> list[tuple[str, list[int], dict[str, int]]]:
    return [(x.kernel, list(x.grid), dict(x.cfg.meta)) for x in plan(call, gpu) if x.triton]


# -- counts ------------------------------------------------------------------------------------------------
def _rows(offs0: int, block: int, n: int) -> int:
    """Entries of a block starting at ``offs0`` under the mask ``offs < n``."""
    return max(0, min(block, n - offs0))


def _loop_count(launch, call: Call, N: int, nv: int) -> dict[str, float]:
    """FLOPs, exponentials, L2 bytes and atomic bytes of one product launch, program by program, tile by tile, as
    the kernels' loops run (masked entries load nothing; tl.dot computes whole tiles)."""
    D, e = call.dim, 2 if call.precision == "bf16" else 4
    c = dict(launch.cfg.meta)
    BB, BC, BK = c["BLOCK_B"], c["BLOCK_C"], c.get("BLOCK_K", 0)  # the staged rows' kernel: no D chunk
    D_PAD = 1 << (D - 1).bit_length()  # the atomic-free kernels' accumulators: D padded to a power of two
    n = dict(flops=0, exps=0, l2=0, atomic=0)

    resident = bool(c.get("X_RESIDENT"))  # the log-sum-exp kernel's batch block loaded once a program

    def logits(b0: int, t0: int) -> None:  # _logits: the D loop of one tile
        for k0 in range(0, D, BK):
            n["flops"] += 2 * BB * BC * BK
            n["l2"] += ((0 if resident else _rows(b0, BB, N)) + _rows(t0, BC, nv)) * min(BK, D - k0) * e
        n["exps"] += BB * BC

    kernel, grid = launch.kernel, launch.grid
    if kernel == "_lse_kernel":
        TB, S = grid
        tiles = math.ceil(nv / BC)
        per = math.ceil(tiles / S)
        for b in range(TB):
            for s in range(S):
                n["l2"] += _rows(b * BB, BB, N) * 4 * 4  # tcol in, three partials out
                n["l2"] += _rows(b * BB, BB, N) * D * e if resident else 0  # before the loop, idle programs too
                for t in range(s * per, min(s * per + per, tiles)):
                    logits(b * BB, t * BC)
                    n["exps"] += BB  # the running sum's rescale
                n["exps"] += BB  # the final log
    elif kernel == "_grad_x_kernel":  # the accumulator on chip, the partial written once by every program
        TB, S = grid
        tiles = math.ceil(nv / BC)
        per = math.ceil(tiles / S)
        for b in range(TB):
            rows = _rows(b * BB, BB, N)
            for s in range(S):
                first = s * per
                for t in range(first, min(first + per, tiles)):
                    n["l2"] += rows * 8
                    logits(b * BB, t * BC)
                    n["flops"] += 2 * BB * BC * D_PAD
                    n["l2"] += _rows(t * BC, BC, nv) * D * e
                n["l2"] += rows * D * 4
    elif kernel == "_probs_kernel":  # one tile a program, computed whole; G and the column sums stored
        TB, CT = grid
        k = launch.extra["columns"]
        for b in range(TB):
            rows = _rows(b * BB, BB, N)
            for t in range(CT):
                n["l2"] += rows * 8  # tcol and lse
                logits(b * BB, t * BC)
                n["l2"] += rows * _rows(t * BC, BC, k) * e + _rows(t * BC, BC, k) * 4
    elif kernel == "_stage_rows_kernel":  # the accumulator on chip; G read back, the batch re-read per class tile
        ws = 2 if call.weight_storage == "bf16" else 4
        has_rows, v = call.active()[2], launch.extra["valid"]
        for t in range(grid[0]):
            cols = _rows(t * BC, BC, v)
            n["l2"] += launch.extra["parts"] * cols * 4  # the column sums' partials
            if t * BC >= v:
                continue
            for b0 in range(0, N, BB):
                rows = _rows(b0, BB, N)
                n["flops"] += 2 * BB * BC * D_PAD
                n["l2"] += rows * cols * e + rows * D * e  # G's tile, x's
            n["l2"] += cols * 8 if has_rows else 0  # the row ids
            if call.normalized:  # 1/‖w‖, the weight read, the gradient written
                n["l2"] += cols * 4 + cols * D * 2 * ws
            else:  # the weight's and the bias's gradients written
                n["l2"] += cols * D * ws + cols * ws
    elif kernel == "_grad_w_kernel":  # the accumulator on chip, the rows' gradients written once into .grad
        ws = 2 if call.weight_storage == "bf16" else 4
        has_rows = call.active()[2]
        for t in range(grid[0]):
            if t * BC >= nv:
                continue
            cols = _rows(t * BC, BC, nv)
            for b0 in range(0, N, BB):
                rows = _rows(b0, BB, N)
                n["l2"] += rows * 8
                logits(b0, t * BC)
                n["flops"] += 2 * BB * BC * D_PAD
                n["l2"] += rows * D * e
            n["l2"] += cols * 8 if has_rows else 0  # the row ids
            if call.normalized:  # 1/‖w‖, the weight read, the gradient written
                n["l2"] += cols * 4 + cols * D * 2 * ws
            else:  # the weight's and the bias's gradients written
                n["l2"] += cols * D * ws + cols * ws
    return n


@pytest.mark.parametrize(
    "call, staged",
    [
        (Call(5000, 200, 300, workers=2, sample_ratio=0.5), False),  # ragged D and batch, a draw with a count
        (Call(5000, 72, 130, workers=2, sample_ratio=0.5, deterministic=True), False),
        (Call(3000, 96, 257, precision="tf32"), True),  # tf32 is never staged
        (Call(3000, 96, 257, kind="softmax_ce", smoothing=0.1, deterministic=True), False),
        (Call(5000, 264, 300, workers=2, sample_ratio=0.5), True),  # the staged backward: bf16
        (Call(3000, 160, 257, kind="softmax_ce", smoothing=0.1), True),
        (Call(5000, 128, 300, workers=2, sample_ratio=0.5), True),  # the batch-resident forward, tuned
    ],
    ids=["tuned", "deterministic", "tf32", "softmax_ce", "staged", "staged-softmax_ce", "x-resident"],
)
def test_counts_equal_a_loop_by_loop_count(monkeypatch, call, staged):
    from dmltrain.distributed import softmax_kernels as sk

    monkeypatch.setattr(sk, "STAGE_BF16", staged)
    launches = [x for x in plan(call, GPUS["h100"]) if x.programs]
    resident = [x for x in launches if dict(x.cfg.meta).get("X_RESIDENT")]
    assert bool(resident) == (call.dim == 128), "the model should take the batch-resident tiles at D = 128 only"
    staged_kernels = ("_probs_kernel", "_stage_rows_kernel")
    backward = (
        staged_kernels
        if sk.staged_backward(call.precision, call.dim, call.deterministic)
        else ("_grad_x_kernel", "_grad_w_kernel")
    )
    assert {x.kernel for x in launches} == {"_lse_kernel", *backward}
    _, valid, _, count = call.active()
    assert count == (call.workers > 1)
    for x in launches:
        assert x.chunk == 0  # one chunk: every column valid up to the count
        got = _loop_count(x, call, call.batch, valid)
        assert got["flops"] == x.flops, x.kernel
        assert got["exps"] == x.exps, x.kernel
        assert got["l2"] == x.l2, x.kernel
        assert got["atomic"] == x.atomic, x.kernel


def test_the_backward_moves_no_atomic_bytes_at_the_issue_shapes():
    """Issue 37's 49 / 393 / 492 GB of fp32 atomics are gone: the staged backward and the atomic-free pair write each
    output once."""
    for C, D, B in roofline.ISSUE_SHAPES:
        for staged in (True, False):
            launches = plan(Call(C, D, B), GPUS["h100"], staged)
            backward = {"_probs_kernel", "_stage_rows_kernel"} if staged else {"_grad_x_kernel", "_grad_w_kernel"}
            assert {x.kernel for x in launches if x.programs} == {"_lse_kernel", *backward}
            assert sum(x.atomic for x in launches) == 0


def test_occupancy_from_registers_and_shared_memory():
    h100, a100 = GPUS["h100"].sm, GPUS["a100"].sm
    assert ctas_per_sm(h100, 128, 24576, 8) == 2  # 128 registers: 16 warps' worth
    assert ctas_per_sm(h100, 76, 36864, 8) == 3  # 80 allocated: 25 warps
    assert ctas_per_sm(h100, 184, 49152, 8) == 1
    assert ctas_per_sm(h100, 32, 100 * 1024, 4) == 2  # by shared memory
    assert ctas_per_sm(a100, 158, 16384, 8) == 1
    assert ctas_per_sm(a100, 32, 200 * 1024, 4) == 0  # beyond the SM: the launch fails, the waves count one
    assert occupancy(a100, (32, 200 * 1024), 4) == 1 and occupancy(h100, None, 8) == 1
    assert occupancy(h100, (76, 36864), 8) == 3


class _Binary:
    """A Triton ``CompiledKernel`` as the launcher reads it (3.6 and 3.8): the shared memory in its metadata, the
    registers known once the binary is loaded (``_init_handles``)."""

    def __init__(self, used: tuple[int, int] | None) -> None:
        self.used = used
        self.metadata = argparse.Namespace(shared=used[1] if used else 0)

    def _init_handles(self) -> None:
        if self.used is not None:
            self.n_regs = self.used[0]


def test_resources_read_a_compiled_kernel_as_both_tritons_build_it():
    assert resources(_Binary((96, 32768))) == (96, 32768)  # loaded on the spot
    future = argparse.Namespace(result=lambda: _Binary((102, 0)))
    assert resources(future) == (102, 0)  # an asynchronous compile's
    assert resources(_Binary(None)) is None  # a Triton that names them otherwise: one CTA per SM
    assert resources(argparse.Namespace(n_regs=40)) is None
    props = argparse.Namespace(shared_memory_per_multiprocessor=233472, regs_per_multiprocessor=65536,
                               max_threads_per_multi_processor=2048, major=9, minor=0)  # fmt: skip
    assert device_limits(props) == GPUS["h100"].sm
    del props.regs_per_multiprocessor
    props.major, props.minor = 8, 6
    assert device_limits(props) == SMLimits(233472, 65536, 2048, 16)


# -- launches ----------------------------------------------------------------------------------------------
#: (call, softmax_kernels settings) of the interpreter run: both backwards, normalised and not, a draw's count, chunks
#: of 16 columns (16-wide tiles), two of them past the count (the paths without one: the GPU-shape test below); the
#: staged backward in 48-column chunks of three 16-column stages
_FUSED = {"CHUNK_BYTES": 1536, "STAGE_BF16": False}
INTERPRETER_CASES = [
    (Call(100, 16, 17, workers=2, sample_ratio=0.5, precision="bf16", kind="cosface", deterministic=True), _FUSED),
    (Call(100, 16, 17, workers=2, sample_ratio=0.5, precision="fp32", kind="softmax_ce", smoothing=0.1), _FUSED),
    (
        Call(200, 16, 17, precision="bf16", kind="softmax_ce", smoothing=0.1),
        {"CHUNK_BYTES": 16 * 6 * 48, "STAGE_BF16": True, "STAGE_MIN_DIM": 0, "STAGE_BYTES": 2 * 17 * 16},
    ),
    (
        Call(100, 16, 17, workers=2, sample_ratio=0.5, precision="bf16", kind="arcface"),
        {"CHUNK_BYTES": 16 * 6 * 48, "STAGE_BF16": True, "STAGE_MIN_DIM": 0, "STAGE_BYTES": 2 * 17 * 16},
    ),
]

_CHILD = r"""
import json, sys
import torch
from dmltrain.distributed import softmax_kernels as sk
from dmltrain.distributed.roofline import Call
from dmltrain.distributed.row_sparse import RowGradTarget, RowSet
from dmltrain.distributed.sharded_softmax import ShardOperands
assert sk.INTERPRET
rec = []
class Recorder:
    def __init__(self, name, fn):
        self.name, self.fn = name, fn
    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            rec.append((self.name, list(grid), {k: v for k, v in kwargs.items() if k.startswith("BLOCK_") or k == "X_RESIDENT"}))
            return self.fn[grid](*args, **kwargs)
        return launch
for name in json.loads(sys.argv[1]):
    setattr(sk, name, Recorder(name, getattr(sk, name)))
out = []
for fields, settings in json.loads(sys.argv[2]):
    call = Call(**fields)
    for name, value in {"STAGE_BYTES": sk.STAGE_BYTES, **settings}.items():
        setattr(sk, name, value)
    K, valid, has_rows, has_count = call.active()
    g = torch.Generator().manual_seed(0)
    n_local = -(-call.classes // call.workers)
    w = torch.randn(n_local, call.dim, generator=g)
    b = None if call.normalized else torch.randn(n_local, generator=g)
    x = torch.randn(call.batch, call.dim, generator=g)
    if call.normalized:
        x = torch.nn.functional.normalize(x, dim=1)
    rows = torch.randperm(n_local, generator=g)[:K] if has_rows else None
    count = torch.tensor(valid) if has_count else None
    tcol = torch.randint(-1, valid, (call.batch,), generator=g)
    op = ShardOperands(x, w, b, rows, count, tcol, 8.0, call.normalized)
    rec.clear()
    lse, _, _, saved = sk.partials(op, call.sum_logits, call.precision, call.deterministic, keep_copies=True)
    target = RowGradTarget(None, RowSet(rows, count), torch.zeros_like(w), None if b is None else torch.zeros_like(b), False)
    off = torch.tensor(0.01) if call.sum_logits else None
    sk.gradients(op, saved, torch.logaddexp(lse, torch.zeros(())), torch.tensor(0.05), off, True, target,
                 call.precision, call.deterministic)
    out.append(list(rec))
print("LAUNCHES " + json.dumps(out))
"""


def test_launches_equal_the_interpreters(monkeypatch):
    """The model's launches (kernel, grid, tiles) are the ones the launcher makes under Triton's CPU interpreter."""
    cases = [(vars(call), settings) for call, settings in INTERPRETER_CASES]
    env = {
        **os.environ,
        "TRITON_INTERPRET": "1",
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(KERNELS), json.dumps(cases)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    recorded = json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("LAUNCHES "))[9:])
    from dmltrain.distributed import softmax_kernels as sk

    assert len(recorded) == len(INTERPRETER_CASES)
    for (call, settings), got in zip(INTERPRETER_CASES, recorded):
        for name, value in settings.items():
            monkeypatch.setattr(sk, name, value)
        want = [list(x) for x in _model_launches(call, None)]
        assert len({x.chunk for x in plan(call, None)}) > 1, "the case should make several chunks"
        if "STAGE_BYTES" in settings:  # several stages in a chunk
            stages = [x.chunk for x in plan(call, None) if x.kernel == "_probs_kernel"]
            assert max(map(stages.count, stages)) >= 3
        assert got == want, call
        monkeypatch.undo()


def _launch_on_meta(monkeypatch, call: Call, gpu, binary, choose_lse=None) -> tuple[list, list, list]:
    """The real ``partials`` and ``gradients`` of ``call`` on meta tensors at ``gpu``'s geometry, the kernels recorded
    and not run: (launches as (kernel, grid, tiles), the kinds asked of ``_choose``, the binaries asked for as
    (kernel, tiles)). ``binary(kernel, cfg)`` stands for the ``CompiledKernel`` Triton's ``warmup`` returns;
    ``choose_lse(cfg_default)`` the tuner's choice of the log-sum-exp tiles (None: the launcher's ``_choose``)."""
    from dmltrain.distributed import softmax_kernels as sk
    from dmltrain.distributed.row_sparse import RowGradTarget, RowSet
    from dmltrain.distributed.sharded_softmax import ShardOperands

    real_choose, asked, recorded, binaries = sk._choose, [], [], []

    def choose(kind, key, precision, device, launch, deterministic=False, sum_logits=False):
        asked.append(kind)
        if deterministic or kind != "lse" or choose_lse is None:  # the backward's kernels: one candidate each
            return real_choose(kind, key, precision, torch.device("cuda", 0), launch, deterministic, sum_logits)
        return choose_lse()

    class Recorder:
        def __init__(self, name):
            self.name = name
            out = {"_lse_kernel": "out_ptr", "_grad_x_kernel": "part_ptr"}.get(name)
            self.out = getattr(sk, name).arg_names.index(out) if out else None

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                recorded.append(
                    (
                        self.name,
                        list(grid),
                        {k: v for k, v in kwargs.items() if k.startswith("BLOCK_") or k == "X_RESIDENT"},
                    )
                )
                if self.out is not None:  # the binary asked for is the one launched: the same arguments
                    name, _, warm_args, warm_kwargs = binaries[-1] if binaries else (None, None, (), {})
                    same = name == self.name and warm_kwargs == kwargs and len(warm_args) == len(args)
                    if not (same and all(a is b for i, (a, b) in enumerate(zip(args, warm_args)) if i != self.out)):
                        binaries.append((self.name, "launched without its binary", args, kwargs))

            return launch

        def warmup(self, *args, grid, **kwargs):
            meta = {k: v for k, v in kwargs.items() if k.startswith("BLOCK_") or k == "X_RESIDENT"}
            cfg = LaunchConfig.of(kwargs["num_warps"], kwargs["num_stages"], **meta)
            assert args[self.out] is torch.float32  # the output, not yet allocated: its dtype stands in
            binaries.append((self.name, sk._tiles(cfg), args, kwargs))
            return binary(self.name, cfg)

    for name in KERNELS:
        monkeypatch.setattr(sk, name, Recorder(name))
    monkeypatch.setattr(sk, "INTERPRET", False)
    monkeypatch.setattr(sk, "_choose", choose)
    monkeypatch.setattr(sk, "_sms", lambda index: gpu.sms)
    monkeypatch.setattr(sk, "_sm_limits", lambda index: gpu.sm)
    real_programs = sk._programs
    # the device is the last argument: a CUDA device's geometry for the meta tensors
    monkeypatch.setattr(sk, "_programs", lambda *args: real_programs(*args[:-1], torch.device("cuda", 0)))

    K, valid, has_rows, has_count = call.active()
    meta = torch.device("meta")
    n_local = -(-call.classes // call.workers)
    w = torch.empty(n_local, call.dim, device=meta)
    b = None if call.normalized else torch.empty(n_local, device=meta)
    rows = torch.empty(K, dtype=torch.int64, device=meta) if has_rows else None
    count = torch.empty((), dtype=torch.int64, device=meta) if has_count else None
    op = ShardOperands(torch.empty(call.batch, call.dim, device=meta), w, b, rows, count,
                       torch.empty(call.batch, dtype=torch.int64, device=meta), 8.0, call.normalized)  # fmt: skip
    lse, _, _, saved = sk.partials(op, call.sum_logits, call.precision, call.deterministic, keep_copies=True)
    target = RowGradTarget(None, RowSet(rows, count), torch.empty_like(w), None if b is None else torch.empty_like(b),
                           False)  # fmt: skip
    off = torch.empty((), device=meta) if call.sum_logits else None
    sk.gradients(op, saved, lse, torch.empty((), device=meta), off, True, target, call.precision, call.deterministic)
    return recorded, asked, [(name, tiles) for name, tiles, *_ in binaries]


@pytest.mark.parametrize(
    "call, staged",
    [
        *((Call(C, D, B), True) for C, D, B in roofline.ISSUE_SHAPES),
        (Call(10**6, 512, 8192, deterministic=True), True),
        (Call(3 * 10**6, 256, 4096, workers=3, sample_ratio=0.1, kind="softmax_ce", smoothing=0.1), True),
        *((Call(C, D, B), False) for C, D, B in roofline.ISSUE_SHAPES),
        (Call(3 * 10**6, 256, 4096, workers=3, sample_ratio=0.1, kind="softmax_ce", smoothing=0.1), False),
    ],
    ids=[
        "issue-1",
        "issue-2",
        "issue-3",
        "deterministic",
        "subsampled-ce",
        "fused-1",
        "fused-2",
        "fused-3",
        "fused-subsampled-ce",
    ],
)
def test_launches_equal_the_launchers_at_gpu_shapes(monkeypatch, call, staged):
    """The real ``partials`` and ``gradients`` on meta tensors with the kernels recorded, not run: the same launches,
    grids and tiles as the model's at the GPU's geometry (the tuner's choice, which only a GPU can time, handed
    over from the model; the deterministic path's fixed choice asked of the launcher's own ``_choose``; each
    binary's registers and shared memory the model's recorded compile of it, or unknown where none is)."""
    from dmltrain.distributed import softmax_kernels as sk

    gpu = GPUS["h100"]
    monkeypatch.setattr(sk, "STAGE_BF16", staged)
    model = [x for x in plan(call, gpu) if x.triton]
    tuned = [x.cfg for x in model if x.kernel == "_lse_kernel"]

    def binary(kernel, cfg):
        return _Binary(roofline.recorded(kernel, sk._tiles(cfg), gpu.arch, call))

    recorded, asked, binaries = _launch_on_meta(monkeypatch, call, gpu, binary, lambda: tuned.pop(0))
    assert recorded == [(x.kernel, list(x.grid), dict(x.cfg.meta)) for x in model]
    staged = sk.staged_backward(call.precision, call.dim, call.deterministic)  # deterministic: the fused pair
    assert set(asked) == ({"lse", "probs", "stage_rows"} if staged else {"lse", "grad_x", "grad_w"})
    split = [x for x in model if x.kernel in ("_lse_kernel", "_grad_x_kernel")]
    assert binaries == [(x.kernel, sk._tiles(x.cfg)) for x in split]  # one binary asked for per split launch
    assert any(x.occupancy > 1 for x in split) == (call.precision == "bf16" and call.normalized)


@pytest.mark.parametrize("gpu", ["h100", "a100"])
def test_the_split_count_follows_the_binarys_occupancy(monkeypatch, gpu):
    """The log-sum-exp and embedding-gradient kernels' class splits fill whole waves of SMs × the CTAs per SM their
    binary's registers and shared memory allow (1, 2, 3 at 8 warps: 216, 128, 76 registers), not one CTA per SM."""
    from dmltrain.distributed import softmax_kernels as sk

    gpu = GPUS[gpu]
    call = Call(300_000, 128, 2048, deterministic=True)  # one chunk of every class
    N, K = call.batch, call.classes
    splits: dict[str, set[int]] = {}
    for regs, ctas in ((216, 1), (128, 2), (76, 3)):
        assert ctas_per_sm(gpu.sm, regs, 16384, 8) == ctas
        monkeypatch.setattr(sk, "STAGE_BF16", False)  # the fused pair's embedding-gradient kernel
        recorded, _, binaries = _launch_on_meta(monkeypatch, call, gpu, lambda kernel, cfg, r=regs: _Binary((r, 16384)))
        monkeypatch.undo()
        split = [
            (kernel, grid, tiles) for kernel, grid, tiles in recorded if kernel in ("_lse_kernel", "_grad_x_kernel")
        ]
        assert [kernel for kernel, *_ in split] == ["_lse_kernel", "_grad_x_kernel"]
        for kernel, grid, tiles in split:
            most = sk.PARTIAL_BYTES // (4 * N * call.dim) if kernel == "_grad_x_kernel" else None
            want = sk.num_splits(-(-N // tiles["BLOCK_B"]), -(-K // tiles["BLOCK_C"]), gpu.sms * ctas, most)
            assert grid[1] == want, (kernel, regs, grid)
            splits.setdefault(kernel, set()).add(grid[1])
        assert [kernel for kernel, _ in binaries] == ["_lse_kernel", "_grad_x_kernel"]  # each launch's own binary
    # at this shape the count differs with the occupancy: sized for one CTA per SM, the launches would fail it
    assert len(splits["_lse_kernel"]) > 1 and len(splits["_grad_x_kernel"]) > 1, splits


@pytest.mark.cuda
def test_the_launcher_reads_its_binary_on_the_gpu():
    """On a GPU, with its Triton: the log-sum-exp binary's registers and shared memory are read off the compiled
    kernel (not the one-CTA fallback), the registers the driver reports are the cubin's (what the offline compiles
    record), the launcher counts SMs × the CTAs per SM they allow, and that binary runs."""
    from dmltrain import kernel_compile as kc
    from dmltrain.distributed import softmax_kernels as sk

    dev = torch.device("cuda", torch.cuda.current_device())
    N, K, D = 256, 4096, 128
    x = torch.nn.functional.normalize(torch.randn(N, D, device=dev), dim=1).bfloat16()
    w = torch.nn.functional.normalize(torch.randn(K, D, device=dev), dim=1).bfloat16()
    tcol = torch.full((N,), -1, dtype=torch.int32, device=dev)
    cfg = sk._CONFIGS[("lse", "bf16")][0]
    args = [x, w, w, tcol, w, torch.float32, N, K, 0, 8.0]
    kwargs = dict(D=D, HAS_COUNT=False, NORMALIZED=True, SUM_LOGITS=False, PREC=sk.PREC_CODE["bf16"], **cfg.kwargs())
    compiled = sk._lse_kernel.warmup(*args, grid=(1,), **kwargs)
    used = resources(compiled)
    assert used is not None and used[0] > 0, "Triton no longer tells the binary's registers: splits for one CTA/SM"
    if kc.tools_missing() is None:
        assert used[0] == kc.resource_usage(compiled.asm["cubin"], compiled.metadata.name)[0]
    ctas = occupancy(sk._sm_limits(dev.index), used, cfg.num_warps)
    assert sk._programs(sk._lse_kernel, cfg, args, kwargs, dev) == sk._sms(dev.index) * ctas
    print(f"\n_lse_kernel {sk._tiles(cfg)} D={D}: {used[0]} registers, {used[1]:,} B shared, {ctas} CTA/SM")
    args[5] = out = torch.empty(1, 3, N, device=dev)
    sk._lse_kernel[(N // cfg["BLOCK_B"], 1)](*args, **kwargs)
    z = 8.0 * (x.float() @ w.float().T)
    assert torch.allclose(out[0, 0], torch.logsumexp(z, 1), atol=0.05)


# -- the command -------------------------------------------------------------------------------------------
def test_bench_model_prints_one_table(capsys):
    from dmltrain.bench import bench_parser, run

    assert run(argparse.Namespace(bench="classifier", bench_args=["--model", "h100", "--shapes", "issue"])) == 0
    out = capsys.readouterr().out
    assert out.count("\nphase ") == 3 and "\nclasses " in out  # a table per shape, then one line each
    for (C, D, B), target in roofline.TARGETS.items():
        assert f"{C:,} classes, D={D}, B={B:,}" in out and f"target {target * 1e3:.0f} ms" in out
    assert "staged backward: no atomics" in out and "fp32 atomics in the backward" not in out
    assert out.count("backward on paper: the staged") == 3  # and the fused pair beside it
    args = "--model a100 --classes 20000 --dim 64 --batch 512 --sample-ratio 0.5 --workers 2 --deterministic"
    assert run(argparse.Namespace(bench="classifier", bench_args=args.split())) == 0
    out = capsys.readouterr().out
    assert (
        out.count("\nphase ") == 1 and "no target at this shape" in out and "_grad_w_kernel" in out
    )  # D = 64, deterministic: the fused pair
    with pytest.raises(Exception, match="--shapes goes with --model"):
        run(argparse.Namespace(bench="classifier", bench_args=["--shapes", "issue"]))
    assert "--model" in bench_parser("classifier").format_help()
