"""``dmltrain bench NAME``: each benchmark lives beside the code it measures.

Every benchmark prints its figures and, on its last line, the ratio to a bound or a peer
measured in the same run. None of them asserts a time: they report. Only the chosen
benchmark's module is imported.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from types import ModuleType


# Each benchmark's module, imported when it runs (a function per benchmark: lazy, and followable to its code).
def _input() -> ModuleType:
    from shards import bench

    return bench


def _losses() -> ModuleType:
    from dmltrain.losses import bench

    return bench


def _classifier() -> ModuleType:
    from dmltrain.distributed import bench

    return bench


def _eval() -> ModuleType:
    from dmltrain.evaluate import bench

    return bench


def _quality() -> ModuleType:
    from dmltrain import quality_bench

    return quality_bench


def _train() -> ModuleType:
    from dmltrain.training import bench

    return bench


BENCHES: dict[str, tuple[Callable[[], ModuleType], str]] = {
    "input": (_input, "shard streaming with train augmentation vs torchvision ImageFolder + DataLoader"),
    "losses": (
        _losses,
        "forward+backward time of every instance loss vs the similarity GEMM and pytorch-metric-learning",
    ),
    "classifier": (_classifier, "sharded classifier step time and peak memory vs its GEMM bound"),
    "eval": (_eval, "retrieval metrics time vs the bare similarity GEMM"),
    "quality": (_quality, "Recall@1 and wall time of dmltrain train vs a plain PyTorch loop at equal steps"),
    "train": (
        _train,
        "the full training step from shards vs the bare backbone on random tensors: images/s, data wait",
    ),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.description = (
        (parser.description or "")
        + "\n\nbenchmarks:\n"
        + "\n".join(f"  {name:<12}{help_text}" for name, (_, help_text) in BENCHES.items())
        + "\n\n`dmltrain bench NAME --help` shows a benchmark's options."
    )
    parser.add_argument("bench", choices=sorted(BENCHES), metavar="NAME", help="which benchmark: " + ", ".join(BENCHES))
    parser.add_argument("bench_args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)


def bench_parser(name: str) -> argparse.ArgumentParser:
    """The parser of benchmark ``name``'s options (``dmltrain bench NAME --help``; the docs' reference too)."""
    module, help_text = BENCHES[name]
    sub = argparse.ArgumentParser(prog=f"dmltrain bench {name}", description=help_text[0].upper() + help_text[1:] + ".")
    module().add_arguments(sub)
    return sub


def run(args: argparse.Namespace) -> int:
    sub = bench_parser(args.bench)
    return int(BENCHES[args.bench][0]().run(sub.parse_args(args.bench_args)) or 0)
