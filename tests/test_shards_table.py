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
        assert build(urls, out, "--allow-private-urls") == 0  # the server is on loopback
        source = table_source(urls, "test", allow_private=True)  # embed --table: the ids it writes, the paths it reads
    finally:
        server.stop()
    printed = "".join(capsys.readouterr())
    assert "--allow-private-urls: 3 of the table's images from loopback, link-local or private hosts" in printed
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
        assert build(_write(tmp_path, frame), tmp_path / "out", "--allow-outside-paths") == 2, name
        line = error_line(capsys)
        assert where in line and what in line, (name, line)
        assert not (tmp_path / "out").exists(), name  # refused before anything is written
    frame = at("path", 5, "images/missing.jpg")  # relative to the table's folder
    assert build(_write(tmp_path, frame), tmp_path / "out", "--allow-outside-paths") == 2
    assert f"{tmp_path}/images/missing.jpg: image file not found" in error_line(capsys)
    frame.to_parquet(tmp_path / "bad.parquet")
    assert build(tmp_path / "bad.parquet", tmp_path / "out", "--allow-outside-paths") == 2
    assert "bad.parquet row 5, column path" in error_line(capsys)  # no line numbers in a Parquet file
    (tmp_path / "bad.txt").write_text("path,label,split\n")
    assert build(tmp_path / "bad.txt", tmp_path / "out") == 2
    assert "expected a .csv or .parquet file" in error_line(capsys)
    # shared labels may be built on purpose
    frame = at("label", 13, "shoe")
    assert build(_write(tmp_path, frame), tmp_path / "out", "--allow-shared-classes", "--allow-outside-paths") == 0


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


# -- what a table may reach, and how much of it (#35) --------------------------------------------------------------
def _with_paths(table: Path, paths: dict[int, str], name: str = "bad.csv") -> Path:
    """A copy of ``table`` beside it, with the path of each row (0-based) in ``paths`` replaced."""
    frame = pd.read_csv(table, dtype=str, keep_default_na=False)
    for row, path in paths.items():
        frame.loc[row, "path"] = path
    return _write(table.parent, frame, name)


def test_a_table_names_files_under_its_own_folder_only(tmp_path, capsys):
    """An absolute path elsewhere, ``../`` out of the table's folder, a symbolic link pointing out and a ``file://``
    or ``local://`` URL to a file elsewhere are refused in one line naming the row, before anything is written (they
    were packed: a table could copy any file its user can read into shards). ``--allow-outside-paths`` packs them,
    and the summary and the manifest say how many; a link within the folder needs nothing."""
    data = tmp_path / "data"
    table, _ = make_table(data, "csv", inshop=False)
    elsewhere = tmp_path / "private" / "photo.jpg"
    elsewhere.parent.mkdir()
    elsewhere.write_bytes((data / "images/shoe/1.jpg").read_bytes())
    (elsewhere.parent / "other.jpg").write_bytes((data / "images/shoe/2.jpg").read_bytes())
    (data / "images" / "out.jpg").symlink_to(elsewhere)
    (data / "images" / "in.jpg").symlink_to(data / "images/hat/1.jpg")
    outside = {4: str(elsewhere), 5: "../private/photo.jpg", 6: "images/out.jpg", 7: f"file://{elsewhere}"}
    outside[7] = f"file://{elsewhere.parent / 'other.jpg'}"  # each file once
    for row, path in {**outside, 8: f"local://{elsewhere}"}.items():
        assert build(_with_paths(table, {row: path}), tmp_path / "out") == 2, path
        line = error_line(capsys)
        assert f"bad.csv row {row + 1} (line {row + 2}), column path: {path}: " in line, line
        assert "outside the table's folder" in line and "(pass --allow-outside-paths" in line, line
        assert ("a symbolic link to " in line) == (row == 6) and not (tmp_path / "out").exists()
    # a link in the folder, then `..`: the system resolves the link first (lnk/../photo.jpg is photo.jpg beside the
    # link's target, outside), whatever the name's normal form (images/photo.jpg) says
    (elsewhere.parent / "sub").mkdir()
    (data / "images" / "lnk").symlink_to(elsewhere.parent / "sub")
    assert build(_with_paths(table, {4: "images/lnk/../photo.jpg"}), tmp_path / "out") == 2
    line = error_line(capsys)
    assert "images/lnk/../photo.jpg: " in line and f"a symbolic link to {elsewhere}" in line, line
    assert not (tmp_path / "out").exists()
    assert build(_with_paths(table, {2: "images/in.jpg"}), tmp_path / "in") == 0  # a link within: packed
    capsys.readouterr()
    assert build(_with_paths(table, outside), tmp_path / "out", "--allow-outside-paths") == 0
    printed = capsys.readouterr().out
    assert "--allow-outside-paths: 4 of the table's images from outside the table's folder were allowed" in printed
    assert Manifest.load(tmp_path / "out").data["options"]["allowed"] == {"--allow-outside-paths": 4}
    # a table read from a URL names no local file at all
    import fsspec

    fs = fsspec.filesystem("memory")
    try:
        fs.pipe("/dmltrain-test/t/table.csv", f"path,label,split\na.jpg,x,train\n{elsewhere},y,test\n".encode())
        with pytest.raises(UserError) as e:
            read_table("memory://dmltrain-test/t/table.csv")
        assert "table.csv row 2 (line 3), column path" in str(e.value) and "a local file, named by a table" in str(
            e.value
        )
    finally:
        fs.rm("/dmltrain-test", recursive=True)


def test_a_tables_urls_reach_public_hosts_only(tmp_path, capsys):
    """A URL in a table whose host is loopback, link-local (a cloud's metadata service) or private is refused in one
    line naming the row, before any request (it was fetched, and its answer packed); so is a scheme a table may not
    name. ``--allow-private-urls`` fetches them, and says so. ``embed --table`` holds the same rule."""
    from object_store import Faults, RangeHTTPServer

    table, _ = make_table(tmp_path, "csv", inshop=False)
    server = RangeHTTPServer(tmp_path / "images", Faults(seed=0)).start()
    port = server.url.rsplit(":", 1)[1]
    try:
        cases = [
            (f"{server.url}/shoe/1.jpg", "its host is 127.0.0.1, a loopback address"),
            (f"http://localhost:{port}/shoe/1.jpg", "its host localhost resolves to "),
            ("http://169.254.169.254/latest/meta-data/x.jpg", "its host is 169.254.169.254, a link-local address"),
            ("https://[::ffff:10.1.2.3]/x.jpg", "its host is ::ffff:10.1.2.3, a private address"),
            ("http://0.0.0.0/x.jpg", "its host is 0.0.0.0, an unspecified address"),
        ]
        for url, why in cases:
            assert build(_with_paths(table, {4: url}), tmp_path / "out") == 2, url
            line = error_line(capsys)
            assert f"bad.csv row 5 (line 6), column path: {url}: {why}" in line and "--allow-private-urls" in line
            assert not (tmp_path / "out").exists()
        for url in ("ftp://files.example/x.jpg", "sftp://files.example/x.jpg", "github://org:repo@main/x.jpg"):
            assert build(_with_paths(table, {4: url}), tmp_path / "out") == 2, url
            assert "a table's URLs are s3, gs, az, http(s) or file URLs, not " in error_line(capsys)
        with pytest.raises(UserError, match="its host is 127.0.0.1, a loopback address"):
            table_source(_with_paths(table, {9: f"{server.url}/sock/1.jpg"}), None)
        assert server.requests == 0  # nothing was asked of the server
        bad = _with_paths(table, {4: f"{server.url}/shoe/1.jpg", 10: f"http://localhost:{port}/sock/1.jpg"})
        assert build(bad, tmp_path / "out", "--allow-private-urls") == 0
        assert len(table_source(bad, None, allow_private=True).paths) == 17
    finally:
        server.stop()
    assert "--allow-private-urls: 2 of the table's images from loopback" in capsys.readouterr().out


def test_every_connection_of_a_tables_urls_is_checked(tmp_path):
    """What the up-front check passes is checked again at each connection (a redirect, or a name that resolves
    elsewhere the second time): a guarded read of a loopback server is refused before it connects, in one attempt,
    and the image skipped with the reason; the table's own host, named by the user, is allowed."""
    from object_store import Faults, RangeHTTPServer

    from shards.build.ingest import SkipImage, read_source
    from shards.storage.location import HostGuard, Location
    from shards.storage.retries import IOStats

    make_table(tmp_path, "csv", inshop=False)
    server = RangeHTTPServer(tmp_path / "images", Faults(seed=0)).start()
    try:
        loc, stats = Location(f"{server.url}/shoe", guard=HostGuard()), IOStats()
        with pytest.raises(OSError):
            loc.run(loc.call("cat_file", loc.url("1.jpg"), stats=stats))
        assert stats.counts["requests"] == 1 and stats.retries == 0  # refused: never retried
        with pytest.raises(SkipImage, match="refused to connect to 127.0.0.1, a loopback address"):
            read_source(f"{server.url}/shoe/2.jpg", guard=HostGuard())
        assert server.requests == 0
        allowed = HostGuard.allowing(f"{server.url}/table.csv")
        assert read_source(f"{server.url}/shoe/1.jpg", guard=allowed) == (tmp_path / "images/shoe/1.jpg").read_bytes()
    finally:
        server.stop()


def test_a_presigned_urls_secrets_are_used_but_never_written_or_printed(tmp_path, capsys):
    """A presigned URL's query string (``X-Amz-Signature``, ``X-Amz-Credential``, ``X-Amz-Security-Token``, Azure's
    ``sig``, ``token``) fetches the image and is written and printed without its secrets: the summary, the
    manifest, each sample's JSON, the rows file, ``embed --table``'s ids; its other parameters stay."""
    from object_store import Faults, RangeHTTPServer

    table, _ = make_table(tmp_path, "csv", inshop=False)
    (tmp_path / "images" / "broken.jpg").write_bytes(b"not an image")
    server = RangeHTTPServer(tmp_path / "images", Faults(seed=0)).start()
    signed = (
        "?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential=AKIASEKRET1%2F20260101&X-Amz-Expires=600"
        "&X-Amz-Security-Token=SEKRET2&X-Amz-Signature=SEKRET3"
    )
    try:
        urls = {3: f"{server.url}/shoe/1.jpg{signed}", 12: f"{server.url}/belt/0.jpg?sv=2024&sig=SEKRET4"}
        urls[5] = f"{server.url}/broken.jpg?token=SEKRET5"  # skipped, and listed
        bad = _with_paths(table, urls, "signed.csv")
        assert build(bad, tmp_path / "out", "--allow-private-urls") == 0
        ids = table_source(bad, "test", allow_private=True).ids
    finally:
        server.stop()
    printed = "".join(capsys.readouterr())
    m = Manifest.load(tmp_path / "out")
    assert sum(m.split(s).num_images for s in m.splits) == 16  # the two signed images fetched
    rows = [p for s in m.splits for p in m.rows(s)["path"]]
    redacted = f"{server.url}/shoe/1.jpg?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential=<redacted>&X-Amz-Expires=600"
    assert f"{redacted}&X-Amz-Security-Token=<redacted>&X-Amz-Signature=<redacted>" in rows
    assert f"{server.url}/belt/0.jpg?sv=2024&sig=<redacted>" in ids
    assert f"skipped {server.url}/broken.jpg?token=<redacted>" in printed
    written = [printed, (tmp_path / "out" / "manifest.json").read_text(), *ids]
    written += [str(pd.read_parquet(f).to_dict()) for f in (tmp_path / "out").glob("*-rows.parquet")]
    for shard in (tmp_path / "out").glob("*.tar"):
        with tarfile.open(shard) as tar:
            written += [tar.extractfile(x).read().decode() for x in tar.getmembers() if x.name.endswith(".json")]
    assert not [w for w in written if "SEKRET" in w]


def test_a_tables_sizes_are_bounded(tmp_path, capsys):
    """An image file larger than MAX_SOURCE_BYTES (it was read whole: a 6 GB one ended in a MemoryError), more
    columns than MAX_COLUMNS (the time grew with their square) and a cell longer than MAX_CELL_CHARS (copied into
    every sample's JSON) are each one line naming the table, before anything is built."""
    from shards.build.ingest import MAX_SOURCE_BYTES
    from shards.build.table import MAX_CELL_CHARS, MAX_COLUMNS

    table, _ = make_table(tmp_path, "csv", inshop=False)
    huge = tmp_path / "images" / "huge.jpg"
    with open(huge, "wb") as f:
        f.truncate(MAX_SOURCE_BYTES + 1)  # sparse: no disk is used
    assert build(_with_paths(table, {4: "images/huge.jpg"}), tmp_path / "out") == 2
    line = error_line(capsys)
    assert f"bad.csv row 5 (line 6), column path: {huge}: {MAX_SOURCE_BYTES + 1:,} bytes, more than the 256 MiB" in line
    frame = pd.read_csv(table, dtype=str, keep_default_na=False)
    wide = frame.assign(**{f"c{i}": "x" for i in range(MAX_COLUMNS)})
    assert build(_write(tmp_path, wide, "wide.csv"), tmp_path / "out") == 2
    assert f"wide.csv: {MAX_COLUMNS + 7} columns, more than the {MAX_COLUMNS} a table may have" in error_line(capsys)
    wide.to_parquet(tmp_path / "wide.parquet")
    assert build(tmp_path / "wide.parquet", tmp_path / "out") == 2
    assert f"wide.parquet: {MAX_COLUMNS + 7} columns" in error_line(capsys)
    long = frame.assign(sku=frame.sku.where(frame.index != 7, "x" * (MAX_CELL_CHARS + 1)))
    assert build(_write(tmp_path, long, "long.csv"), tmp_path / "out") == 2
    line = error_line(capsys)
    assert f"long.csv row 8 (line 9), column sku: {MAX_CELL_CHARS + 1:,} characters, more than the" in line
    assert not (tmp_path / "out").exists()


def test_control_characters_of_a_table_never_reach_the_terminal(tmp_path, capsys):
    """A path or label with ANSI escapes, a carriage return or a bidirectional override is printed without them:
    in an error line and in the build's list of skipped images."""
    table, _ = make_table(tmp_path, "csv", inshop=False)
    evil = "images/\x1b[2J\x1b]0;pwned\x07\u202egpj.jpg"
    (tmp_path / "images" / "ok\x1b[31m.jpg").write_bytes(b"not an image")
    assert build(_with_paths(table, {4: evil}), tmp_path / "out") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "images/[2J]0;pwnedgpj.jpg: image file not found" in err
    assert build(_with_paths(table, {4: "images/ok\x1b[31m.jpg"}), tmp_path / "out") == 0
    out = capsys.readouterr().out
    assert "skipped images/ok[31m.jpg: not an image PIL can read" in out
    for text in (err, out):
        assert not any(c in text for c in "\x1b\x07\u202e\r"), repr(text)
