"""``dmltrain bench NAME``: each benchmark lives beside the code it measures.

Every benchmark prints its figures and, on its last line, the ratio to a bound or a peer
measured in the same run. None of them asserts a time: they report. Only the chosen
benchmark's module is imported.
"""

from __future__ import annotations

import argparse
import importlib

BENCHES: dict[str, tuple[str, str]] = {
    "input": ("shards.bench", "shard streaming with train augmentation vs torchvision ImageFolder + DataLoader"),
    "losses": (
        "dmltrain.losses.bench",
        "forward+backward time of every instance loss vs the similarity GEMM and pytorch-metric-learning",
    ),
    "classifier": ("dmltrain.distributed.bench", "sharded classifier step time and peak memory vs its GEMM bound"),
    "eval": ("dmltrain.evaluate.bench", "retrieval metrics time vs the bare similarity GEMM"),
    "quality": (
        "dmltrain.quality_bench",
        "Recall@1 and wall time of dmltrain train vs a plain PyTorch loop at equal steps",
    ),
    "train": (
        "dmltrain.training.bench",
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
    module_name, help_text = BENCHES[name]
    sub = argparse.ArgumentParser(prog=f"dmltrain bench {name}", description=help_text[0].upper() + help_text[1:] + ".")
    importlib.import_module(module_name).add_arguments(sub)
    return sub


def run(args: argparse.Namespace) -> int:
    sub = bench_parser(args.bench)
    return int(importlib.import_module(BENCHES[args.bench][0]).run(sub.parse_args(args.bench_args)) or 0)
