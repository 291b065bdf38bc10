"""Every Triton kernel of the project compiled offline for an A100 (sm_80) and an H100 (sm_90), no GPU needed.

The interpreter, which the other kernel tests run under, accepts what a real compile rejects. Here
Triton compiles (ptxas ships with it) the covering set of each module's ``compile_variants()``
(:func:`dmltrain.kernel_compile.covering`: every autotune config of every kernel once per
architecture, every flag and dtype value at least once per kernel; ``python -m
dmltrain.kernel_compile --all`` compiles all of them), in two processes with Triton's cache in a
temporary folder, and checks each against its contract: it compiles, it fits the architecture's
shared memory (or the launcher prunes it), it does not spill unless its module allows it, and then
not past today's stack frames. ``pytest -s`` prints the table (shared memory, registers, stack).
"""

from __future__ import annotations

import time

import pytest

from dmltrain import kernel_compile as kc

SOFTMAX = "dmltrain.distributed.softmax_kernels"
#: the forward kernel with fp32 products and weight: its widest config needs 196,608 bytes, over an
#: A100's 166,912 and within an H100's 232,448; with tf32 products 294,912 bytes on sm_90, over both
PRUNE_CASE = "fp32 w=fp32 rows normalized"
OVER_BOTH = "lse 128x256x64 w8 s3 tf32 w=fp32 rows normalized"


def _tile(cfg) -> str:
    k = cfg.kwargs
    return f"{k['BLOCK_B']}x{k['BLOCK_C']}x{k['BLOCK_K']} w{cfg.num_warps} s{cfg.num_stages}"


def _lse_label(cfg) -> str:
    return f"lse {_tile(cfg)}"


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """{(name, arch): CompileResult} of the covering set and the pruning cases, with every module's variants."""
    why = kc.tools_missing()
    if why:
        pytest.skip(why)
    from dmltrain.distributed import softmax_kernels

    variants = {m: kc.module_variants(m) for m in kc.KERNEL_MODULES}
    jobs = [(m, v.name, a) for m in kc.KERNEL_MODULES for a in kc.ARCHS for v in kc.covering(variants[m].values())]
    jobs += [(SOFTMAX, f"{_lse_label(c)} {PRUNE_CASE}", a) for c in softmax_kernels._LSE_CONFIGS for a in kc.ARCHS]
    jobs += [(SOFTMAX, OVER_BOTH, 90)]
    jobs = list(dict.fromkeys(jobs))
    t0 = time.perf_counter()
    results = kc.compile_many(jobs, workers=2, cache_dir=str(tmp_path_factory.mktemp("triton-cache")))
    by_name = {n: v for vs in variants.values() for n, v in vs.items()}
    cpu = sum(r.cpu_seconds for r in results)
    print(
        f"\n{kc.format_results(results, by_name)}\n{len(results)} compiles in {time.perf_counter() - t0:.1f} s ({cpu:.0f} s CPU)"
    )
    return {(r.name, r.arch): r for r in results}, by_name


def test_variant_lists_name_every_argument():
    """Each variant types every argument of its kernel once and gives every constexpr a value; the
    softmax list holds every autotune config of each kernel, at every precision."""
    pytest.importorskip("triton")
    from dmltrain.distributed import softmax_kernels as sk

    for module in kc.KERNEL_MODULES:
        for v in kc.module_variants(module).values():
            assert set(v.signature) == set(v.fn.arg_names), v.name
            assert {k for k, t in v.signature.items() if t == "constexpr"} == set(v.constexprs), v.name
    names = list(kc.module_variants(SOFTMAX))
    for prec in sk.PRECISIONS:
        for cfg in sk._LSE_CONFIGS:
            assert any(n.startswith(_lse_label(cfg) + f" {prec} ") for n in names), (_lse_label(cfg), prec)
        for width, configs in sk._GRAD_CONFIGS.items():
            for cfg in configs:
                for kernel in ("grad_x", "grad_w"):
                    label = f"{kernel} {_tile(cfg)} (D<={width}) {prec} "
                    assert any(n.startswith(label) for n in names), label


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


def test_every_kernel_compiles_for_a100_and_h100_within_its_contract(compiled):
    """Compiles, no spill where none is allowed (the evaluation kernels), no stack frame past today's
    (the softmax kernels: issue 27), the Hamming kernel on the hardware popc."""
    results, variants = compiled
    bad = kc.problems(list(results.values()), variants)
    assert not bad, "\n".join(bad)
    for module in kc.KERNEL_MODULES:
        assert any(r.module == module for r in results.values())
    evaluation = [r for r in results.values() if r.module == "dmltrain.evaluate.gpu_kernels"]
    assert evaluation and all(r.stack == 0 and not variants[r.name].spills_allowed for r in evaluation)


def test_shared_memory_fits_each_architecture(compiled):
    """The covering set fits both chips; only the pruning cases may not (next test)."""
    results, _ = compiled
    over = [r for r in results.values() if not r.fits]
    assert {(r.name, r.arch) for r in over} == {(f"lse 128x256x64 w8 s3 {PRUNE_CASE}", 80), (OVER_BOTH, 90)}, [
        (r.name, r.arch, r.shared) for r in over
    ]


def test_launcher_prunes_the_configs_that_do_not_fit(compiled):
    """The autotune hook keeps exactly the configs whose compiled shared memory fits: the widest fp32
    forward config is dropped for an A100 and kept for an H100; a list where none fits keeps the smallest."""
    torch = pytest.importorskip("torch")
    from dmltrain.distributed import softmax_kernels as sk

    results, _ = compiled
    configs = sk._LSE_CONFIGS
    calls = []

    def offline(arch):
        def shared_of(kernel, named_args, launch, cfg):
            calls.append((kernel, named_args, launch, cfg.all_kwargs()))
            return results[(f"{_lse_label(cfg)} {PRUNE_CASE}", arch)].shared

        return shared_of

    x = torch.zeros(4, 8)
    named = {"x_ptr": x, "w_ptr": x, "N": 4, "K": 4, "D": 8}
    launch = {"HAS_ROWS": True, "NORMALIZED": True, "SUM_LOGITS": False, "PREC": 0, "grid": None, "warmup": False}
    kept = {}
    for arch in kc.ARCHS:
        prune = kc.shared_memory_prune(sk._lse_kernel, limit=kc.SHARED_MEMORY_LIMITS[arch], shared_of=offline(arch))
        kept[arch] = prune(configs, named, **launch)
    widest = configs[3]
    assert widest.kwargs == {"BLOCK_B": 128, "BLOCK_C": 256, "BLOCK_K": 64}
    assert kept[80] == configs[:3] and kept[90] == configs
    kernel, args, given, cfg = calls[0]
    assert kernel is sk._lse_kernel and args is named and "grid" not in given and "warmup" not in given
    assert given["PREC"] == 0 and cfg["num_warps"] == configs[0].num_warps
    assert kc.fitting(configs, [300_000, 250_000, 260_000, 400_000], 232_448) == [configs[1]]

    def broken_widest(kernel, named_args, launch, cfg):
        if cfg is widest:
            raise RuntimeError("PTXASError: ptxas failed")
        return 1024

    prune = kc.shared_memory_prune(sk._lse_kernel, limit=232_448, shared_of=broken_widest)
    assert prune(configs, named, **launch) == configs[:3]  # a config that does not compile is dropped
    if not sk.INTERPRET:  # the launcher wires the hook into its autotuner
        tuner, tiles = sk._launcher("lse", sk._lse_kernel, 0)
        assert tiles == {} and tuner.early_config_prune.__qualname__.startswith("shared_memory_prune")
