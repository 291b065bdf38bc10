"""`dmltrain shards build --layout table`: a CSV or Parquet list of images, its queries and gallery, its errors."""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from dataset_fixtures import make_inshop, make_table

from dmltrain.cli import main
from dmltrain.errors import UserError
from dmltrain.evaluate.sources import table_source
from shards.build.table import Table, read_table
from shards.manifest import Manifest

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def build(root, out, *extra: str) -> int:
    return main(["shards", "build", "--layout", "table", "--root", str(root), "--out", str(out), "--quiet", *extra])


def error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("dmltrain: error: "), err
    return err[0]


@pytest.fixture(scope="module")
def tables(tmp_path_factory):
    base = tmp_path_factory.mktemp("tables")
    return {fmt: make_table(base / fmt, fmt) for fmt in ("csv", "parquet")}


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
def test_table_builds_query_gallery_and_keeps_columns(tables, tmp_path, fmt):
    table, fx = tables[fmt]
    out = tmp_path / "shards"
    assert build(table, out, "--shard-size", "4") == 0
    m = Manifest.load(out)
    assert m.layout == "table" and m.splits == ["train", "query", "gallery"]
    for split in m.splits:
        info = m.split(split)
        counts = {orig: info.class_counts[label] for orig, label in info.classes.items() if info.class_counts[label]}
        assert counts == fx.classes[split], split
    q, g = m.split("query"), m.split("gallery")
    assert q.classes == g.classes and q.label_space == ["query", "gallery"]  # one label space
    assert set(m.split("train").classes).isdisjoint(g.classes)
    # the rows file: one row per sample, by index; the extra columns as text, the path as the table wrote it
    rows = m.rows("gallery")
    assert rows["index"] == list(range(g.num_images)) and g.columns == ["sku", "price"]
    written = {}
    for sh in g.shards:
        with tarfile.open(sh.path) as tar:
            for member in tar.getmembers():
                if member.name.endswith(".json"):
                    meta = json.loads(tar.extractfile(member).read())
                    written[meta["index"]] = meta
    for i in range(g.num_images):
        meta = written[i]
        assert rows["path"][i] == meta["path"] and rows["class_id"][i] == meta["class_id"]
        assert rows["sku"][i] == meta["extra"]["sku"] == f"sku-{meta['class_id']}-{meta['path'][-5]}"
        assert float(rows["price"][i]) == 9.5 + int(meta["path"][-5])
    absolute = [p for p in m.rows("train")["path"] if p.startswith("/")]
    assert len(absolute) == 1 and absolute[0].endswith("images/shoe/0.jpg")  # an absolute path, read as one
    assert main(["shards", "inspect", str(out)]) == 0  # the rows files are verified with the shards
    (out / "gallery-rows.parquet").write_bytes(b"garbled")
    assert main(["shards", "inspect", str(out)]) == 1


def test_every_test_row_both_is_self_retrieval(tmp_path):
    table, fx = make_table(tmp_path, "parquet", inshop=False)
    layout = read_table(table)
    assert list(layout.splits) == ["train", "test"] and layout.label_spaces == []
    assert {e.class_id for e in layout.splits["test"]} == set(fx.classes["test"])
    # OML's split name and URLs: file:// is read as the local path
    frame = pd.read_parquet(table).assign(split=lambda f: f.split.replace("test", "validation"))
    frame.loc[1, "path"] = "file://" + str((tmp_path / frame.loc[1, "path"]).resolve())
    frame.to_parquet(tmp_path / "oml.parquet")
    layout = read_table(tmp_path / "oml.parquet")
    assert [len(v) for v in layout.splits.values()] == [9, 8]
    assert layout.splits["train"][1].path == str((tmp_path / "images/shoe/1.jpg").resolve())


def test_urls_are_read_through_fsspec(tmp_path, capsys):
    """Rows naming URLs (fsspec's in-memory store stands for a bucket): looked up before the build, read in it."""
    import fsspec

    table, _ = make_table(tmp_path, "csv", inshop=False)
    frame = pd.read_csv(table, dtype=str, keep_default_na=False)
    fs = fsspec.filesystem("memory")
    try:
        for i in (3, 12):
            fs.pipe(f"/dmltrain-test/{i}.jpg", (tmp_path / frame.path[i]).read_bytes())
            frame.loc[i, "path"] = f"memory://dmltrain-test/{i}.jpg"
        assert build(_write(tmp_path, frame, "urls.csv"), tmp_path / "out") == 0
        assert "memory://dmltrain-test/12.jpg" in Manifest.load(tmp_path / "out").rows("test")["path"]
        frame.loc[5, "path"] = "memory://dmltrain-test/none.jpg"
        assert build(_write(tmp_path, frame, "urls.csv"), tmp_path / "out2") == 2
        assert (
            "urls.csv row 6 (line 7), column path: memory://dmltrain-test/none.jpg: image file not found"
            in error_line(capsys)
        )
    finally:
        fs.rm("/dmltrain-test", recursive=True)


def test_relative_paths_resolve_against_a_url_as_against_a_folder(tmp_path):
    """A relative path under a URL table is joined as a local one is (``.`` and ``..`` segments resolved, dot files
    kept); one climbing above the URL's bucket or host is refused naming the row, before anything is read."""
    import fsspec

    url = Table("t.csv", {}, True, "s3://bucket/data")
    local = Table("t.csv", {}, True, str(tmp_path / "data"))
    for raw, under in [
        ("./.hidden/a.jpg", "data/.hidden/a.jpg"),
        ("./../img/a.jpg", "img/a.jpg"),
        ("../img/a.jpg", "img/a.jpg"),
        ("sub/./x/../a.jpg", "data/sub/a.jpg"),
        ("..data/a.jpg", "data/..data/a.jpg"),
    ]:
        assert url.resolve(raw, 0) == f"s3://bucket/{under}", raw
        assert Path(local.resolve(raw, 0)).resolve() == tmp_path.resolve() / under, raw  # the same file, locally
    fs = fsspec.filesystem("memory")
    try:
        fs.pipe("/dmltrain-test/t/table.csv", b"path,label,split\na.jpg,x,train\n../../b.jpg,y,test\n")
        with pytest.raises(UserError) as e:
            read_table("memory://dmltrain-test/t/table.csv")
        assert "table.csv row 2 (line 3), column path: ../../b.jpg climbs above memory://dmltrain-test" in str(e.value)
    finally:
        fs.rm("/dmltrain-test", recursive=True)


def test_a_url_password_in_the_table_fetches_but_is_never_printed_or_written(tmp_path, capsys):
    """Rows naming ``http://user:PASSWORD@host/...`` (a loopback server that answers only with those credentials):
    the images are fetched with the password, and every output carries the URL without it: the summary, the
    manifest's skipped list, each sample's JSON in the shards, the rows file, and ``embed --table``'s ids."""
    from object_store import Faults, RangeHTTPServer

    table, _ = make_table(tmp_path, "csv", inshop=False)
    frame = pd.read_csv(table, dtype=str, keep_default_na=False)
    (tmp_path / "images" / "broken.jpg").write_bytes(b"not an image")
    server = RangeHTTPServer(tmp_path / "images", Faults(seed=0), auth="reader:SEKRET-pw").start()
    try:
        with_password = server.url.replace("http://", "http://reader:SEKRET-pw@")
        for i in (3, 12):
            frame.loc[i, "path"] = f"{with_password}/{frame.path[i].removeprefix('images/')}"
        frame.loc[5, "path"] = f"{with_password}/broken.jpg"  # skipped, and listed
        out, urls = tmp_path / "out", _write(tmp_path, frame, "urls.csv")
        assert main(["shards", "build", "--layout", "table", "--root", str(urls), "--out", str(out), "--quiet"]) == 0
        source = table_source(urls, "test")  # dmltrain embed --table: the ids it writes, the paths it reads
    finally:
        server.stop()
    printed = "".join(capsys.readouterr())
    shown = server.url.replace("http://", "http://<redacted>@")
    assert f"{shown}/belt/0.jpg" in source.ids and f"{with_password}/belt/0.jpg" in source.paths
    assert f"skipped {shown}/broken.jpg" in printed
    m = Manifest.load(out)
    assert sum(m.split(s).num_images for s in m.splits) == len(frame) - 1  # the two URL rows read, with the password
    rows = [p for s in m.splits for p in m.rows(s)["path"]]
    assert sum(p.startswith(f"{shown}/") for p in rows) == 2
    written = [printed, (out / "manifest.json").read_text()]
    written += [str(pd.read_parquet(f).to_dict()) for f in out.glob("*-rows.parquet")]
    for shard in out.glob("*.tar"):
        with tarfile.open(shard) as tar:
            written += [tar.extractfile(x).read().decode() for x in tar.getmembers() if x.name.endswith(".json")]
    assert not [w for w in written if "SEKRET" in w]


def _write(tmp_path, frame: pd.DataFrame, name="bad.csv"):
    path = tmp_path / name
    frame.to_csv(path, index=False)
    return path


def test_bad_rows_are_one_line_naming_row_and_column(tables, tmp_path, capsys):
    table, _ = tables["csv"]
    good = pd.read_csv(table, dtype=str, keep_default_na=False)
    good["path"] = [p if p.startswith("/") else str(table.parent / p) for p in good.path]  # absolute: any folder

    def at(column: str, row: int, value: str) -> pd.DataFrame:  # ``row`` 1-based, as the messages count
        return good.assign(**{column: good[column].where(good.index != row - 1, value)})

    cases = {  # what is wrong: (the table, where the message points, what it says); row r is line r + 1 of a CSV
        "missing file": (at("path", 4, "/nowhere/x.jpg"), "row 4 (line 5), column path", "/nowhere/x.jpg: image file not found"),
        "unknown split": (at("split", 3, "holdout"), "row 3 (line 4), column split", "unknown split 'holdout'"),
        "shared label": (at("label", 13, "shoe"), "rows 13 and 1, column label", "'shoe' is in both the query+gallery and the train"),
        "duplicate path": (at("path", 6, good.path[4]), "row 6 (line 7), column path", "listed twice (also at row 5)"),
        "empty label": (at("label", 8, ""), "row 8 (line 9), column label", "empty"),
        "bad flag": (at("is_query", 10, "maybe"), "row 10 (line 11), column is_query", "'maybe' is not true or false"),
        "train query": (at("is_query", 1, "1"), "row 1 (line 2), column is_query", "a train row cannot be"),
        "neither": (at("is_gallery", 11, "False"), "row 11 (line 12), column is_query", "neither a query nor a gallery"),
        "no label column": (good.drop(columns="label"), "bad.csv: no column 'label'", "it has path, split"),
        "one flag column": (good.drop(columns="is_gallery"), "column 'is_query' without 'is_gallery'", "give both"),
    }  # fmt: skip
    for name, (frame, where, what) in cases.items():
        assert build(_write(tmp_path, frame), tmp_path / "out") == 2, name
        line = error_line(capsys)
        assert where in line and what in line, (name, line)
        assert not (tmp_path / "out").exists(), name  # refused before anything is written
    frame = at("path", 5, "images/missing.jpg")  # relative to the table's folder
    assert build(_write(tmp_path, frame), tmp_path / "out") == 2
    assert f"{tmp_path}/images/missing.jpg: image file not found" in error_line(capsys)
    frame.to_parquet(tmp_path / "bad.parquet")
    assert build(tmp_path / "bad.parquet", tmp_path / "out") == 2
    assert "bad.parquet row 5, column path" in error_line(capsys)  # no line numbers in a Parquet file
    (tmp_path / "bad.txt").write_text("path,label,split\n")
    assert build(tmp_path / "bad.txt", tmp_path / "out") == 2
    assert "expected a .csv or .parquet file" in error_line(capsys)
    # shared labels may be built on purpose
    frame = at("label", 13, "shoe")
    assert build(_write(tmp_path, frame), tmp_path / "out", "--allow-shared-classes") == 0


def test_inshop_metrics_from_table_equal_those_from_the_layout(tmp_path):
    """The In-Shop fixture built from its partition file, and from a CSV listing the same images: the same
    query→gallery evaluation of the same model gives the same metrics."""
    import torch

    from dmltrain.config import DataConfig, EvalConfig
    from dmltrain.evaluate import evaluate_model
    from dmltrain.models import build_model

    make_inshop(tmp_path / "inshop")
    lines = (tmp_path / "inshop" / "list_eval_partition.txt").read_text().splitlines()[2:]
    rows = [line.split() for line in lines]
    frame = pd.DataFrame(
        {
            "path": [r[0] for r in rows],
            "label": [r[1] for r in rows],
            "split": ["train" if r[2] == "train" else "test" for r in rows],
            "is_query": [r[2] == "query" for r in rows],
            "is_gallery": [r[2] == "gallery" for r in rows],
        }
    )
    frame.to_csv(tmp_path / "inshop" / "table.csv", index=False)
    args = ("--quiet", "--shard-size", "5")
    assert (
        main(
            [
                "shards",
                "build",
                "--layout",
                "inshop",
                "--root",
                str(tmp_path / "inshop"),
                "--out",
                str(tmp_path / "a"),
                *args,
            ]
        )
        == 0
    )
    assert build(tmp_path / "inshop" / "table.csv", tmp_path / "b", *args[1:]) == 0
    torch.manual_seed(0)
    model = build_model({"backbone": "small_cnn", "embedding_dim": 64})
    data = DataConfig(eval_resize=32, eval_crop=32, loader_workers=0, eval_batch_size=8)
    cfg = EvalConfig(ks=[1, 2, 4], nmi=False, rerank="kr", rerank_params={"candidates": 6, "kr_k1": 3, "kr_k2": 2})
    got = [evaluate_model(model, str(tmp_path / d), ["query", "gallery"], cfg, data)[0] for d in "ab"]
    assert got[0] == got[1] and got[0]["num_queries"] == 8 and got[0]["gallery_size"] == 10
    assert {f"rerank/recall@{k}" for k in (1, 2, 4)} <= set(got[0])  # the evaluation re-ranks as configured
    ma, mb = Manifest.load(tmp_path / "a"), Manifest.load(tmp_path / "b")
    for split in ("query", "gallery"):
        assert ma.split(split).classes == mb.split(split).classes
    assert np.isfinite(got[0]["recall@1"])
