"""`dmltrain embed` (shards, a table, a folder; model.pt or ONNX; resumable by chunk) and `dmltrain index`
(flat, IVF-PQ, HNSW: built with faiss, measured against the exact search, logged to MLflow, queried)."""

from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from dataset_fixtures import make_table, write_truncated_jpeg

from dmltrain.cli import main
from dmltrain.config import load_config
from dmltrain.evaluate.embedding_set import ChunkedWriter, load_embedding_set
from dmltrain.evaluate.index import label_recall, load_index, search
from dmltrain.evaluate.knn import knn
from dmltrain.models import build_model, save_model

pytestmark = pytest.mark.usefixtures("one_torch_thread", "one_faiss_thread")


@pytest.fixture(scope="module")
def one_faiss_thread():
    """faiss's OpenMP threads spin while they wait: on a shared 2-core machine one thread is much faster."""
    import faiss

    before = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(1)
    yield
    faiss.omp_set_num_threads(before)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A table of 17 images (train and test), its shards, and a small CNN saved as a run's model.pt (32 px)."""
    base = tmp_path_factory.mktemp("embed")
    table, fx = make_table(base / "src", "csv", inshop=False)
    assert (
        main(["shards", "build", "--layout", "table", "--root", str(table), "--out", str(base / "shards"), "--quiet"])
        == 0
    )
    cfg = load_config(
        None, ["model.backbone=small_cnn", "model.embedding_dim=64", "data.eval_crop=32", "data.eval_resize=36"]
    )
    torch.manual_seed(0)
    model_pt = base / "runs/r/best_model/model.pt"
    save_model(model_pt, build_model(cfg.model), cfg.to_dict())
    return {"base": base, "table": table, "model": model_pt, "fx": fx}


def embed(setup, out, *argv: str) -> int:
    return main(["embed", str(setup["model"]), "--out", str(out), "--loader-workers", "0", "--quiet", *argv])


def test_embed_sources_formats_and_resume(setup, tmp_path, capsys, monkeypatch):
    shards, table = str(setup["base"] / "shards"), str(setup["table"])
    assert embed(setup, tmp_path / "s", "--shards", shards, "--split", "test", "--chunk-size", "3", "--binary") == 0
    s = load_embedding_set(tmp_path / "s")
    assert len(s) == 8 and s.dim == 64 and s.info["chunk_size"] == 3 and s.info["normalized"]
    np.testing.assert_array_equal(s.codes, np.packbits(np.asarray(s.embeddings) > 0, axis=1))
    ids = pq.read_table(tmp_path / "s/ids.parquet").to_pydict()
    assert ids["row"] == list(range(8)) and set(ids["label"]) == {"sock", "belt", "scarf"} and "sku" in ids
    # the same images through the table: the same embeddings (shards keep the bytes as they are)
    assert embed(setup, tmp_path / "t", "--table", table, "--split", "test") == 0
    t = load_embedding_set(tmp_path / "t")
    by_id = dict(zip(t.ids["id"], np.asarray(t.embeddings)))
    # (up to float rounding: the batches differ, and so the order of the convolutions' sums)
    np.testing.assert_allclose(np.stack([by_id[i] for i in s.ids["id"]]), np.asarray(s.embeddings), atol=1e-6)
    assert sorted(t.ids["sku"]) == sorted(s.ids["sku"])
    # a folder: ids relative to it, labels its first folders
    assert embed(setup, tmp_path / "f", "--folder", str(setup["table"].parent / "images")) == 0
    f = load_embedding_set(tmp_path / "f")
    assert len(f) == 17 and f.ids["id"][0] == "bag/0.jpg" and f.ids["label"][0] == "bag"
    # resumable: a run stopped after its first chunk is finished by --resume, which embeds only the rest
    real_write = ChunkedWriter.write

    def stop_after_first(self, c, *a):
        real_write(self, c, *a)
        raise KeyboardInterrupt

    monkeypatch.setattr(ChunkedWriter, "write", stop_after_first)
    argv = ("--shards", shards, "--split", "test", "--chunk-size", "3", "--binary")
    assert embed(setup, tmp_path / "r", *argv) == 130
    assert sorted(p.name for p in (tmp_path / "r/chunks").iterdir()) == ["chunk-000000.npz", "plan.json"]
    monkeypatch.setattr(ChunkedWriter, "write", real_write)
    assert embed(setup, tmp_path / "r", *argv) == 2
    assert "interrupted embed; pass --resume" in capsys.readouterr().err
    assert (
        embed(setup, tmp_path / "r", "--shards", shards, "--split", "test", "--chunk-size", "4", "--binary", "--resume")
        == 2
    )
    assert "had chunk_size = 3, this one 4" in capsys.readouterr().err
    seen = []
    import dmltrain.evaluate.embedding as embedding

    real_embed = embedding.embed_batches
    monkeypatch.setattr(embedding, "embed_batches", lambda *a, **k: seen.append(1) or real_embed(*a, **k))
    assert embed(setup, tmp_path / "r", *argv, "--resume") == 0
    assert len(seen) == 2  # chunks 2 and 3 of 3 (8 images by 3)
    r = load_embedding_set(tmp_path / "r")
    np.testing.assert_array_equal(np.asarray(r.embeddings), np.asarray(s.embeddings))
    assert r.ids == s.ids and not (tmp_path / "r/chunks").exists()


def test_embed_onnx_unreadable_and_errors(setup, tmp_path, capsys):
    from dmltrain.models.export import load_model
    from dmltrain.models.serving import export_model

    model, config, _ = load_model(setup["model"])
    onnx_file = export_model(model, config, "onnx", tmp_path / "model.onnx").path
    import pandas as pd

    frame = pd.read_csv(setup["table"], dtype=str, keep_default_na=False)
    frame["path"] = [str((setup["table"].parent / p).resolve()) for p in frame.path]  # the table moves: absolute paths
    write_truncated_jpeg(tmp_path / "broken.jpg")
    frame.loc[len(frame)] = [str(tmp_path / "broken.jpg"), "sock", "test", "1", "1", "x", "1"]
    frame.to_csv(tmp_path / "t.csv", index=False)
    argv = ["--table", str(tmp_path / "t.csv"), "--split", "test", "--loader-workers", "0", "--quiet"]
    argv.insert(4, "--allow-outside-paths")  # the images stay in the table's old folder
    assert main(["embed", str(onnx_file), "--out", str(tmp_path / "o"), *argv]) == 0
    assert "1 images could not be read" in capsys.readouterr().err
    assert embed(setup, tmp_path / "p", *argv[:5]) == 0
    capsys.readouterr()
    o, p = load_embedding_set(tmp_path / "o"), load_embedding_set(tmp_path / "p")
    assert o.info["unreadable"] == 1 and o.info["unreadable_ids"][0].endswith("broken.jpg") and len(o) == 8
    assert (
        o.info["model"]["format"] == "onnx" and np.abs(np.asarray(o.embeddings) - np.asarray(p.embeddings)).max() < 1e-5
    )
    for args, message in [
        (["--shards", "x", "--table", "y"], "give one of --shards, --table or --folder"),
        (["--folder", str(tmp_path / "none")], "none: image folder not found"),
        (["--table", str(tmp_path / "t.csv"), "--split", "holdout"], "no row of"),
    ]:
        assert embed(setup, tmp_path / "e", *args) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], (args, err)


def write_set(folder, emb: np.ndarray, labels: np.ndarray) -> None:
    """An embedding set from arrays, through the writer ``dmltrain embed`` uses."""
    writer = ChunkedWriter(folder, {"synthetic": True}, resume=False, overwrite=False)
    writer.write(0, emb, np.arange(len(emb)), None)
    rows = lambda idx: {"id": [f"g{i}" for i in idx], "label": [str(labels[i]) for i in idx], "index": idx.tolist()}  # noqa: E731
    writer.assemble(1, len(emb), rows, {"normalized": False})


def clustered(n: int, d: int, classes: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, classes, n)
    emb = rng.standard_normal((classes, d)).astype(np.float32)[labels] + rng.standard_normal((n, d)).astype(np.float32)
    return emb, labels


def test_flat_index_equals_exact_search(tmp_path, capsys):
    emb, labels = clustered(1200, 24, 60)
    write_set(tmp_path / "g", emb, labels)
    assert main(["index", "build", str(tmp_path / "g"), "--kind", "flat", "--holdout", "50"]) == 0
    saved = load_index(tmp_path / "g/index-flat")
    held = np.asarray(saved.info["holdout"])
    gallery = emb[saved.rows]
    s, found = search(saved.index, emb[held], 10, False)
    s_exact, exact = knn(emb[held], gallery, 10)
    np.testing.assert_array_equal(found, exact)  # no near ties in Gaussian data: the same neighbours, in order
    np.testing.assert_allclose(s, s_exact, atol=1e-5)
    assert main(["index", "eval", str(tmp_path / "g/index-flat"), "--ks", "1,10", "--no-tracking"]) == 0
    record = json.loads((tmp_path / "g/index-flat/index_eval.json").read_text())
    assert record["metrics"]["index/recall@1"] == record["metrics"]["index/recall@10"] == 1.0
    assert record["metrics"]["index/label_recall@1"] == record["metrics"]["index/exact_label_recall@1"]
    # the index's own set as the queries: each would find itself (recall 1), refused whatever the path's spelling
    argv = ["index", "eval", str(tmp_path / "g/index-flat"), "--queries", str(tmp_path / "g/../g"), "--no-tracking"]
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is the embedding set the index was built from" in err[0], err


def test_label_recall_leaves_out_queries_without_their_label_in_the_index(tmp_path, capsys):
    """Recall@K by label as the evaluation defines it: a query with no item of its label in the index (R = 0) cannot
    be retrieved, so it is left out and counted (retrieval_metrics' excluded_queries, the reference on random data);
    ids -1 (nothing found) are misses. index eval reports the count."""
    from dmltrain.evaluate.retrieval import retrieval_metrics

    gallery, queries = np.array(["a", "a", "b"]), np.array(["a", "c", "b"])
    assert label_recall(np.array([[2, 0], [0, 1], [-1, 2]]), queries, gallery, [1, 2]) == ({1: 0.0, 2: 1.0}, 1)
    assert label_recall(np.array([[0], [1]]), np.array(["x", "y"]), gallery, [1]) == ({}, 2)
    rng = np.random.default_rng(0)
    g, q = rng.standard_normal((60, 8)).astype(np.float32), rng.standard_normal((25, 8)).astype(np.float32)
    g_labels, q_labels = rng.integers(0, 12, 60).astype(str), rng.integers(8, 16, 25).astype(str)  # 12..15: absent
    _, exact = knn(q, g, 4)
    ks = [1, 2, 4]
    want = retrieval_metrics(q, q_labels, g, g_labels, ks, nmi=False, map_at_r=False, device="cpu")
    got, excluded = label_recall(exact, q_labels, g_labels, ks)
    assert excluded == want["excluded_queries"] > 0
    assert got == pytest.approx({k: want[f"recall@{k}"] for k in ks}, abs=1e-12)
    write_set(tmp_path / "g", g, g_labels)
    write_set(tmp_path / "q", q, q_labels)
    assert main(["index", "build", str(tmp_path / "g"), "--kind", "flat"]) == 0
    argv = ["index", "eval", str(tmp_path / "g/index-flat"), "--queries", str(tmp_path / "q"), "--ks", "1,2,4"]
    assert main([*argv, "--no-tracking"]) == 0
    metrics = json.loads((tmp_path / "g/index-flat/index_eval.json").read_text())["metrics"]
    assert metrics["index/excluded_queries"] == excluded
    assert metrics["index/exact_label_recall@2"] == pytest.approx(want["recall@2"], abs=1e-12)
    assert f"{excluded} of 25 queries have no item of their label in the index" in capsys.readouterr().out


# the floors of k-recall@k against the exact search on the clustered gallery below (the measured values are printed)
FLOORS = {"ivf-pq": {1: 0.35, 10: 0.6}, "hnsw": {1: 0.95, 10: 0.95}}


@pytest.mark.parametrize("kind", list(FLOORS))
def test_approximate_index_recall_against_exact(tmp_path, capsys, kind, mlflow_store):
    emb, labels = clustered(4000, 64, 400, seed=1)
    write_set(tmp_path / "g", emb, labels)
    assert main(["index", "build", str(tmp_path / "g"), "--kind", kind, "--holdout", "200"]) == 0
    argv = ["index", "eval", str(tmp_path / f"g/index-{kind}"), "--ks", "1,10", "--tracking-uri", mlflow_store]
    assert main([*argv, "--experiment", "test-index"]) == 0
    out = capsys.readouterr().out
    print(out)  # the measured recall, reported (pytest -s)
    metrics = json.loads((tmp_path / f"g/index-{kind}/index_eval.json").read_text())["metrics"]
    for k, floor in FLOORS[kind].items():
        assert metrics[f"index/recall@{k}"] >= floor, (kind, k, metrics)
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=mlflow_store)
    exp = client.get_experiment_by_name("test-index")
    (run,) = client.search_runs([exp.experiment_id], filter_string=f"tags.`dmltrain.run_name` = 'g-index-{kind}'")
    assert run.data.metrics["index/recall_at_1"] == metrics["index/recall@1"] and run.data.params["index.kind"] == kind
    assert {"index/build_s", "index/query_ms", "index/memory_mb"} <= set(run.data.metrics)


def test_index_query_prints_ids_and_scores(setup, tmp_path, capsys):
    images = setup["table"].parent / "images"
    assert embed(setup, tmp_path / "f", "--folder", str(images), "--binary") == 0
    assert main(["index", "build", str(tmp_path / "f"), "--kind", "hnsw"]) == 0
    assert main(["index", "build", str(tmp_path / "f"), "--kind", "flat", "--binary"]) == 0
    capsys.readouterr()
    assert (
        main(["index", "query", str(tmp_path / "f/index-hnsw"), "--images", str(images / "belt/1.jpg"), "--k", "3"])
        == 0
    )
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"query {images / 'belt/1.jpg'}" and len(lines) == 4
    assert lines[1].split()[:3] == ["1.", "belt/1.jpg", "cosine"] and float(lines[1].split()[3]) == pytest.approx(
        1, abs=1e-5
    )
    np.save(tmp_path / "q.npy", np.asarray(load_embedding_set(tmp_path / "f").embeddings[:2]))
    assert (
        main(["index", "query", str(tmp_path / "f/index-hnsw"), "--vectors", str(tmp_path / "q.npy"), "--k", "2"]) == 0
    )
    out = capsys.readouterr().out
    assert "query q.npy[1]" in out and "1. bag/1.jpg  cosine 1.0000  label bag" in out
    assert main(["index", "query", str(tmp_path / "f/index-flat-binary"), "--images", str(images / "belt/1.jpg")]) == 0
    assert "    1. belt/1.jpg  hamming 0  label belt" in capsys.readouterr().out  # the sign bits of its embedding
    for argv, message in [
        (["index", "query", str(tmp_path / "f/index-hnsw")], "give one of --images, --vectors or --rows"),
        (["index", "build", str(tmp_path / "f"), "--kind", "lsh"], "--kind: unknown index kind 'lsh'"),
        (["index", "build", str(tmp_path), "--kind", "flat"], "embeddings.json: not found"),
        (["index", "eval", str(tmp_path / "f/index-hnsw"), "--no-tracking"], "no rows were held out"),
    ]:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], (argv, err)
