"""Every Triton kernel of the project compiled offline for an A100 (sm_80) and an H100 (sm_90), no GPU needed.

The interpreter, which the other kernel tests run under, accepts what a real compile rejects. Here
Triton compiles (ptxas ships with it) the covering set of each module's ``compile_variants()``
(:func:`dmltrain.kernel_compile.covering`: every autotune config of every kernel once per
architecture, every flag and dtype value at least once per kernel, and each config's variant most
likely to spill; ``python -m dmltrain.kernel_compile --all`` compiles all of them), in two processes
with Triton's cache in a temporary folder, and checks each against its contract: it compiles, it
fits the architecture's shared memory (or the launcher prunes it), it does not spill (no stack frame,
no ``STL``/``LDL`` in the SASS) unless its module allows it, the product kernels pipeline their loads
(``cp.async``) and use Hopper's ``wgmma`` on sm_90. Each compile is the binary a launch builds: the
arguments go through Triton's launch binder (alignment and divisibility as at run time), and a test
checks the fused path's real launches specialise exactly as the offline variants do.

The same covering set is compiled for sm_90 with the Triton of the lent GPU machines (3.6, beside
the pinned 3.8 in ``.venv/triton-3.6.0``, installed by ``make``), where the kernels run.
``pytest -s`` prints the tables (shared memory, registers, stack, STL/LDL, atomics, stages).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from dmltrain import kernel_compile as kc

SOFTMAX = "dmltrain.distributed.softmax_kernels"
#: the GPU machine's Triton, beside site-packages (the Makefile's TRITON_SIDE)
DEVICE_TRITON = Path(sys.prefix) / "triton-3.6.0"
#: Triton's cache folder of each ``compiled`` fixture, by its param: a later compile of a variant it holds is a hit
_CACHES: dict[str, str] = {}


@pytest.fixture(scope="module", params=["pinned", "device"])
def compiled(request, tmp_path_factory):
    """{(name, arch): CompileResult} of the covering set, with every module's variants: with this environment's
    Triton for sm_80 and sm_90, and with the GPU machine's for sm_90."""
    why = kc.tools_missing()
    if why:
        pytest.skip(why)
    triton_dir, archs = (None, kc.ARCHS) if request.param == "pinned" else (str(DEVICE_TRITON), (90,))
    if triton_dir and not DEVICE_TRITON.is_dir():
        pytest.skip(f"no {DEVICE_TRITON}: `make setup` installs the GPU machine's Triton there")
    variants = {m: kc.module_variants(m) for m in kc.KERNEL_MODULES}
    jobs = [(m, v.name, a) for m in kc.KERNEL_MODULES for a in archs for v in kc.covering(variants[m].values())]
    t0 = time.perf_counter()
    cache = _CACHES[request.param] = str(tmp_path_factory.mktemp("triton-cache"))
    results = kc.compile_many(jobs, workers=2, cache_dir=cache, triton_dir=triton_dir)
    by_name = {n: v for vs in variants.values() for n, v in vs.items()}
    cpu = sum(r.cpu_seconds for r in results)
    print(
        f"\n{kc.format_results(results, by_name)}\n{len(results)} compiles with Triton {results[0].triton} in "
        f"{time.perf_counter() - t0:.1f} s ({cpu:.0f} s CPU)"
    )
    if triton_dir:
        assert {r.triton for r in results} == {"3.6.0"}, "the side Triton was not the one that compiled"
    return {(r.name, r.arch): r for r in results}, by_name


#: the launcher's reading of a binary (``softmax_kernels._programs``) on an offline compile: Triton's ``warmup`` as the
#: launcher calls it, and the ``CompiledKernel`` it returns, with the load that sets its registers (``_init_handles``,
#: which needs a GPU) standing in with the cubin's own count
_READ_BINARY = r"""
import inspect, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime.jit import JITFunction
from dmltrain import kernel_compile as kc
from dmltrain.kernel_occupancy import resources

grid = inspect.signature(JITFunction.warmup).parameters["grid"]
assert grid.kind is inspect.Parameter.KEYWORD_ONLY, grid
variant = kc.module_variants("dmltrain.distributed.softmax_kernels")[sys.argv[1]]
target = GPUTarget("cuda", 90, 32)
src, options = kc.launch_source(variant, target)
compiled = triton.compile(src, target=target, options=options)
assert getattr(compiled, "n_regs", None) is None, "registers known before the binary is loaded"
assert "self.n_regs" in inspect.getsource(type(compiled)._init_handles), "the load no longer sets n_regs"
regs, _ = kc.resource_usage(compiled.asm["cubin"], compiled.metadata.name)
compiled._init_handles = lambda: setattr(compiled, "n_regs", regs)
print("READ " + json.dumps([triton.__version__, resources(compiled), [regs, compiled.metadata.shared]]))
"""


def test_the_launcher_reads_each_tritons_binary(compiled, request):
    """The split count's registers and shared memory (``kernel_occupancy.resources``) read off a ``CompiledKernel`` of
    Triton 3.8 and of the GPU machine's 3.6 alike: the embedding-gradient kernel at D = 128 for sm_90 compiled as a
    launch builds it, its registers learnt at load (as on a GPU), its shared memory from its metadata; with the
    pinned Triton, the roofline's recorded binary (two CTAs per SM on an H100). In the ``compiled`` fixture's Triton
    cache: the covering set usually holds the variant already."""
    import json
    import os
    import subprocess

    from dmltrain.distributed import roofline
    from dmltrain.kernel_occupancy import occupancy

    which = request.node.callspec.params["compiled"]
    side = [str(DEVICE_TRITON)] if which == "device" else []
    repo = str(Path(__file__).resolve().parents[1])
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=os.pathsep.join([*side, repo]), TRITON_CACHE_DIR=_CACHES[which])
    name = "_grad_x_kernel D=128 bf16 normalized 64×32×32 w8 s2"
    proc = subprocess.run([sys.executable, "-c", _READ_BINARY, name], env=env, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    version, used, want = json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("READ "))[5:])
    assert version == ("3.6.0" if side else __import__("triton").__version__)
    assert used == want and used[1] > 0
    if not side:
        assert tuple(used) == roofline.COMPILED[("_grad_x_kernel", "64×32×32 w8 s2", 90, 128)]
        assert occupancy(roofline.GPUS["h100"].sm, tuple(used), 8) == 2


def test_variant_lists_name_every_argument():
    """Each variant types every argument of its kernel once and gives every constexpr a value; the
    softmax list holds every candidate config of each kernel at its precision."""
    pytest.importorskip("triton")
    from dmltrain.distributed import softmax_kernels as sk

    for module in kc.KERNEL_MODULES:
        for v in kc.module_variants(module).values():
            assert set(v.signature) == set(v.fn.arg_names), v.name
            assert {k for k, t in v.signature.items() if t == "constexpr"} == set(v.constexprs), v.name
    variants = kc.module_variants(SOFTMAX).values()
    for (kind, precision), configs in sk._CONFIGS.items():
        for cfg in configs:
            assert any(
                v.kernel == f"_{kind}_kernel"
                and v.config == sk._tiles(cfg)
                and v.constexprs["PREC"] == sk.PREC_CODE[precision]
                for v in variants
            ), (kind, precision, cfg)


def test_covering_takes_every_config_and_every_value():
    pytest.importorskip("triton")
    for module in kc.KERNEL_MODULES:
        variants = list(kc.module_variants(module).values())
        chosen = kc.covering(variants)
        for kernel in {v.kernel for v in variants}:
            mine = [v for v in variants if v.kernel == kernel]
            picked = [v for v in chosen if v.kernel == kernel]
            assert {v.config for v in picked} == {v.config for v in mine}, kernel
            assert len({v.name for v in picked}) == len(picked), kernel
            assert set().union(*(v.flags() for v in picked)) == set().union(*(v.flags() for v in mine)), kernel
            for config in {v.config for v in mine}:  # where a spill would show first
                top = max(v.pressure for v in mine if v.config == config)
                assert any(v.pressure == top for v in picked if v.config == config), (kernel, config)


def test_every_kernel_compiles_for_a100_and_h100_within_its_contract(compiled):
    """Compiles, no spill where none is allowed (stack frame, STL/LDL: every tensor-core variant, the
    evaluation kernels), loads pipelined with ``cp.async`` and (sm_90) ``wgmma`` in the product kernels, the
    Hamming kernel on the hardware popc."""
    results, variants = compiled
    bad = kc.problems(list(results.values()), variants)
    assert not bad, "\n".join(bad)
    for module in kc.KERNEL_MODULES:
        assert any(r.module == module for r in results.values())
    evaluation = [r for r in results.values() if r.module == "dmltrain.evaluate.gpu_kernels"]
    assert evaluation and all(r.stack == 0 and not variants[r.name].spills_allowed for r in evaluation)


def test_the_classifier_kernels_use_no_atomics(compiled):
    """No global reduction or atomic (``RED``/``ATOM`` in the SASS) in any classifier kernel: the backward's
    accumulators are held on chip and each output written once, so its sums run in a fixed order."""
    results, _ = compiled
    used = [(r.name, r.arch, r.atomics) for r in results.values() if r.module == SOFTMAX and r.atomics]
    assert not used, used


def test_the_roofline_models_occupancy_from_these_binaries(compiled, request):
    """The roofline model's recorded backward binaries (``roofline.COMPILED``, by width) are what this Triton
    compiles today for the widths the covering set holds: a kernel change that moves its registers or shared
    memory must re-record them (``python -m dmltrain.kernel_compile --all --kernel NAME``)."""
    if request.node.callspec.params["compiled"] != "pinned":
        pytest.skip("recorded with the pinned Triton")
    from dmltrain.distributed.roofline import COMPILED

    results, _ = compiled
    rest = {
        "_grad_x_kernel": "",
        "_grad_w_kernel": "fp32 weight rows=False write_w=True write_b=False accumulate=False ",
        "_stage_rows_kernel": "fp32 weight rows=False write_w=True write_b=False accumulate=False ",
    }
    checked = []
    for (kernel, tiles, arch, D), (regs, shared) in COMPILED.items():
        got = results.get((f"{kernel} D={D} bf16 normalized {rest.get(kernel, '')}{tiles}", arch))
        if kernel in rest and got is not None:
            checked.append((kernel, D, arch, (got.registers, got.shared), (regs, shared)))
    assert checked, "no recorded binary is in the covering set: the names drifted"
    assert all(got == want for *_, got, want in checked), checked


def test_shared_memory_fits_each_architecture(compiled):
    """Every candidate config of every kernel fits both chips' shared memory, so neither ever has to go
    without one of them (a config that did not fit would be skipped at launch: next test)."""
    results, _ = compiled
    over = [(r.name, r.arch, r.shared) for r in results.values() if not r.fits]
    assert not over, over


def test_the_tuner_never_chooses_a_config_the_device_cannot_run(tmp_path):
    """What Triton refuses to launch (its OutOfResources: shared memory or registers beyond the device's) is
    timed as infinitely slow, so it is pruned; when no candidate fits, one line says so."""
    pytest.importorskip("triton")
    from triton.runtime.errors import OutOfResources

    from dmltrain.kernel_tuning import LaunchConfig, Tuner, time_launch

    small, wide = LaunchConfig.of(4, 2, BLOCK_B=64), LaunchConfig.of(8, 3, BLOCK_B=256)

    def launch(cfg):
        if cfg is wide:
            raise OutOfResources(294_912, 232_448, "shared memory")

    def bench(fn, **_):  # the wide config would be the faster one, if it could run
        fn()
        return 1.0

    tuner = Tuner("H100", "3.8", tmp_path)
    assert time_launch(launch, wide, bench=bench) == float("inf")
    assert tuner.choose("lse", (512,), [wide, small], lambda c: time_launch(launch, c, bench=bench)) is small
    with pytest.raises(RuntimeError, match="lse: none of its 1 tile configs fits this GPU"):
        Tuner("H100", "3.8", tmp_path / "other").choose(
            "lse", (512,), [wide], lambda c: time_launch(launch, c, bench=bench)
        )


class _Recorder:
    """Stands in for a kernel: ``kernel[grid](*args, **kwargs)`` records the launch and runs nothing."""

    def __init__(self, fn, launches):
        self.fn, self.launches = fn, launches

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((self.fn, args, kwargs))


def _softmax_launches(monkeypatch, N: int, classes: int, D: int, drawn: int | None, normalized: bool, det: bool):
    """Every kernel launch of one forward and backward of the fused path, recorded on the CPU (no kernel runs:
    the launchers' own tensors and integers, which is all the specialisation depends on)."""
    import torch

    from dmltrain.distributed import softmax_kernels as sk
    from dmltrain.distributed.row_sparse import RowGrads, RowSet
    from dmltrain.distributed.shard_operands import ShardOperands

    launches: list = []
    for name in ("_lse_kernel", "_grad_x_kernel", "_grad_w_kernel", "_copy_rows_kernel", "_probs_kernel",
                 "_stage_rows_kernel"):  # fmt: skip
        monkeypatch.setattr(sk, name, _Recorder(getattr(sk, name), launches))
    weight = torch.nn.Parameter(torch.randn(classes, D))
    bias = None if normalized else torch.nn.Parameter(torch.zeros(classes))
    rows = None if drawn is None else torch.randperm(classes)[:drawn]
    count = None if drawn is None else torch.tensor(drawn - 3)
    x = torch.nn.functional.normalize(torch.randn(N, D), dim=1)
    tcol = torch.randint(-1, drawn or classes, (N,))
    op = ShardOperands(x, weight, bias, rows, count, tcol, 20.0, normalized)
    lse, _, _, saved = sk.partials(op, not normalized, "bf16", det)
    target = RowGrads({"weight": weight, "bias": bias}).target(RowSet(rows, count))
    sk.gradients(op, saved, lse, torch.tensor(1.0), None, True, target, "bf16", det)
    return launches


@pytest.mark.parametrize(
    "N, classes, D, drawn, normalized, det",
    [
        (32, 64, 128, 48, True, False),  # every size a multiple of 16: the benchmark shapes' binaries
        (32, 96, 256, None, False, True),
        (20, 50, 512, 24, True, True),  # a ragged batch and draw
        (20, 50, 512, None, False, False),
    ],
)
def test_the_offline_variants_are_the_binaries_a_launch_compiles(monkeypatch, N, classes, D, drawn, normalized, det):
    """Each launch the fused path makes, put through Triton's own launch binder (as ``JITFunction.run`` does),
    specialises its arguments (types, 16-byte alignment, integers divisible by 16) exactly as one of the
    offline variants of that kernel and those constants does: the compile tests measure the binaries that run.
    Compiling without the launch's specialisation once measured other binaries (scalar loads, one stage)."""
    pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget

    from dmltrain.distributed import softmax_kernels as sk

    if sk.INTERPRET:
        pytest.skip("this process imported the kernels under TRITON_INTERPRET")
    tiles = {"BLOCK_B", "BLOCK_C", "BLOCK_K", "BLOCK_D", "BLOCK_R", "num_warps", "num_stages"}
    variants = list(kc.module_variants(SOFTMAX).values())
    target = GPUTarget("cuda", 90, 32)
    launches = _softmax_launches(monkeypatch, N, classes, D, drawn, normalized, det)
    staged = {"_probs_kernel", "_stage_rows_kernel"} if sk.staged_backward("bf16", D, det) else set()
    fused = set() if staged else {"_grad_x_kernel", "_grad_w_kernel"}
    assert {fn.__name__ for fn, _, _ in launches} == {"_lse_kernel", "_copy_rows_kernel", *staged, *fused}
    for fn, args, kwargs in launches:
        got = _bound(fn, args, kwargs, target)
        consts = {k: v for k, v in kwargs.items() if k not in tiles}
        mine = [v for v in variants if v.fn is fn and {k: v.constexprs[k] for k in consts} == consts]
        assert mine, f"{fn.__name__} {consts}: no offline variant has these constants"
        offline = {_source_key(kc.launch_source(v, target)[0]) for v in mine}
        assert got in offline, f"{fn.__name__} {consts}: launched as {got}, offline {offline}"


def _bound(fn, args, kwargs, target):
    from triton.compiler.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    _, signature, _, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
    return _source_key_of(signature, attrs)


def _source_key(src):
    return _source_key_of(src.signature, src.attrs)


def _source_key_of(signature, attrs):
    """The argument types and the attributes (alignment, divisibility) of a compile, as a comparable value."""
    types = tuple((k, v) for k, v in signature.items() if v != "constexpr")
    marks = tuple(sorted((k, tuple(map(tuple, v))) for k, v in attrs.items() if v))
    return types, marks
