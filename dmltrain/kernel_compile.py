"""Every Triton kernel of the project, as the variants its launchers can compile, and their offline compile.

The CPU interpreter accepts kernels a real compile rejects (shared memory beyond the chip's limit,
register spills, shapes ``tl.dot`` refuses), so each module that defines Triton kernels lists, in a
``compile_variants()`` function, every (autotune config × constexpr combination × argument dtypes) its
launchers can pass. :func:`compile_variant` builds one for a real GPU architecture with the ptxas that
ships with Triton, no GPU needed, and reads what the cubin uses: shared memory (Triton's metadata: it is
all dynamic), registers and the per-thread stack frame (``cuobjdump --dump-resource-usage``, also shipped
with Triton), and counts the SASS instructions that matter (``cuobjdump -sass``: local-memory stores and
loads, ``STL``/``LDL``, which in these kernels are register spills, and global atomics).

The binary is the one a launch compiles: the arguments go through Triton's own launch binder
(:func:`launch_source`), so the compile gets the specialisation a launch gets — every pointer 16-byte
aligned (torch's allocations are; a test checks the launchers pass no other) and every integer that is a
multiple of 16 marked so (``KernelVariant.divisible``), which turns scalar loads into vectorised ones,
enables ``cp.async`` pipelining and changes the register allocation. Without it the offline compile
measured other binaries than the ones that run.

The full list is long (about 470 compiles per architecture for today's softmax kernels, 0.5-7 s
each), so the test suite compiles :func:`covering` of it: every autotune config of every kernel once per
architecture, the flag and dtype values spread over the configs so that each value occurs at least once
per kernel. ``python -m dmltrain.kernel_compile --all`` compiles everything and prints the table;
``--triton DIR`` compiles with the Triton installed in ``DIR`` instead (the GPU machine's version).

A config that does not fit a device is never launched there: the launchers' tuner skips what Triton
refuses to launch (:func:`dmltrain.kernel_tuning.time_launch`), and the tests check every candidate
fits both architectures.

Nothing here imports Triton at module level: the compile workers import it themselves, without
``TRITON_INTERPRET`` (under the interpreter the kernels are not compiled objects at all).
"""

from __future__ import annotations

import argparse
import functools
import importlib
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

#: modules defining Triton kernels; each exposes ``compile_variants() -> list[KernelVariant]``
KERNEL_MODULES = (
    "dmltrain.distributed.softmax_kernels",
    "dmltrain.evaluate.gpu_kernels",
)

#: the largest dynamic shared memory one block may opt into, bytes, by compute capability (CUDA C++
#: Programming Guide, "Technical Specifications per Compute Capability"): the SM's shared memory
#: capacity less the 1 KB the system keeps; A100 (8.0) 164 - 1 KB, H100 (9.0) 228 - 1 KB, 8.6/8.9 100 - 1 KB.
SHARED_MEMORY_LIMITS = {80: 163 * 1024, 86: 99 * 1024, 87: 163 * 1024, 89: 99 * 1024, 90: 227 * 1024}
#: the architectures the test suite compiles for: A100 and H100
ARCHS = (80, 90)
#: Triton's pointer element types -> torch dtype names (the launch stand-ins' dtypes)
_TORCH_DTYPES = {
    "fp32": "float32",
    "fp16": "float16",
    "bf16": "bfloat16",
    "i64": "int64",
    "i32": "int32",
    "i16": "int16",
    "i8": "int8",
    "u8": "uint8",
}


@dataclass(frozen=True)
class KernelVariant:
    """One compile of one kernel: the argument types and the compile-time constants a launcher passes.

    ``name`` says which kernel, flags and tile this is (it names the test case; unique within its
    module); ``signature`` maps each argument to its Triton type (``"*fp32"``, ``"i32"``,
    ``"constexpr"``); ``constexprs`` holds the constexpr values, tile sizes included.
    ``spills_allowed`` is for a variant whose design accepts register spills; the module says why
    where it sets it, and ``max_stack_bytes`` bounds the stack frame it may reach (None: unbounded).
    ``config`` names the autotune config (or fixed tile) the variant compiles: variants that share
    it differ only in flags and dtypes (:func:`covering` picks among them); ``tags`` name what a
    launcher's path adds beyond single values (``"write=via scratch"``), for the covering to cover too.
    ``pressure`` ranks a config's variants by the registers they are expected to need (how many costly paths
    they turn on); :func:`covering` also takes each config's highest, where spills would show first.
    ``ptx_has`` lists instructions the PTX must contain on every architecture (``"popc.b32"``: the hardware
    bit count), ``hopper_ptx_has`` those it must contain on sm_90 (``"wgmma.mma_async"``: the Hopper tensor
    cores). ``divisible``: the launch's integer arguments are multiples of 16 (as at every benchmark shape);
    False compiles the binary a ragged size gets, where only the integers named in ``aligned_ints`` (offsets
    that are multiples of 16 whatever the sizes) still are.
    """

    name: str
    fn: Callable[..., Any]
    signature: dict[str, str]
    constexprs: dict[str, Any]
    num_warps: int = 4
    num_stages: int = 3
    spills_allowed: bool = False
    max_stack_bytes: int | None = None
    config: str = ""
    tags: tuple[str, ...] = ()
    ptx_has: tuple[str, ...] = ()
    hopper_ptx_has: tuple[str, ...] = ()
    divisible: bool = True
    aligned_ints: tuple[str, ...] = ()
    pressure: int = 0

    @property
    def kernel(self) -> str:
        """The kernel's function name."""
        return getattr(self.fn, "__name__", None) or self.fn.fn.__name__

    def flags(self) -> frozenset[tuple[str, Any]]:
        """The (argument, value or type) pairs that tell this variant from the others of its config."""
        types = {(k, v) for k, v in self.signature.items() if v != "constexpr"}
        extra = {("tag", t) for t in self.tags} | {("divisible", self.divisible)}
        return frozenset(types | set(self.constexprs.items()) | extra)

    def ptx_needs(self, arch: int) -> tuple[str, ...]:
        """The instructions this variant's PTX must hold on ``sm_{arch}``."""
        return self.ptx_has + (self.hopper_ptx_has if arch >= 90 else ())

    def launch_arguments(self) -> list[Any]:
        """Stand-ins for what a launcher passes, in the kernel's argument order: a mock tensor of the declared
        dtype at an aligned address for each pointer, an integer (a multiple of 16 when ``divisible``) for each
        integer, a float for each float, the value of each constexpr."""
        import torch
        from triton.runtime.jit import MockTensor

        out: list[Any] = []
        for name in self.fn.arg_names:
            kind = self.signature[name]
            if kind == "constexpr":
                out.append(self.constexprs[name])
            elif kind.startswith("*"):
                out.append(MockTensor(getattr(torch, _TORCH_DTYPES[kind[1:]])))  # data_ptr() 0: aligned
            elif kind.startswith(("i", "u")):  # never 1: Triton makes a 1 a constant
                out.append(1024 if self.divisible or name in self.aligned_ints else 1000)
            else:
                out.append(0.5)
        return out


@dataclass(frozen=True)
class CompileResult:
    """What one variant compiled to for one architecture; ``error`` is non-empty when the compile failed."""

    name: str
    module: str
    arch: int
    shared: int = 0
    registers: int = 0
    stack: int = 0
    seconds: float = 0.0
    error: str = ""
    ptx_missing: tuple[str, ...] = ()
    cpu_seconds: float = 0.0  # this process's and its children's (ptxas, cuobjdump): comparable on a busy machine
    spill_stores: int = 0  # STL instructions in the SASS
    spill_loads: int = 0  # LDL
    loop_spills: int = 0  # of those, inside an innermost loop
    atomics: int = 0  # RED(G) and ATOM(G): global reductions and atomics
    stages: int = 0  # the software-pipelining stages Triton kept
    triton: str = ""  # the Triton version that compiled it

    @property
    def limit(self) -> int:
        return SHARED_MEMORY_LIMITS[self.arch]

    @property
    def fits(self) -> bool:
        return self.shared <= self.limit


def all_variants() -> list[KernelVariant]:
    """Every variant of every kernel module (imports Triton)."""
    out: list[KernelVariant] = []
    for name in KERNEL_MODULES:
        out.extend(module_variants(name).values())
    return out


@functools.cache
def module_variants(module: str) -> dict[str, KernelVariant]:
    """``module``'s variants by name (its ``compile_variants()``, called once per process)."""
    variants = importlib.import_module(module).compile_variants()
    by_name = {v.name: v for v in variants}
    if len(by_name) != len(variants):
        seen: set[str] = set()
        dup = next(v.name for v in variants if v.name in seen or seen.add(v.name))
        raise ValueError(f"{module}.compile_variants(): the name {dup!r} is used twice")
    return by_name


# -- one compile ---------------------------------------------------------------------------------------
def tools_missing() -> str | None:
    """Why this Triton cannot compile for NVIDIA GPUs here (its ptxas or cuobjdump missing), else None."""
    try:
        from triton import knobs

        knobs.nvidia.ptxas.path  # noqa: B018 — resolving the tool runs it (`--version`): that is the check
        knobs.nvidia.cuobjdump.path  # noqa: B018 — likewise
    except (ImportError, AttributeError, RuntimeError) as e:
        return f"Triton cannot compile for CUDA here: {e}"
    return None


def resource_usage(cubin: bytes, kernel: str) -> tuple[int, int]:
    """(registers per thread, stack bytes per thread) of ``kernel`` in a cubin, read by ``cuobjdump``."""
    from triton import knobs

    with tempfile.TemporaryDirectory(prefix="dmltrain-cubin-") as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        out = subprocess.run(
            [knobs.nvidia.cuobjdump.path, "--dump-resource-usage", path], capture_output=True, text=True, check=True
        ).stdout
    # " Function _lse_kernel:\n  REG:255 STACK:408 SHARED:0 LOCAL:0 ..."
    lines = out.splitlines()
    for i, line in enumerate(lines[:-1]):
        if line.strip() == f"Function {kernel}:":
            fields = dict(item.split(":", 1) for item in lines[i + 1].split() if ":" in item)
            return int(fields["REG"]), int(fields["STACK"])
    raise RuntimeError(f"cuobjdump: no resource usage for {kernel} in:\n{out}")


#: the stack a variant that may not spill can still hold outside its innermost loops: ptxas sometimes keeps a
#: loop-invariant word or two in local memory (L1-resident, read once per outer iteration or never in a loop)
#: rather than give up a second block per SM; one inside an innermost loop is a spill that costs
SPILL_OUTSIDE_LOOPS_BYTES = 32
_SASS = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9]*)([^;]*);")


def sass_counts(cubin: bytes) -> dict[str, int]:
    """How many local-memory stores and loads (``STL``, ``LDL``; ``loop_spills``: those inside an innermost loop,
    the ranges between a backward branch and its target that hold no other) and global reductions and atomics
    (``RED``/``REDG``, ``ATOM``/``ATOMG``: sm_90 names them with the G) the cubin's SASS holds
    (``cuobjdump -sass``)."""
    from triton import knobs

    with tempfile.TemporaryDirectory(prefix="dmltrain-cubin-") as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        out = subprocess.run(
            [knobs.nvidia.cuobjdump.path, "-sass", path], capture_output=True, text=True, check=True
        ).stdout
    # "        /*0130*/                   STL.64 [R1+0x8], R4 ;" — address, optional predicate, opcode, operands
    code = [(int(m.group(1), 16), m.group(2), m.group(3)) for m in _SASS.finditer(out)]
    loops = []
    for addr, op, rest in code:
        target = re.search(r"0x([0-9a-f]+)", rest) if op == "BRA" else None
        if target and int(target.group(1), 16) < addr:
            loops.append((int(target.group(1), 16), addr))
    inner = [lp for lp in loops if not any(o != lp and lp[0] <= o[0] and o[1] <= lp[1] for o in loops)]
    counts = dict.fromkeys(("STL", "LDL", "RED", "REDG", "ATOM", "ATOMG"), 0)
    counts["loop_spills"] = 0
    for addr, op, _ in code:
        if op in counts:
            counts[op] += 1
        if op in ("STL", "LDL") and any(a <= addr <= b for a, b in inner):
            counts["loop_spills"] += 1
    return counts


def launch_source(variant: KernelVariant, target: Any) -> tuple[Any, dict[str, Any]]:
    """(Triton source, compile options) of ``variant`` as a launch on ``target`` builds them: its stand-in
    arguments through the kernel's own launch binder, so signature, constants and the alignment and
    divisibility attributes are the ones the runtime compiles with."""
    from triton.compiler import ASTSource
    from triton.compiler.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    fn = variant.fn
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    kwargs = {"num_warps": variant.num_warps, "num_stages": variant.num_stages}
    bound, specialization, options = binder(*variant.launch_arguments(), **kwargs)
    # the same packing JITFunction.run does before it compiles (Triton 3.6 and 3.8 alike)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
    declared = {a: variant.signature[a] for a in fn.arg_names if variant.signature[a] != "constexpr"}
    bound_types = {a: t for a, t in signature.items() if t != "constexpr"}
    if bound_types != declared:
        raise ValueError(f"{variant.name}: declared argument types {declared} but a launch binds {bound_types}")
    return ASTSource(fn, signature, constexprs, attrs), options.__dict__


def compile_variant(variant: KernelVariant, arch: int, module: str = "") -> CompileResult:
    """Compile ``variant`` for ``sm_{arch}`` as a launch would (:func:`launch_source`; Triton's cache applies);
    a compile error is kept, one line."""
    import triton
    from triton.backends.compiler import GPUTarget

    from dmltrain.text import one_line

    t0, cpu0 = time.perf_counter(), _cpu_seconds()
    try:
        target = GPUTarget("cuda", arch, 32)
        src, options = launch_source(variant, target)
        compiled = triton.compile(src, target=target, options=options)
        regs, stack = resource_usage(compiled.asm["cubin"], compiled.metadata.name)
        sass = sass_counts(compiled.asm["cubin"])
    except Exception as e:  # noqa: BLE001 — any compiler failure is this variant's result, reported in the table
        return CompileResult(
            variant.name, module, arch, seconds=time.perf_counter() - t0, error=one_line(e), triton=triton.__version__
        )
    missing = tuple(i for i in variant.ptx_needs(arch) if i not in compiled.asm["ptx"])
    shared, cpu = int(compiled.metadata.shared), _cpu_seconds() - cpu0
    return CompileResult(
        variant.name,
        module,
        arch,
        shared,
        regs,
        stack,
        time.perf_counter() - t0,
        ptx_missing=missing,
        cpu_seconds=cpu,
        spill_stores=sass["STL"],
        spill_loads=sass["LDL"],
        loop_spills=sass["loop_spills"],
        atomics=sum(sass[k] for k in ("RED", "REDG", "ATOM", "ATOMG")),
        stages=int(getattr(compiled.metadata, "num_stages", 0)),
        triton=triton.__version__,
    )


def _cpu_seconds() -> float:
    import resource

    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


# -- many compiles, in worker processes ----------------------------------------------------------------
def _worker_init(cache_dir: str | None, triton_dir: str | None = None) -> None:
    os.environ.pop("TRITON_INTERPRET", None)  # before any kernel module is imported here
    if cache_dir:
        os.environ["TRITON_CACHE_DIR"] = cache_dir
    if triton_dir:  # another Triton: ahead of the environment's, before anything imports it
        sys.path.insert(0, triton_dir)


def _compile_named(module: str, name: str, arch: int) -> CompileResult:
    return compile_variant(module_variants(module)[name], arch, module)


def compile_many(
    jobs: Sequence[tuple[str, str, int]],
    workers: int = 2,
    cache_dir: str | None = None,
    progress: Callable[[CompileResult], None] | None = None,
    triton_dir: str | None = None,
) -> list[CompileResult]:
    """Compile ``(module, variant name, arch)`` jobs in ``workers`` fresh processes (spawned: the
    caller's Triton may be the interpreter), Triton's cache in ``cache_dir`` (None: its default), with the
    Triton installed in ``triton_dir`` when given (else the environment's).
    Results come back in the order of ``jobs``; ``progress`` sees each as it finishes."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed

    ctx = multiprocessing.get_context("spawn")
    init = (cache_dir, triton_dir)
    with ProcessPoolExecutor(max(1, workers), mp_context=ctx, initializer=_worker_init, initargs=init) as pool:
        futures = {pool.submit(_compile_named, *job): i for i, job in enumerate(jobs)}
        out: list[CompileResult | None] = [None] * len(jobs)
        for fut in as_completed(futures):
            out[futures[fut]] = res = fut.result()
            if progress is not None:
                progress(res)
    return [r for r in out if r is not None]


# -- what the suite compiles -----------------------------------------------------------------------------
def covering(variants: Iterable[KernelVariant]) -> list[KernelVariant]:
    """One variant per (kernel, config), chosen greedily so that every flag, dtype and tag value of each kernel
    occurs at least once (more variants where a kernel has fewer configs than values); among equals the
    first listed, so a module lists each config's default path first. Then each config's variant of highest
    ``pressure`` (the first of equals), where it was not taken already: the one most likely to spill."""
    by_kernel: dict[str, dict[str, list[KernelVariant]]] = {}
    for v in variants:
        by_kernel.setdefault(v.kernel, {}).setdefault(v.config or v.name, []).append(v)
    chosen: list[KernelVariant] = []
    for groups in by_kernel.values():
        todo = set().union(*(v.flags() for g in groups.values() for v in g))
        picked: set[str] = set()
        pools = list(groups.values())
        while pools:
            for group in pools:
                best = max(group, key=lambda v: len(v.flags() & todo))  # the first of equals: deterministic
                chosen.append(best)
                picked.add(best.name)
                todo -= best.flags()
            # values still missing: another round over the variants not yet taken
            pools = [[v for g in groups.values() for v in g if v.name not in picked]] if todo else []
        for group in groups.values():
            heaviest = max(group, key=lambda v: v.pressure)
            if heaviest.pressure and heaviest.name not in picked:
                chosen.append(heaviest)
                picked.add(heaviest.name)
    return chosen


# -- the table ------------------------------------------------------------------------------------------
def result_rows(results: Sequence[CompileResult], variants: dict[str, KernelVariant]) -> list[list[Any]]:
    """Table rows: variant, arch, shared bytes, limit, registers, stack bytes, STL/LDL, atomics, stages, verdict."""
    rows = []
    for r in results:
        v = variants.get(r.name)
        if r.error:
            verdict = f"FAILED: {r.error}"
        else:
            parts = ["fits" if r.fits else "over the limit: pruned"]
            if r.stack:
                bound = "" if v is None or v.max_stack_bytes is None else f" (bound {v.max_stack_bytes:,})"
                allowed = v is not None and (
                    v.spills_allowed or not r.loop_spills and r.stack <= SPILL_OUTSIDE_LOOPS_BYTES
                )
                parts.append(
                    (
                        "spills, allowed"
                        if v is not None and v.spills_allowed
                        else "spills outside the loops"
                        if allowed
                        else "SPILLS"
                    )
                    + bound
                )
            verdict = "; ".join(parts)
        rows.append(
            [
                r.name,
                f"sm_{r.arch}",
                f"{r.shared:,}",
                f"{r.limit:,}",
                r.registers,
                f"{r.stack:,}",
                f"{r.spill_stores}/{r.spill_loads} ({r.loop_spills})",
                r.atomics,
                r.stages,
                verdict,
            ]
        )
    return rows


RESULT_HEAD = (
    "variant",
    "arch",
    "shared B",
    "limit B",
    "regs",
    "stack B",
    "STL/LDL (in loops)",
    "atomics",
    "stages",
    "verdict",
)


def format_results(results: Sequence[CompileResult], variants: dict[str, KernelVariant]) -> str:
    from dmltrain.text import markdown_table

    return markdown_table(RESULT_HEAD, result_rows(results, variants))


def problems(results: Sequence[CompileResult], variants: dict[str, KernelVariant]) -> list[str]:
    """One line per result that breaks its contract: a failed compile, PTX without an instruction it must hold,
    a spill where none is allowed (any ``STL``/``LDL`` in an innermost loop, or a stack frame over
    :data:`SPILL_OUTSIDE_LOOPS_BYTES`), a stack frame past the variant's bound. (Shared memory over a limit
    is the pruning's business.)"""
    out = []
    for r in results:
        v = variants[r.name]
        where = f"{r.name} sm_{r.arch}"
        if r.error:
            out.append(f"{where}: compile failed: {r.error}")
        elif r.ptx_missing:
            out.append(f"{where}: the PTX lacks {', '.join(r.ptx_missing)}")
        elif not v.spills_allowed and (r.loop_spills or r.stack > SPILL_OUTSIDE_LOOPS_BYTES):
            out.append(
                f"{where}: spills ({r.stack:,} bytes of stack per thread, {r.spill_stores} STL and "
                f"{r.spill_loads} LDL, {r.loop_spills} in an innermost loop, {r.registers} registers)"
            )
        elif v.max_stack_bytes is not None and r.stack > v.max_stack_bytes:
            out.append(f"{where}: stack {r.stack:,} bytes per thread > its bound {v.max_stack_bytes:,}")
    return out


# -- python -m dmltrain.kernel_compile -------------------------------------------------------------------
def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m dmltrain.kernel_compile",
        description="Compile the project's Triton kernels offline for GPU architectures; print shared memory, "
        "registers and spills of each variant.",
    )
    p.add_argument("--arch", type=int, nargs="+", default=list(ARCHS), help="compute capabilities (default 80 90)")
    p.add_argument("--all", action="store_true", help="every variant (default: the covering set the tests compile)")
    p.add_argument("--kernel", default="", help="only variants whose name contains this text")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compile processes (default: CPU cores)")
    p.add_argument("--json", default=None, help="also write the results here as JSON")
    p.add_argument(
        "--triton",
        default=None,
        metavar="DIR",
        help="compile with the Triton installed in DIR (pip install --target DIR triton==3.6.0: the GPU "
        "machine's) instead of this environment's",
    )
    args = p.parse_args(argv)
    for arch in args.arch:
        if arch not in SHARED_MEMORY_LIMITS:
            p.error(f"--arch {arch}: unknown; known: {', '.join(map(str, SHARED_MEMORY_LIMITS))}")
    why = tools_missing()
    if why:
        print(why, file=sys.stderr)
        return 1
    os.environ.pop("TRITON_INTERPRET", None)
    by_module = {m: module_variants(m) for m in KERNEL_MODULES}
    jobs = []
    for m, variants in by_module.items():
        chosen = list(variants.values()) if args.all else covering(variants.values())
        jobs += [(m, v.name, a) for a in args.arch for v in chosen if args.kernel in v.name]
    names = {name: v for variants in by_module.values() for name, v in variants.items()}
    t0 = time.perf_counter()
    done = [0]

    def tick(_: CompileResult) -> None:
        done[0] += 1
        if done[0] % 25 == 0 or done[0] == len(jobs):
            print(f"compiled {done[0]}/{len(jobs)} in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)

    results = compile_many(jobs, args.jobs, progress=tick, triton_dir=args.triton)
    print(format_results(results, names))
    bad = problems(results, names)
    for line in bad:
        print(line)
    cpu = sum(r.cpu_seconds for r in results)
    version = results[0].triton if results else "?"
    print(
        f"{len(results)} compiles with Triton {version} in {time.perf_counter() - t0:.0f} s with {args.jobs} processes "
        f"({cpu:.0f} s of CPU); {len(bad)} problems"
    )
    if args.json:
        from dmltrain.fileio import write_json

        write_json(args.json, [dict(vars(r), limit=r.limit) for r in results])
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
