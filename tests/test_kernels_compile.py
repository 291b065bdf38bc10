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


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """{(name, arch): CompileResult} of the covering set and the pruning cases, with every module's variants."""
    why = kc.tools_missing()
    if why:
        pytest.skip(why)
    variants = {m: kc.module_variants(m) for m in kc.KERNEL_MODULES}
    jobs = [(m, v.name, a) for m in kc.KERNEL_MODULES for a in kc.ARCHS for v in kc.covering(variants[m].values())]
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
