"""``dmltrain bench``: each benchmark lives beside the code it measures.

Every benchmark prints its figures and, on its last line, the ratio to a bound or a peer
measured in the same run. None of them asserts a time: they report.
"""

from __future__ import annotations

import argparse
import importlib

BENCHES: dict[str, tuple[str, str]] = {
    "input": ("shards.bench", "shard streaming with train augmentation vs torchvision ImageFolder + DataLoader"),
    "losses": ("dmltrain.losses.bench", "forward+backward time of every instance loss"),
    "classifier": ("dmltrain.distributed.bench", "sharded classifier step time and peak memory vs its GEMM bound"),
    "eval": ("dmltrain.evaluate.bench", "retrieval metrics time vs the bare similarity GEMM"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench", required=True, metavar="BENCH")
    for name, (module, help_text) in BENCHES.items():
        p = sub.add_parser(name, help=help_text, description=help_text[0].upper() + help_text[1:] + ".")
        p.set_defaults(_bench_module=module)
        importlib.import_module(module).add_arguments(p)


def run(args: argparse.Namespace) -> int:
    return int(importlib.import_module(args._bench_module).run(args) or 0)
