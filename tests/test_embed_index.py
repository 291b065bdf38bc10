"""`dmltrain embed` (shards, a table, a folder; model.pt or ONNX; resumable by chunk) and `dmltrain index`
(flat, IVF-PQ, HNSW: built with faiss, measured against the exact search, logged to MLflow, queried)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest
import torch
from dataset_fixtures import make_table, write_truncated_jpeg
from hostile_files import planted_pt2

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
    writer = ChunkedWriter(folder, {"synthetic": True, "chunk_size": len(emb)}, resume=False, overwrite=False)
    writer.write(0, emb, np.arange(len(emb)), None)
    rows = lambda idx: {"id": [f"g{i}" for i in idx], "label": [str(labels[i]) for i in idx], "index": idx.tolist()}  # noqa: E731
    writer.assemble(1, len(emb), rows, {"normalized": False}, emb.shape[1])


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
    model = ["--model", str(setup["model"])]
    query = ["index", "query", str(tmp_path / "f/index-hnsw"), "--images", str(images / "belt/1.jpg"), "--k", "3"]
    assert main([*query, *model]) == 0
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
    flat_binary = ["index", "query", str(tmp_path / "f/index-flat-binary"), "--images", str(images / "belt/1.jpg")]
    assert main([*flat_binary, *model]) == 0
    assert "    1. belt/1.jpg  hamming 0  label belt" in capsys.readouterr().out  # the sign bits of its embedding
    # the set's ids and labels are anyone's text: each printed as one visible line (no escape reaches the terminal)
    ids = pd.read_parquet(tmp_path / "f/index-hnsw/ids.parquet")  # the index folder's copy of the set's
    ids.loc[ids["id"] == "bag/1.jpg", ["id", "label"]] = ["bag/\x1b[2J1.jpg\nrm -rf", "bag\r\x07"]
    ids.to_parquet(tmp_path / "f/index-hnsw/ids.parquet")
    assert (
        main(["index", "query", str(tmp_path / "f/index-hnsw"), "--vectors", str(tmp_path / "q.npy"), "--k", "1"]) == 0
    )
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\r" not in out and "\x07" not in out and "1. bag/[2J1.jpg rm -rf  cosine" in out
    for argv, message in [
        (["index", "query", str(tmp_path / "f/index-hnsw")], "give one of --images, --vectors or --rows"),
        (["index", "build", str(tmp_path / "f"), "--kind", "lsh"], "--kind: unknown index kind 'lsh'"),
        (["index", "build", str(tmp_path), "--kind", "flat"], "embeddings.json: not found"),
        (["index", "eval", str(tmp_path / "f/index-hnsw"), "--no-tracking"], "no rows were held out"),
    ]:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], (argv, err)


# -- index folders and embedding chunks as someone else wrote them ---------------------------------------------------
def _one_error_line(capsys) -> str:
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("dmltrain: error: "), err
    return err[0]


def test_index_query_runs_only_the_model_the_user_names(setup, tmp_path, capsys):
    """index.json names a model; a folder someone changed names one that runs code (a planted pt2). --images needs
    --model: the named file is never loaded (its marker is not made), and a --model that is not the set's own
    file gets a note."""
    from dmltrain.models.contract import contract_path
    from dmltrain.models.export import load_model
    from dmltrain.models.serving import export_model

    images = setup["table"].parent / "images"
    assert embed(setup, tmp_path / "f", "--folder", str(images / "belt")) == 0
    assert main(["index", "build", str(tmp_path / "f"), "--kind", "flat"]) == 0
    model, config, _ = load_model(setup["model"])
    honest = export_model(model, config, "pt2", tmp_path / "m/model.pt2").path
    marker, evil = tmp_path / "marker", tmp_path / "evil/model.pt2"
    evil.parent.mkdir()
    planted_pt2(honest, evil, "pickled-weight", marker)
    shutil.copy(contract_path(honest), contract_path(evil))
    info_path = tmp_path / "f/index-flat/index.json"
    info = json.loads(info_path.read_text())
    info.update(model=str(evil), model_sha256=None)
    info_path.write_text(json.dumps(info))
    capsys.readouterr()
    query = ["index", "query", str(tmp_path / "f/index-flat"), "--images", str(images / "belt/1.jpg"), "--k", "1"]
    assert main(query) == 2
    assert "--model: needed with --images; an index folder never picks the model that runs" in _one_error_line(capsys)
    assert main([*query, "--model", str(evil)]) == 2
    assert f"{evil}: refused: " in _one_error_line(capsys)
    assert not marker.exists()
    info_path.write_text(json.dumps({**info, "model_sha256": "0" * 64}))
    assert main([*query, "--model", str(honest)]) == 0
    captured = capsys.readouterr()
    assert captured.out.splitlines()[1].split()[:2] == ["1.", "1.jpg"]
    assert f"--model {honest} is not the file the set was embedded with" in captured.err


def _ivf_pq(x: np.ndarray):
    import faiss

    index = faiss.index_factory(x.shape[1], "IVF10,PQ4x4np", faiss.METRIC_INNER_PRODUCT)
    index.train(x)
    return index


def test_a_forged_index_file_is_refused_before_faiss_reads_it(tmp_path, capsys):
    """index.faiss declaring more than it holds (faiss would allocate it first), on-disk inverted lists (they
    memory-map another file read-write), an ID map, and ids outside the rows: each one line, exit 2."""
    import faiss

    from dmltrain.evaluate.index import normalized

    emb, labels = clustered(400, 16, 20)
    write_set(tmp_path / "g", emb, labels)
    assert main(["index", "build", str(tmp_path / "g"), "--kind", "flat"]) == 0
    assert main(["index", "build", str(tmp_path / "g"), "--kind", "ivf-pq"]) == 0
    flat, ivf = tmp_path / "g/index-flat", tmp_path / "g/index-ivf-pq"
    good = {p: (p / "index.faiss").read_bytes() for p in (flat, ivf)}
    x = normalized(emb)
    victim = tmp_path / "victim.txt"
    victim.write_text("safe")

    def oversized(path):  # IxFI, d, ntotal, two unused, is_trained, metric, then the vectors' count: 2^27 floats
        data = bytearray(good[flat])
        data[37:45] = (1 << 27).to_bytes(8, "little")
        path.write_bytes(bytes(data))

    def on_disk(path):
        index = _ivf_pq(x)
        lists = faiss.OnDiskInvertedLists(index.nlist, index.code_size, str(victim))
        lists.this.disown()  # the index owns it
        index.replace_invlists(lists, True)
        faiss.write_index(index, str(path))

    def id_map(path):
        index = faiss.IndexIDMap(faiss.IndexFlatIP(16))
        index.add_with_ids(x, np.arange(400) + 10_000)
        faiss.write_index(index, str(path))

    def ids_outside(path):
        index = _ivf_pq(x)
        index.add_with_ids(x, np.arange(400) + 1000)
        faiss.write_index(index, str(path))

    cases = [
        (flat, oversized, "declares 134,217,728 items of 4 bytes, beyond the"),
        (ivf, on_disk, "inverted lists 'ilod'"),
        (flat, id_map, "index type 'IxMp'"),
        (ivf, ids_outside, "outside its 400 vectors (rows.npy)"),
    ]
    capsys.readouterr()
    for folder, forge, message in cases:
        forge(folder / "index.faiss")
        assert main(["index", "query", str(folder), "--rows", "0,1", "--k", "3"]) == 2, forge.__name__
        line = _one_error_line(capsys)
        assert f"{folder / 'index.faiss'}: " in line and message in line, (forge.__name__, line)
        (folder / "index.faiss").write_bytes(good[folder])
    assert victim.read_text() == "safe"
    assert main(["index", "query", str(ivf), "--rows", "0,1", "--k", "3"]) == 0


def test_embed_resume_refuses_a_changed_chunk(setup, tmp_path, capsys, monkeypatch):
    """A saved chunk whose positions, dtype or arrays were changed is refused when the embed is resumed, naming the
    chunk, before anything is embedded (unchecked, shifted positions shifted the ids of the whole set silently)."""
    real_write = ChunkedWriter.write

    def stop_after_first(self, c, *a):
        real_write(self, c, *a)
        raise KeyboardInterrupt

    monkeypatch.setattr(ChunkedWriter, "write", stop_after_first)
    argv = ("--shards", str(setup["base"] / "shards"), "--split", "test", "--chunk-size", "3")
    assert embed(setup, tmp_path / "r", *argv) == 130
    monkeypatch.setattr(ChunkedWriter, "write", real_write)
    chunk = tmp_path / "r/chunks/chunk-000000.npz"
    original = chunk.read_bytes()
    with np.load(chunk) as z:
        emb, index = z["embeddings"], z["index"]
    cases = [
        ({"embeddings": emb, "index": index + 1}, "positions not increasing within this chunk's images 0 to 2"),
        ({"embeddings": emb.astype(np.float64), "index": index}, "embeddings float64"),
        ({"embeddings": emb[:, :8], "index": index}, "expected float32 N × 64"),
        ({"embeddings": emb, "index": index, "codes": np.zeros((3, 8), np.uint8)}, "holds codes, embeddings, index"),
    ]
    capsys.readouterr()
    for arrays, message in cases:
        with open(chunk, "wb") as f:
            np.savez(f, **arrays)
        assert embed(setup, tmp_path / "r", *argv, "--resume") == 2, message
        line = _one_error_line(capsys)
        assert f"{chunk}: " in line and message in line, line
        assert sorted(p.name for p in (tmp_path / "r").iterdir()) == ["chunks"]
    chunk.write_bytes(original)
    assert embed(setup, tmp_path / "r", *argv, "--resume") == 0
    assert len(load_embedding_set(tmp_path / "r")) == 8
