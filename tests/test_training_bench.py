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


def test_bench_train_compile_prints_eager_and_compiled_side_by_side(capsys, monkeypatch, tmp_path):
    """``--compile``: each loop again with ``model.compile``, the two images/s on one line with their ratio, the
    compile time and the graph breaks, and in the JSON (traced with ``aot_eager`` here: no C++ compile)."""
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    monkeypatch.setattr("dmltrain.models.compiled.BACKEND", "aot_eager")
    torch._dynamo.reset()
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
        "--decode",
        "cpu",
        "--steps",
        "1",
        "--warmup",
        "1",
        "--synthetic",
        "8,4,32",
        "--loader-workers",
        "0",
        "--set",
        "model.embedding_dim=64",
        "--compile",
        "--json",
        str(tmp_path / "figures.json"),
    ]
    try:
        assert main(args) == 0
    finally:
        torch._dynamo.reset()
        if torch.distributed.is_initialized():
            from dmltrain.training.engine import import_deepspeed

            import_deepspeed().comm.destroy_process_group()
    out = capsys.readouterr().out
    for loop in ("bare backbone", "full pipeline"):
        assert re.search(
            loop + r": eager +[\d.]+ images/s \| compiled \(default\) +[\d.]+ images/s \| [\d.]+x; "
            r"compiled backbone, head in [\d.]+ s, 0 graph breaks",
            out,
        ), out
    compiled = json.loads((tmp_path / "figures.json").read_text())["compiled"]
    assert compiled["mode"] == "default" and compiled["bare"]["graph_breaks"] == compiled["full"]["graph_breaks"] == 0
    assert compiled["full"]["compiled_images_per_s"] > 0 and compiled["bare"]["compile_s"] > 0
    assert main(["bench", "train", "--compile", "--warmup", "0"]) == 2
    assert "--warmup: --compile compiles in the warm-up steps" in capsys.readouterr().err
