"""``dmltrain bench quality`` end to end on tiny synthetic data: a plain loop and a real ``dmltrain train``
(Ray, DeepSpeed over gloo, 2 workers), both evaluated; figures are printed, never asserted."""

from __future__ import annotations

import argparse
import re

import numpy as np
import pytest
import torch

from dmltrain import quality_bench
from dmltrain.errors import UserError


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    quality_bench.add_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.mark.ray
def test_quality_bench_runs_both_trainings(tmp_path, capsys):
    threads = torch.get_num_threads()
    try:
        args = _args(
            "--synthetic",
            "8,6,16",
            "--steps",
            "3",
            "--batch",
            "8",
            "--k",
            "2",
            "--dim",
            "64",
            "--loader-workers",
            "0",
            "--keep",
            str(tmp_path / "work"),
        )
        assert quality_bench.run(args) == 0
    finally:
        torch.set_num_threads(threads)
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("quality bench: synthetic 8 classes x 6 images, 16px") and "3 steps" in lines[0]
    number = r"Recall@1 (\d\.\d{4}) +wall +\d+\.\d s"
    assert lines[1].startswith("plain PyTorch loop") and re.search(number, lines[1])
    assert lines[2].startswith("dmltrain train (Ray + DeepSpeed + shards, 2 workers)") and re.search(number, lines[2])
    assert re.fullmatch(
        r"dmltrain - plain: [+-]\d+\.\d\d points Recall@1 at 3 steps; wall time dmltrain / plain: \d+\.\d\dx", lines[3]
    )
    ms = r"(\d+\.\d|nan) ms"  # a 3-step run logs no step time (its log point is step 50)
    assert re.fullmatch(
        rf"per step: plain {ms}, dmltrain {ms} \((\d+\.\d\d|nan)x\); dmltrain outside its steps .*: (-?\d+\.\d|nan) s",
        lines[4],
    )
    written = (tmp_path / "work" / "dmltrain.yaml").read_text()
    assert (
        "sync_bn: false" in written
        and "zero_stage: 0" in written
        and "max_steps: 3" in written
        and "init_std: 1.0" in written
    )  # what the command ran
    assert "class weights N(0, 1²)" in lines[0]


def test_quality_bench_bad_input_is_one_line(tmp_path):
    for argv, text in (
        (["--shards", str(tmp_path), "--steps", "2"], "holds no manifest.json"),
        (["--synthetic", "8,6", "--steps", "2"], "--synthetic: expected 'classes,per_class,size'"),
        (["--scale", "0.5", "--steps", "2"], "--scale: expected two numbers"),
        (["--steps", "0"], "--steps: must be >= 1"),
        (["--steps", "2", "--class-init-std", "0"], "--class-init-std: must be > 0"),
    ):
        with pytest.raises(UserError, match=re.escape(text)) as e:
            quality_bench.run(_args(*argv))
        assert "\n" not in str(e.value)


def test_plain_loop_is_reproducible_from_its_seed(tmp_path):
    """The plain arm's P×K sampler draws from numpy's global generator: the bench seeds it, so one
    seed gives one set of weights (otherwise its Recall@1 moved by points between identical runs)."""
    args = _args(
        "--synthetic", "8,6,16", "--steps", "4", "--batch", "8", "--k", "2", "--dim", "64", "--loader-workers", "0"
    )
    shard_dir, _, size = quality_bench._data(args, tmp_path)
    cfg = quality_bench._config(args, shard_dir, tmp_path, size, size, (0.5, 1.0))
    trained = []
    for i, seed in enumerate((0, 0, 1)):
        np.random.seed(100 + i)  # what the process drew before must not matter
        model, _ = quality_bench.train_plain(cfg, args.steps, seed)
        trained.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    assert torch.equal(trained[0], trained[1])
    assert not torch.equal(trained[0], trained[2])
