"""``dmltrain bench train`` end to end on the CPU: both loops run and it prints its figures and ratio."""

from __future__ import annotations

import json
import re

import pytest
import torch

from dmltrain.cli import main


@pytest.fixture(autouse=True)
def one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_bench_train_smoke_on_cpu(capsys, monkeypatch, tmp_path):
    """Small CNN, tiny synthetic shards, device decoding run on the CPU (the GPU path's code, in-process);
    its JSON makes the rows of ``make gpu-check``."""
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    args = [
        "bench",
        "train",
        "--device",
        "cpu",
        "--backbone",
        "small_cnn",
        "--batch",
        "8",
        "--image-size",
        "24",
        "--precision",
        "fp32",
        "--channels-last",
        "--decode",
        "device",
        "--steps",
        "2",
        "--warmup",
        "1",
        "--synthetic",
        "8,4,32",
        "--loader-workers",
        "0",
        "--set",
        "model.embedding_dim=64",
        "--json",
        str(tmp_path / "figures.json"),
    ]
    try:
        assert main(args) == 0
    finally:
        if torch.distributed.is_initialized():
            from dmltrain.training.engine import import_deepspeed

            import_deepspeed().comm.destroy_process_group()
    out = capsys.readouterr().out
    assert "small_cnn, batch 8 (2x4), 24 px, fp32, channels_last, cpu" in out
    assert re.search(r"bare backbone .* [\d.]+ images/s", out) and re.search(
        r"full pipeline \(shards, decode=device.* [\d.]+ images/s", out
    )
    assert re.search(r"step split: data [\d.]+ ms, forward [\d.]+ ms, backward [\d.]+ ms, optimizer [\d.]+ ms", out)
    last = out.strip().splitlines()[-1]
    assert re.match(
        r"ratio full pipeline / bare backbone: [\d.]+x \([\d.]+ vs [\d.]+ images/s\), data wait [\d.]+%$", last
    ), last
    from dmltrain.gpu_check import train_rows

    figures = json.loads((tmp_path / "figures.json").read_text())
    assert figures["decode"] == "device" and figures["batch"] == 8 and set(figures["step_ms"]) >= {"data", "forward"}
    full, wait = train_rows(figures, cuda=False, what="small_cnn")
    assert f"{figures['full_images_per_s']:.0f} images/s" == full.figure and full.verdict == wait.verdict == "info"


def test_bench_train_bad_input_is_one_line(capsys):
    assert main(["bench", "train", "--batch", "10"]) == 2
    assert (
        capsys.readouterr().err.strip()
        == "dmltrain: error: --batch: 10 is not a positive multiple of 4 (P x K batches with K = 4)"
    )
    assert main(["bench", "train", "--synthetic", "4,x"]) == 2
    assert (
        capsys.readouterr()
        .err.strip()
        .startswith("dmltrain: error: --synthetic: expected classes,images per class,pixels")
    )
