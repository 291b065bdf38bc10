"""Evaluation around the metrics: embedding, gathering across gloo workers, the CLI, saved
embeddings, plots. One tiny synthetic shard set and one small_cnn checkpoint serve them all."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
import torch
from multiproc import run_workers
from PIL import Image

from dmltrain.cli import main
from dmltrain.config import EvalConfig, ModelConfig
from dmltrain.evaluate import (
    embed_batches,
    evaluate_model,
    gather_to_rank0,
    load_embeddings,
    plot_embedding_map,
    plot_recall_at_k,
    retrieval_metrics,
    save_embeddings,
)
from shards.config import DataConfig

EVAL = EvalConfig(ks=[1, 2, 4], binary=True)
DATA = DataConfig(eval_batch_size=5, eval_resize=32, eval_crop=32, loader_workers=0)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(shard folder, checkpoint path, single-process metrics and embeddings)."""
    from dmltrain.models import build_model, save_model
    from shards.build.synthetic import build_synthetic_shards

    root = tmp_path_factory.mktemp("eval")
    build_synthetic_shards(root / "shards", classes=6, per_class=4, image_size=32, seed=0, workers=0, progress=False)
    torch.manual_seed(0)
    cfg = ModelConfig(backbone="small_cnn", embedding_dim=64, pretrained="none")
    model = build_model(cfg)
    run_config = {
        "model": cfg.model_dump(mode="json"),
        "data": {
            "shards": str(root / "shards"),
            "eval_resize": 32,
            "eval_crop": 32,
            "eval_batch_size": 7,
            "loader_workers": 0,
        },
        "eval": {"ks": [1, 2, 4]},
    }
    save_model(root / "model.pt", model, run_config)
    model.train()
    metrics, embeddings = evaluate_model(model, str(root / "shards"), ["test"], EVAL, DATA)
    assert model.training  # the caller's mode is restored
    return root / "shards", root / "model.pt", metrics, embeddings


# -- distributed ------------------------------------------------------------------------------
def _worker(rank, world, model_path, shard_dir):
    from dmltrain.models import load_model

    out = {}
    if rank == 0:  # rank 1 holds nothing at all (no batches: a 0 × 0 array)
        out["empty_rank"] = gather_to_rank0(
            np.arange(10, dtype=np.float32).reshape(5, 2), [1, 2, 3, 4, 5], [8, 6, 4, 2, 0]
        )
    else:
        out["empty_rank"] = gather_to_rank0(np.zeros((0, 0), np.float32), np.zeros(0), np.zeros(0))
    idx = np.array([0, 3, 5]) if rank == 0 else np.array([1, 2, 4, 6, 7, 8, 3])  # uneven, interleaved, 3 twice
    emb = np.stack([idx * 1.0, idx * 2.0 + rank], 1).astype(np.float32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res = gather_to_rank0(emb, idx * 10, idx)
    out["interleaved"] = (res, [str(w.message) for w in caught])
    model, _, _ = load_model(model_path)
    out["evaluate"] = evaluate_model(model, shard_dir, ["test"], EVAL, DATA, rank=rank, world_size=world)
    return out


@pytest.mark.multiprocess
def test_gather_and_evaluate_on_two_gloo_workers(setup):
    shard_dir, model_path, metrics, embeddings = setup
    r0, r1 = run_workers(_worker, 2, str(model_path), str(shard_dir), timeout=240)
    emb, lab = r0["empty_rank"]
    assert lab.tolist() == [5, 4, 3, 2, 1] and emb[:, 0].tolist() == [8, 6, 4, 2, 0]
    assert r1["empty_rank"] == (None, None)
    (emb, lab), messages = r0["interleaved"]
    assert lab.tolist() == [0, 10, 20, 30, 40, 50, 60, 70, 80]
    assert emb[3].tolist() == [3.0, 6.0]  # index 3 kept from rank 0, the first holder
    assert any("1 duplicated sample indices dropped" in m for m in messages)
    assert r1["interleaved"] == ((None, None), [])
    assert r1["evaluate"] == (None, None)
    got_metrics, got_emb = r0["evaluate"]
    np.testing.assert_array_equal(got_emb["test"][1], embeddings["test"][1])
    np.testing.assert_allclose(got_emb["test"][0], embeddings["test"][0], rtol=1e-4, atol=1e-5)
    assert got_metrics == pytest.approx(metrics)


def test_gather_without_process_group_sorts_by_index():
    emb, lab = gather_to_rank0(np.eye(3, dtype=np.float32), [7, 8, 9], [2, 0, 1])
    assert lab.tolist() == [8, 9, 7] and emb.argmax(1).tolist() == [1, 2, 0]
    with pytest.raises(ValueError, match="do not match"):
        gather_to_rank0(np.eye(3, dtype=np.float32), [7, 8], [2, 0, 1])


def test_embed_batches_contract(setup):
    _, _, _, embeddings = setup
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(4, 3), torch.nn.Dropout(0.9))
    model.train()
    batches = [
        (torch.ones(2, 2, 2), torch.tensor([1, 2]), torch.tensor([5, 6])),
        (torch.zeros(0, 2, 2), [], []),
        (torch.ones(1, 2, 2), [3], [7]),
    ]
    emb, lab, idx = embed_batches(model, batches, progress=False)
    assert emb.dtype == np.float32 and emb.shape == (3, 3) and lab.tolist() == [1, 2, 3] and idx.tolist() == [5, 6, 7]
    np.testing.assert_array_equal(emb[0], emb[2])  # eval mode: dropout off
    assert model.training
    emb, lab, idx = embed_batches(model, [], progress=False)
    assert emb.shape == (0, 0) and lab.shape == idx.shape == (0,)
    assert embeddings["test"][0].shape == (24, 64)


# -- saved embeddings and the CLI ---------------------------------------------------------------
def test_store_roundtrip_and_errors(tmp_path):
    from dmltrain.errors import UserError

    x = np.random.default_rng(0).standard_normal((6, 3)).astype(np.float32)
    save_embeddings(tmp_path, "query", x, np.arange(6))
    emb, lab = load_embeddings(tmp_path, "query")
    np.testing.assert_array_equal(emb, x)
    assert lab.dtype == np.int64 and lab.tolist() == list(range(6))
    with pytest.raises(UserError, match=r"gallery\.npy: not found \(saved splits in .*: query\)"):
        load_embeddings(tmp_path, "gallery")
    (tmp_path / "bad.npy").write_bytes(b"not numpy")
    (tmp_path / "bad_labels.npy").write_bytes(b"")
    with pytest.raises(UserError, match="bad.npy: not a readable .npy file"):
        load_embeddings(tmp_path, "bad")


def test_cli_with_saved_embeddings(tmp_path, capsys):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((60, 8)).astype(np.float32)
    y = np.arange(60) % 12
    save_embeddings(tmp_path / "emb", "query", x[:20], y[:20])
    save_embeddings(tmp_path / "emb", "gallery", x[20:], y[20:])
    save_embeddings(tmp_path / "emb", "test", x, y)
    assert (
        main(
            [
                "eval",
                "-",
                "--embeddings",
                str(tmp_path / "emb"),
                "--split",
                "query,gallery",
                "--ks",
                "1,5",
                "--binary",
                "--out",
                str(tmp_path / "m.json"),
            ]
        )
        == 0
    )
    record = json.loads((tmp_path / "m.json").read_text())
    assert record["metrics"] == retrieval_metrics(x[:20], y[:20], x[20:], y[20:], ks=[1, 5], binary=True)
    assert record["splits"] == ["query", "gallery"] and record["ks"] == [1, 5]
    out = capsys.readouterr().out
    assert "recall@5" in out and "binary %" in out and "20 queries evaluated" in out
    # self-retrieval, default output beside the embeddings, plots
    assert main(["eval", "--embeddings", str(tmp_path / "emb"), "--no-nmi", "--plots", str(tmp_path / "plots")]) == 0
    record = json.loads((tmp_path / "emb" / "eval_metrics.json").read_text())
    assert record["metrics"] == retrieval_metrics(x, y, nmi=False)
    assert (tmp_path / "plots" / "recall_at_k.png").is_file() and (tmp_path / "plots" / "embedding_map.png").is_file()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["eval"], "give a CHECKPOINT, or --embeddings"),
        (["eval", "missing.pt"], "missing.pt/model.pt: checkpoint not found|missing.pt: checkpoint not found"),
        (["eval", "-", "--embeddings", "EMB", "--split", "query"], "query.npy: not found"),
        (["eval", "-", "--embeddings", "EMB", "--ks", "1,x"], "--ks: expected comma-separated positive integers"),
        (["eval", "-", "--embeddings", "EMB", "--split", "a,b,c"], "--split: expected 'test' or 'query,gallery'"),
        (["eval", "-", "--embeddings", "EMB", "--split", "nan"], "NaN or inf"),
    ],
)
def test_cli_errors_are_one_line(tmp_path, capsys, monkeypatch, argv, message):
    monkeypatch.chdir(tmp_path)
    save_embeddings(tmp_path / "EMB", "test", np.ones((4, 2), np.float32), [0, 0, 1, 1])
    save_embeddings(tmp_path / "EMB", "nan", np.full((4, 2), np.nan, np.float32), [0, 0, 1, 1])
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("dmltrain: error: ") and "\n" not in err
    assert any(m in err for m in message.split("|")), err


def test_cli_end_to_end_with_checkpoint(setup, tmp_path, capsys):
    shard_dir, model_path, _, embeddings = setup
    # ks, shards, batch size and crop come from the checkpoint's run config
    rc = main(
        [
            "eval",
            str(model_path),
            "--binary",
            "--device",
            "cpu",
            "--save-embeddings",
            str(tmp_path / "emb"),
            "--out",
            str(tmp_path / "m.json"),
        ]
    )
    assert rc == 0
    record = json.loads((tmp_path / "m.json").read_text())
    emb, lab = load_embeddings(tmp_path / "emb", "test")
    np.testing.assert_array_equal(lab, embeddings["test"][1])
    np.testing.assert_allclose(emb, embeddings["test"][0], rtol=1e-4, atol=1e-5)
    assert record["metrics"] == retrieval_metrics(emb, lab, ks=[1, 2, 4], binary=True)
    assert record["shards"] == str(shard_dir) and record["checkpoint"] == str(model_path)
    assert main(["eval", str(model_path), "--shards", str(shard_dir), "--split", "query,gallery"]) == 2
    assert "no split 'query'" in capsys.readouterr().err


def _shards_with(tmp_path, damage):
    """The fixture's images in shards of 8 (three test shards), then ``damage(folder, test shard entries)``."""
    from shards.build.synthetic import build_synthetic_shards

    out = tmp_path / "shards"
    build_synthetic_shards(out, classes=6, per_class=4, image_size=32, seed=0, shard_size=8, workers=0, progress=False)
    manifest = json.loads((out / "manifest.json").read_text())
    damage(out, manifest["splits"]["test"]["shards"])
    return out


def test_cli_refuses_missing_shards_unless_allowed(setup, tmp_path, capsys):
    _, model_path, _, _ = setup
    shards = _shards_with(tmp_path, lambda out, sh: (out / sh[0]["file"]).unlink())
    argv = [
        "eval",
        str(model_path),
        "--shards",
        str(shards),
        "--device",
        "cpu",
        "--no-nmi",
        "--out",
        str(tmp_path / "m.json"),
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "shard missing" in err and "--allow-missing" in err, err
    assert not (tmp_path / "m.json").exists(), "refused before anything is evaluated"

    assert main([*argv, "--allow-missing"]) == 0
    record = json.loads((tmp_path / "m.json").read_text())
    assert record["eval/unreadable_samples"] > 0 and record["unreadable_by_split"] == {
        "test": record["eval/unreadable_samples"]
    }
    assert (
        record["metrics"]["num_queries"] + record["metrics"]["excluded_queries"] + record["eval/unreadable_samples"]
        == 24
    )
    assert "warning" in capsys.readouterr().err


def test_cli_exits_nonzero_on_unreadable_samples(setup, tmp_path, capsys):
    _, model_path, _, _ = setup

    def truncate(out, shards):  # the shard is there, but its last class group is cut off
        path = out / shards[-1]["file"]
        path.write_bytes(path.read_bytes()[: shards[-1]["groups"][-1][2] + 100])

    shards = _shards_with(tmp_path, truncate)
    argv = [
        "eval",
        str(model_path),
        "--shards",
        str(shards),
        "--device",
        "cpu",
        "--no-nmi",
        "--out",
        str(tmp_path / "m.json"),
    ]
    assert main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        err[-1].startswith(f"dmltrain: error: {shards}: ")
        and "could not be read" in err[-1]
        and "--allow-missing" in err[-1]
    )
    record = json.loads((tmp_path / "m.json").read_text())  # written, with the count, before the failure
    assert record["eval/unreadable_samples"] > 0
    assert main([*argv, "--allow-missing"]) == 0

    # complete shards: the count is there, and zero
    assert main(["eval", str(model_path), "--device", "cpu", "--no-nmi", "--out", str(tmp_path / "ok.json")]) == 0
    assert json.loads((tmp_path / "ok.json").read_text())["eval/unreadable_samples"] == 0


# -- plots ------------------------------------------------------------------------------------
def _png_size(path):
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with Image.open(path) as im:
        im.verify()
    with Image.open(path) as im:
        return im.size


def test_plots_write_valid_pngs(tmp_path):
    curves = {
        "run-a": {
            "recall@1": 0.5,
            "recall@10": 0.8,
            "recall@100": 0.95,
            "map@r": 0.3,
            "binary/recall@1": 0.45,
            "binary/recall@10": 0.7,
        },
        "run-b": {1: 0.6, 10: 0.85},
    }
    w, h = _png_size(plot_recall_at_k(curves, tmp_path / "r.png"))
    assert w > 300 and h > 200
    with pytest.raises(ValueError, match="no recall@K values"):
        plot_recall_at_k({"x": {"nmi": 0.5}}, tmp_path / "none.png")
    assert not (tmp_path / "none.png").exists()
    rng = np.random.default_rng(0)
    y = np.repeat(np.arange(30), 10)
    x = rng.standard_normal((30, 16))[y] + 0.1 * rng.standard_normal((300, 16))
    for method in ("pca", "tsne"):
        _png_size(plot_embedding_map(x, y, tmp_path / f"{method}.png", method=method, max_points=120, max_classes=12))
    with pytest.raises(ValueError, match="method"):
        plot_embedding_map(x, y, tmp_path / "m.png", method="umap")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pca.png", "r.png", "tsne.png"]  # nothing half-written left
