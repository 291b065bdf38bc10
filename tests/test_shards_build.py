"""`dmltrain shards build|inspect` on tiny fixtures in every official layout, plus synthetic."""

from __future__ import annotations

import contextlib
import gc
import hashlib
import io
import json
import os
import random
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
import webdataset as wds
from dataset_fixtures import (
    MAKERS,
    bomb_png,
    make_folder_shared_class,
    make_folder_tree,
    make_sop,
    write_truncated_jpeg,
)
from PIL import Image

from dmltrain.cli import main
from dmltrain.errors import UserError
from shards.build.layouts import class_sort_key
from shards.manifest import Manifest

SPLITS = {
    "sop": ("train", "test"),
    "cub": ("train", "test"),
    "cars": ("train", "test"),
    "inshop": ("train", "query", "gallery"),
    "folder": ("train", "test"),
}


def cli(*argv: str) -> int:
    return main(["shards", *argv])


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Every layout's fixture and its shard directory (small shards so classes spread over several)."""
    base = tmp_path_factory.mktemp("layouts")
    out = {}
    for name, make in MAKERS.items():
        fx = make(base / "src" / name)
        dest = base / "shards" / name
        assert (
            cli(
                "build",
                "--layout",
                name,
                "--root",
                str(fx.root),
                "--out",
                str(dest),
                "--shard-size",
                "5",
                "--quiet",
                "--workers",
                "1",
            )
            == 0
        )
        out[name] = (fx, dest)
    dest = base / "shards" / "synthetic"
    synthetic = ("--classes", "6", "--per-class", "4", "--image-size", "24")
    assert cli("build", "--layout", "synthetic", *synthetic, "--out", str(dest), "--shard-size", "7", "--quiet") == 0
    out["synthetic"] = (None, dest)
    return out


@pytest.mark.parametrize("layout", list(SPLITS))
def test_counts_mapping_and_skips(built, layout):
    fx, dest = built[layout]
    m = Manifest.load(dest)
    assert m.splits == list(SPLITS[layout]) and m.layout == layout
    for split in SPLITS[layout]:
        info = m.split(split)
        expected = fx.classes[split]
        assert info.num_images == fx.images(split)
        assert info.num_classes == len(expected)
        space = sorted({c for s in info.label_space for c in fx.classes[s]}, key=class_sort_key)
        assert list(info.classes) == space, "labels follow the sorted original ids"
        assert info.classes == {c: i for i, c in enumerate(space)}
        assert {c: info.class_counts[info.classes[c]] for c in expected} == expected
        assert sum(sh.samples for sh in info.shards) == info.num_images
        assert all(sh.samples <= 5 for sh in info.shards)
    skipped = sorted(s["path"] for split in SPLITS[layout] for s in m.split(split).skipped)
    assert skipped == sorted(fx.broken)


def test_numeric_ids_sort_as_numbers(built):
    info = Manifest.load(built["cub"][1]).split("train")
    assert info.classes == {"1": 0, "2": 1, "100": 2}
    info = Manifest.load(built["cars"][1]).split("test")
    assert info.classes == {"99": 0, "150": 1, "196": 2}


@pytest.mark.parametrize("layout", [*SPLITS, "synthetic"])
def test_train_and_test_classes_are_disjoint(built, layout):
    m = Manifest.load(built[layout][1])
    train = set(m.split("train").classes)
    evals = [s for s in m.splits if s != "train"]
    for s in evals:
        assert not train & set(k for k, v in m.split(s).classes.items() if m.split(s).class_counts[v])
    if layout == "inshop":
        q, g = m.split("query"), m.split("gallery")
        assert q.classes == g.classes and q.label_space == g.label_space == ["query", "gallery"]
        assert q.num_labels == 5 and q.num_classes == 4 and g.num_classes == 5  # item 9 is gallery-only


@pytest.mark.parametrize("layout", ["sop", "inshop", "folder", "synthetic"])
def test_shards_hold_what_the_manifest_says(built, layout):
    """Read back with a plain wds.WebDataset: keys, labels, ids, paths, source bytes, group byte ranges, checksums."""
    fx, dest = built[layout]
    m = Manifest.load(dest)
    for split in m.splits:
        info = m.split(split)
        urls = [str(sh.path) for sh in info.shards]
        samples = list(wds.WebDataset(urls, shardshuffle=False, empty_check=False, nodesplitter=None))
        assert [int(s["__key__"]) for s in samples] == list(range(info.num_images))
        labels = []
        for s in samples:
            meta = json.loads(s["json"])
            assert int(s["cls"]) == meta["label"] == info.classes[meta["class_id"]]
            assert meta["index"] == int(s["__key__"])
            image = next(s[k] for k in ("jpg", "png", "bmp") if k in s)
            if fx is not None:
                assert image == (fx.root / meta["path"]).read_bytes(), "image bytes are stored as they are"
            labels.append(meta["label"])
        # classes are contiguous runs (grouped), and the group table says where each run is
        table = info.group_table()
        assert np.repeat(table.label, table.count).tolist() == labels
        for sh in info.shards:
            raw = sh.path.read_bytes()
            assert hashlib.sha256(raw).hexdigest() == sh.sha256 and len(raw) == sh.bytes
            for _label, count, offset, length in sh.groups:
                with tarfile.open(fileobj=io.BytesIO(raw[offset : offset + length]), mode="r|") as tf:
                    names = [t.name for t in tf]
                assert len(names) == 3 * count and all(int(n.split(".")[0]) in range(info.num_images) for n in names)


def test_folder_images_decode_to_rgb(built):
    from shards.decode.transforms import EvalTransform, TrainTransform

    _, dest = built["folder"]
    info = Manifest.load(dest).split("train")
    modes = set()
    for sh in info.shards:
        for s in wds.WebDataset([str(sh.path)], shardshuffle=False, empty_check=False, nodesplitter=None):
            key = next(k for k in ("jpg", "png", "bmp") if k in s)
            modes.add(Image.open(io.BytesIO(s[key])).mode)
            rng = random.Random(0)
            assert TrainTransform(16)(s[key], rng).shape == (16, 16, 3)
            assert EvalTransform(18, 16)(s[key]).shape == (16, 16, 3)
    assert {"L", "RGBA", "RGB"} <= modes, "grayscale and RGBA are stored as they are and converted at decode time"


def test_16_bit_and_float_images_convert_exactly_and_without_float64(monkeypatch):
    """A 16-bit or float image becomes 8-bit gray as the formula says (``v * 255 // 65535`` for a 16-bit range,
    ``floor(x * 255)`` for floats in [0, 1], clipped), with numpy holding at most a few bytes a pixel while it
    converts: a 170 KB 16-bit PNG of 9,400 x 9,400 pixels took 2.85 GB per decode in float64 (24 bytes a pixel
    here). The pixel bound holds in the conversion too, whoever opened the image."""
    import tracemalloc

    from shards.decode import rgb

    h, w = 300, 400
    v = np.arange(h * w, dtype=np.int64).reshape(h, w) * 7919 % 65536
    x = ((np.arange(h * w).reshape(h, w) % 256) + 0.5) / 256  # in (0, 1), away from the steps of 1/255
    png = io.BytesIO()
    Image.frombytes("I;16", (w, h), v.astype("<u2").tobytes()).save(png, format="PNG")
    cases = {
        "16-bit PNG": (rgb.open_image(png.getvalue()), [[int(a) * 255 // 65535 for a in r] for r in v.tolist()]),
        "I": (Image.fromarray((v - 300).astype(np.int32), "I"), [[max(0, a - 300) * 255 // 65535 for a in r] for r in v.tolist()]),
        "F": (Image.fromarray(x.astype(np.float32), "F"), [[int(a * 255) for a in r] for r in x.tolist()]),
        "I small": (Image.fromarray((v % 256).astype(np.int32) - 5, "I"), [[max(0, a % 256 - 5) for a in r] for r in v.tolist()]),
    }  # fmt: skip
    for name, (img, want) in cases.items():
        img.load()
        tracemalloc.start()
        out = rgb.to_rgb(img)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        got = np.asarray(out)
        assert out.mode == "RGB" and (got[..., 0] == got[..., 2]).all(), name
        assert got[..., 0].tolist() == want, name
        assert peak <= 10 * h * w, (name, peak / (h * w))  # bytes a pixel: float64 alone is 8, three times over
    monkeypatch.setattr(rgb, "MAX_IMAGE_PIXELS", h * w - 1)
    with pytest.raises(rgb.ImageTooLarge, match=f"{w} x {h} = {h * w:,} pixels"):
        rgb.to_rgb(cases["I"][0])


def test_a_source_is_read_with_a_bound_and_only_from_a_regular_file(tmp_path, monkeypatch):
    """An image file is never read past :data:`MAX_SOURCE_BYTES` (a file of 6 GB was read whole), and a FIFO or a
    device is skipped, not read (a FIFO held the build forever)."""
    from shards.build import ingest

    monkeypatch.setattr(ingest, "MAX_SOURCE_BYTES", 1000)
    (tmp_path / "big.jpg").write_bytes(b"\xff" * 1001)
    with pytest.raises(ingest.SkipImage, match="1,001 bytes, more than the "):
        ingest.ingest_file(str(tmp_path / "big.jpg"))
    os.mkfifo(tmp_path / "fifo.jpg")
    for path in (tmp_path / "fifo.jpg", Path("/dev/zero")):
        with pytest.raises(ingest.SkipImage, match="not a regular file"):
            ingest.ingest_file(str(path))


def test_inspect_verifies_checksums(built, tmp_path, capsys):
    import shutil

    _, dest = built["sop"]
    assert cli("inspect", str(dest)) == 0
    out = capsys.readouterr().out
    n = sum(len(Manifest.load(dest).split(s).shards) for s in ("train", "test"))
    assert "train: 16 images, 5 classes" in out and f"all {n} shards match" in out
    copy = tmp_path / "copy"
    shutil.copytree(dest, copy)
    victim = Manifest.load(copy).split("test").shards[1].path
    raw = bytearray(victim.read_bytes())
    raw[700] ^= 0xFF
    victim.write_bytes(bytes(raw))
    assert cli("inspect", str(copy)) == 1
    err = capsys.readouterr().err
    assert err.count("dmltrain: error:") == 1 and victim.name in err and "checksum mismatch" in err
    victim.unlink()
    assert cli("inspect", str(copy)) == 1
    assert "shard missing" in capsys.readouterr().err


def _error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("dmltrain: error: "), err
    return err[0]


def test_bad_input_is_one_line(built, tmp_path, capsys):
    fx, _ = built["sop"]
    broken_root = tmp_path / "sop"
    make_sop(broken_root)
    (broken_root / "Ebay_test.txt").unlink()
    assert cli("build", "--layout", "sop", "--root", str(broken_root), "--out", str(tmp_path / "o1"), "--quiet") == 2
    assert str(broken_root / "Ebay_test.txt") in _error_line(capsys)
    cub = tmp_path / "cub"
    MAKERS["cub"](cub)
    import shutil

    shutil.rmtree(cub / "images")
    assert cli("build", "--layout", "cub", "--root", str(cub), "--out", str(tmp_path / "o2"), "--quiet") == 2
    assert str(cub / "images") in _error_line(capsys)
    assert (
        cli(
            "build", "--layout", "folder", "--root", str(tmp_path / "nowhere"), "--out", str(tmp_path / "o3"), "--quiet"
        )
        == 2
    )
    assert "nowhere" in _error_line(capsys)
    assert cli("build", "--layout", "synthetic", "--per-class", "3", "--out", str(tmp_path / "o4"), "--quiet") == 2
    assert "--classes" in _error_line(capsys)
    # --strict stops at the truncated JPEG and names it; nothing that looks like a manifest remains
    assert (
        cli("build", "--layout", "sop", "--root", str(fx.root), "--out", str(tmp_path / "o5"), "--strict", "--quiet")
        == 2
    )
    assert "000002_broken.JPG" in _error_line(capsys)
    assert not (tmp_path / "o5" / "manifest.json").exists()
    with pytest.raises(UserError, match="manifest.json: not found"):
        Manifest.load(tmp_path / "o5")


def test_unreadable_cars_annotations_are_one_line(built, tmp_path, capsys):
    """An empty, truncated, HDF5 (MATLAB v7.3) or foreign .mat file: one error line naming it, no traceback."""
    import shutil

    fx, _ = built["cars"]
    root = tmp_path / "cars"
    shutil.copytree(fx.root, root)
    mat = root / "cars_annos.mat"
    good = mat.read_bytes()
    # a v7.3 file is HDF5 behind a MATLAB header whose version field is 0x0200
    v73 = b"MATLAB 7.3 MAT-file, Platform: GLNXA64, Created on: Mon Jan  1 00:00:00 2024 HDF5 schema 1.00 .".ljust(116)
    v73 += b"\0" * 8 + b"\x00\x02IM" + b"\x89HDF\r\n\x1a\n" + b"\0" * 500
    cases = {
        "empty": b"",
        "truncated": good[: len(good) // 2],
        "header only": good[:100],
        "v7.3": v73,
        "no annotations": None,
    }
    for i, (what, data) in enumerate(cases.items()):
        if data is None:
            import scipy.io

            scipy.io.savemat(str(mat), {"class_names": np.array(["a", "b"], dtype=object)})
        else:
            mat.write_bytes(data)
        assert (
            cli("build", "--layout", "cars", "--root", str(root), "--out", str(tmp_path / f"o{i}"), "--quiet") == 2
        ), what
        line = _error_line(capsys)
        assert str(mat) in line, (what, line)
        if what == "v7.3":
            assert "v7.3" in line and "re-save it in MATLAB v7 format" in line


def test_manifest_keeps_strings_verbatim(tmp_path):
    """Class ids and paths that look like number lists are written as they are; number lists are compact."""
    name = "lot [1, 2]"
    fx = make_folder_tree(tmp_path / "src", {"train": {name: 2, "[3,4]": 1}, "test": {"other [ 5 ]": 2}})
    assert cli("build", "--layout", "folder", "--root", str(fx.root), "--out", str(tmp_path / "out"), "--quiet") == 0
    m = Manifest.load(tmp_path / "out")
    assert set(m.split("train").classes) == {name, "[3,4]"} and set(m.split("test").classes) == {"other [ 5 ]"}
    text = (tmp_path / "out" / "manifest.json").read_text()
    assert json.dumps(name) in text and '"other [ 5 ]"' in text
    assert json.loads(text)["splits"]["train"]["class_counts"] == [1, 2]  # sorted as strings: "[3,4]" < "lot [1, 2]"
    assert '"class_counts": [1,2]' in text  # numeric lists stay on one line
    rows = [
        line.strip().rstrip(",")
        for line in text.splitlines()
        if line.strip().startswith("[") and line.strip()[1:2].isdigit()
    ]
    assert rows and all(",".join(map(str, json.loads(r))) == r[1:-1] for r in rows)  # group rows: one compact line each
    for sh in m.split("train").shards:  # and the shards agree with the manifest about the ids
        for s in wds.WebDataset([str(sh.path)], shardshuffle=False, empty_check=False, nodesplitter=None):
            meta = json.loads(s["json"])
            assert m.split("train").classes[meta["class_id"]] == meta["label"]
            assert meta["path"].startswith(f"train/{meta['class_id']}/img")


def test_shared_train_and_test_class_is_refused(tmp_path, capsys):
    fx = make_folder_shared_class(tmp_path / "src")
    out = tmp_path / "out"
    assert cli("build", "--layout", "folder", "--root", str(fx.root), "--out", str(out), "--quiet") == 2
    line = _error_line(capsys)
    assert (
        "'banana'" in line
        and "--layout folder" in line
        and "train" in line
        and "test" in line
        and "--allow-shared-classes" in line
    )
    assert not out.exists(), "refused before anything is written"
    assert (
        cli(
            "build",
            "--layout",
            "folder",
            "--root",
            str(fx.root),
            "--out",
            str(out),
            "--quiet",
            "--allow-shared-classes",
        )
        == 0
    )
    assert "WARNING" in capsys.readouterr().err
    m = Manifest.load(out)
    assert "banana" in m.split("train").classes and "banana" in m.split("test").classes
    assert m.data["options"]["shared_classes"] == 1


def test_existing_output_refused_unless_overwrite(built, tmp_path, capsys):
    fx, dest = built["cub"]
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    assert cli("build", "--layout", "cub", "--root", str(fx.root), "--out", str(out), "--quiet") == 2
    assert "--overwrite" in _error_line(capsys)
    assert (
        cli(
            "build",
            "--layout",
            "cub",
            "--root",
            str(fx.root),
            "--out",
            str(out),
            "--quiet",
            "--overwrite",
            "--shard-size",
            "100",
        )
        == 0
    )
    assert (out / "keep.txt").exists() and sorted(p.name for p in out.glob("*.tar")) == [
        "test-000000.tar",
        "train-000000.tar",
    ]
    # same input and seed: byte-identical shards
    first = {sh.file: sh.sha256 for s in Manifest.load(out).splits for sh in Manifest.load(out).split(s).shards}
    assert (
        cli(
            "build",
            "--layout",
            "cub",
            "--root",
            str(fx.root),
            "--out",
            str(out),
            "--quiet",
            "--overwrite",
            "--shard-size",
            "100",
        )
        == 0
    )
    assert first == {sh.file: sh.sha256 for s in Manifest.load(out).splits for sh in Manifest.load(out).split(s).shards}


def test_overwrite_removes_only_what_the_old_manifest_lists(built, tmp_path, capsys):
    """A user's own ``*-*.tar`` (and anything else) in --out survives --overwrite; a shard-like file no
    manifest lists, or a manifest that cannot be read, stops the build before anything is removed."""
    fx, _ = built["cub"]
    out = tmp_path / "out"
    build = ("build", "--layout", "cub", "--root", str(fx.root), "--out", str(out), "--quiet", "--shard-size", "100")
    assert cli(*build) == 0
    mine = {
        "my-photos.tar": b"holiday",
        "backup-2024-01.tar": b"backup",
        "notes-v2.txt": b"notes",
        "archive/old-000001.tar": b"old",
    }
    for name, data in mine.items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_bytes(data)
    (out / ".train-000000.tar.k2j4.tmp").write_bytes(b"left by a killed build")
    assert cli(*build, "--overwrite") == 0
    assert {name: (out / name).read_bytes() for name in mine} == mine
    assert not (out / ".train-000000.tar.k2j4.tmp").exists()
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}

    (out / "train-000007.tar").write_bytes(b"not from this build")  # would be clobbered by a larger build
    assert cli(*build, "--overwrite") == 2
    line = _error_line(capsys)
    assert "train-000007.tar: not listed by its manifest.json" in line and "nothing was removed" in line
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file() and p.name != "train-000007.tar"} == before
    (out / "train-000007.tar").unlink()

    (out / "manifest.json").write_text(
        '{"format": "dmltrain-shards", "splits": {"test": {"shards": [{"file": "../x.tar"}]}}}'
    )
    assert cli(*build, "--overwrite") == 2
    assert "cannot tell which files are its shards" in _error_line(capsys)
    assert {p.name for p in out.iterdir()} >= {"train-000000.tar", "test-000000.tar", "my-photos.tar"}


def test_interrupted_build_leaves_no_half_shard(built, tmp_path, monkeypatch):
    import shards.build.writer

    fx, _ = built["sop"]
    real_write = shards.build.writer._HashingFile.write
    calls = {"n": 0}

    def dying_write(self, data):  # Ctrl-C in the middle of the tar stream: tarfile's frames still hold it
        calls["n"] += 1
        if calls["n"] == 8:
            raise KeyboardInterrupt
        return real_write(self, data)

    monkeypatch.setattr(shards.build.writer._HashingFile, "write", dying_write)
    unraisable = []  # tarfile's finalizer writing to the closed shard printed "Exception ignored ... Traceback"
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    out = tmp_path / "out"
    assert (
        cli("build", "--layout", "sop", "--root", str(fx.root), "--out", str(out), "--shard-size", "5", "--quiet")
        == 130
    )
    gc.collect()
    assert not unraisable, [u.exc_value for u in unraisable]
    names = sorted(p.name for p in out.iterdir())
    assert names and all(n.startswith("train-") and n.endswith(".tar") for n in names), (
        names
    )  # no temporaries, no manifest
    for p in out.iterdir():  # every shard that exists is whole: a complete tar with its end-of-archive blocks
        with tarfile.open(p) as tf:
            assert len(tf.getmembers()) % 3 == 0
    with pytest.raises(UserError, match="manifest.json: not found"):
        Manifest.load(out)


def test_ctrl_c_the_moment_a_temporary_file_exists_removes_it(tmp_path, monkeypatch):
    """The window the loaded-machine run of the Ctrl-C test hit: the interrupt lands right after the temporary
    shard file was created, before ``atomic_path`` could know its name or was inside its ``try``."""
    import dmltrain.fileio

    real_close = os.close

    def interrupted_close(fd):  # the first call after the temporary file's creation
        real_close(fd)
        raise KeyboardInterrupt

    monkeypatch.setattr(dmltrain.fileio.os, "close", interrupted_close)
    with pytest.raises(KeyboardInterrupt), dmltrain.fileio.atomic_path(tmp_path / "train-000000.tar"):
        pass
    assert list(tmp_path.iterdir()) == []


def test_resize_reencodes(built, tmp_path):
    fx, _ = built["cars"]
    out = tmp_path / "resized"
    assert cli("build", "--layout", "cars", "--root", str(fx.root), "--out", str(out), "--resize", "16", "--quiet") == 0
    info = Manifest.load(out).split("train")
    for s in wds.WebDataset(
        [str(sh.path) for sh in info.shards], shardshuffle=False, empty_check=False, nodesplitter=None
    ):
        img = Image.open(io.BytesIO(s["jpg"]))
        assert img.format == "JPEG" and min(img.size) == 16 and img.size == (24, 16)


def test_pool_build_matches_in_process(built, tmp_path, monkeypatch):
    """The parallel path (spawned processes) writes the same bytes as the in-process path."""
    import shards.build.builder

    fx, dest = built["folder"]
    monkeypatch.setattr(shards.build.builder, "POOL_MIN_IMAGES", 0)
    broken = fx.root / "train" / "banana" / "zz_truncated.jpg"
    out = tmp_path / "pool"
    write_truncated_jpeg(broken)
    try:
        assert (
            cli(
                "build",
                "--layout",
                "folder",
                "--root",
                str(fx.root),
                "--out",
                str(out),
                "--shard-size",
                "5",
                "--workers",
                "2",
                "--quiet",
            )
            == 0
        )
        monkeypatch.setattr(shards.build.builder, "POOL_MIN_IMAGES", 10**9)
        assert (
            cli(
                "build",
                "--layout",
                "folder",
                "--root",
                str(fx.root),
                "--out",
                str(tmp_path / "seq"),
                "--shard-size",
                "5",
                "--quiet",
            )
            == 0
        )
    finally:
        broken.unlink()
    a, b = Manifest.load(out), Manifest.load(tmp_path / "seq")
    for s in a.splits:
        assert [sh.sha256 for sh in a.split(s).shards] == [sh.sha256 for sh in b.split(s).shards]
    assert "train/banana/zz_truncated.jpg" in [x["path"] for x in a.split("train").skipped]


def test_synthetic_build(built):
    m = Manifest.load(built["synthetic"][1])
    train, test = m.split("train"), m.split("test")
    assert (train.num_images, train.num_classes, test.num_images, test.num_classes) == (24, 6, 24, 6)
    assert list(train.classes) == [str(i) for i in range(6)] and list(test.classes) == [str(i) for i in range(6, 12)]
    assert m.data["options"]["synthetic"] == {"classes": 6, "per_class": 4, "image_size": 24, "seed": 0}
    assert [sh.samples for sh in train.shards] == [4, 4, 4, 4, 4, 4], "a class never straddles shards when it fits"
    assert "excluded" not in m.data["options"], "a build without --exclude records nothing of it"


def _sample_paths(dest: Path) -> dict[str, list[str]]:
    """Per split, the ``path`` of every sample's JSON, in shard order, read from the tars themselves."""
    m = Manifest.load(dest)
    out = {}
    for split in m.splits:
        paths = []
        for sh in m.split(split).shards:
            with tarfile.open(sh.path) as tf:
                paths += [json.load(tf.extractfile(t))["path"] for t in tf if t.name.endswith(".json")]
        out[split] = paths
    return out


SYNTHETIC = ("--layout", "synthetic", "--classes", "6", "--per-class", "4", "--image-size", "24", "--shard-size", "7")


def test_exclude_leaves_out_the_listed_samples_and_resumes(built, tmp_path, capsys):
    """--exclude (a CSV) drops exactly the listed samples of every split: a train class whose every image is listed
    disappears, the counts fall by the number listed, options.excluded names the file, its SHA-256 and the count;
    --resume of the interrupted build keeps its shards."""
    before = _sample_paths(built["synthetic"][1])
    gone = [p for p in before["train"] if p.startswith("synthetic/000000/")]  # all of train class 0
    gone += [before["train"][-1], before["test"][0]]
    listing = tmp_path / "noisy.csv"
    listing.write_text("score,path\n" + "".join(f"0.{i},{p}\n" for i, p in enumerate(gone)))
    out = tmp_path / "out"
    assert cli("build", *SYNTHETIC, "--out", str(out), "--quiet", "--exclude", str(listing)) == 0
    assert f"left out 6 images listed in {listing} (--exclude)" in capsys.readouterr().out
    after = _sample_paths(out)
    for split in ("train", "test"):
        assert sorted(after[split]) == sorted(p for p in before[split] if p not in gone)
    m = Manifest.load(out)
    train, test = m.split("train"), m.split("test")
    assert (train.num_images, train.num_classes, test.num_images, test.num_classes) == (24 - 5, 5, 24 - 1, 6)
    assert "0" not in train.classes and list(train.classes) == ["1", "2", "3", "4", "5"]
    excluded = {"file": "noisy.csv", "sha256": hashlib.sha256(listing.read_bytes()).hexdigest(), "images": 6}
    assert m.data["options"]["excluded"] == excluded
    # an interrupted build (no manifest, a shard missing) finishes with --resume, keeping the others
    shards = {s: [sh.sha256 for sh in m.split(s).shards] for s in ("train", "test")}
    (out / "manifest.json").unlink()
    train.shards[1].path.unlink()
    assert cli("build", *SYNTHETIC, "--out", str(out), "--quiet", "--exclude", str(listing), "--resume") == 0
    m = Manifest.load(out)
    assert {s: [sh.sha256 for sh in m.split(s).shards] for s in ("train", "test")} == shards
    assert m.data["options"]["excluded"] == excluded


def test_exclude_reads_a_list_of_paths(built, tmp_path, capsys):
    """The text form (one path per line; blank lines and # comments ignored), here on a folder layout."""
    fx, dest = built["folder"]
    paths = _sample_paths(dest)
    listing = tmp_path / "bad.txt"
    listing.write_text(
        f"# from a sub-center model\n\n  {paths['train'][0]}\n{paths['test'][-1]}\n{paths['train'][0]}\n"
    )
    out = tmp_path / "out"
    argv = ("build", "--layout", "folder", "--root", str(fx.root), "--out", str(out), "--quiet", "--workers", "1")
    assert cli(*argv, "--exclude", str(listing)) == 0
    assert "left out 2 images listed in" in capsys.readouterr().out
    after = _sample_paths(out)
    assert sorted(after["train"]) == sorted(paths["train"][1:]) and sorted(after["test"]) == sorted(paths["test"][:-1])
    assert Manifest.load(out).data["options"]["excluded"]["images"] == 2


def test_bad_exclude_file_is_one_line(built, tmp_path, capsys):
    known = _sample_paths(built["synthetic"][1])["train"][0]
    cases = {
        "nowhere.txt": (None, "nowhere.txt: file not found"),
        "other.txt": (
            f"{known}\nsynthetic/000099/0000.jpg\nx.jpg\n",
            "2 of the 3 paths are in no split of the synthetic layout (first: 'synthetic/000099/0000.jpg')",
        ),
        "nopath.csv": ("file,score\na.jpg,1\n", "nopath.csv: no column 'path' (it has file, score)"),
    }
    for name, (text, line) in cases.items():
        listing = tmp_path / name
        if text is not None:
            listing.write_text(text)
        out = tmp_path / f"out-{name}"
        assert cli("build", *SYNTHETIC, "--out", str(out), "--quiet", "--exclude", str(listing)) == 2
        err = _error_line(capsys)
        assert line in err and "--exclude" in err and "Traceback" not in err, err
        assert not out.exists() or not any(out.iterdir())


def _interrupted_builds(tmp_path: Path, moments: dict) -> dict[str, tuple[int, str, list[int]]]:
    """One ``dmltrain shards build`` per moment, run side by side, each in its own process group and Ctrl-C'd
    (SIGINT to the group, as a terminal does) once ``moment(out)`` holds for its ``out``: per moment, the exit
    code, stderr and the pids of the child processes seen while it ran."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs = {}
    for name in moments:
        cmd = [sys.executable, "-m", "dmltrain", "shards", "build", *SIGINT_BUILD, "--workers", "2"]
        cmd += ["--out", str(tmp_path / name)]
        procs[name] = subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, start_new_session=True
        )
    children: dict[str, set[int]] = {name: set() for name in moments}
    waiting, deadline = set(moments), time.monotonic() + 240
    while waiting and time.monotonic() < deadline:
        for name in sorted(waiting):
            p = procs[name]
            assert p.poll() is None, f"{name}: the build ended before the moment: {p.stderr.read().decode()}"
            with contextlib.suppress(psutil.Error):
                children[name] |= {c.pid for c in psutil.Process(p.pid).children(recursive=True)}
            if moments[name](tmp_path / name):
                os.killpg(p.pid, signal.SIGINT)
                waiting.discard(name)
        time.sleep(0.005)
    out = {}
    for name, p in procs.items():
        try:
            _, err = p.communicate(timeout=60)
        except subprocess.TimeoutExpired:  # the hang this guards against: end it (and its group), then fail
            os.killpg(p.pid, signal.SIGKILL)
            p.communicate()
            pytest.fail(f"{name}: the interrupted build did not end within 60 s")
        out[name] = (p.returncode, err.decode(), sorted(children[name]))
    return out


REPO = Path(__file__).resolve().parents[1]
# 1,200 images: enough for the pool of image-checking processes, a second or two of work
SIGINT_BUILD = ("--layout", "synthetic", "--classes", "40", "--per-class", "15", "--image-size", "32")
SIGINT_BUILD += ("--shard-size", "25", "--quiet")


def _tars(out: Path) -> list[Path]:
    return sorted(out.glob("*.tar")) if out.is_dir() else []


@pytest.mark.timeout(300)
def test_ctrl_c_during_a_build_is_one_line_and_leaves_shards_to_resume(tmp_path):
    """Ctrl-C at two moments of real builds (the pool of workers starting; a shard being written after others
    were): each time the one line ``dmltrain: interrupted`` and exit 130, no traceback (tarfile's, the
    workers'), no hang, no worker left behind, no half shard; ``--resume`` then finishes the build."""
    moments = {
        "starting": lambda out: out.is_dir(),
        "writing": lambda out: len(_tars(out)) >= 4 and any(out.glob(".*.tar.*.tmp")),
    }
    for name, (code, err, children) in _interrupted_builds(tmp_path, moments).items():
        out = tmp_path / name
        assert (code, err.strip()) == (130, "dmltrain: interrupted"), f"{name}: {err}"
        gone, alive = psutil.wait_procs([psutil.Process(pid) for pid in children if psutil.pid_exists(pid)], 10)
        assert not alive, f"{name}: processes of the build outlived it: {[p.pid for p in alive]}"
        assert not any(out.glob(".*.tmp")) and not (out / "manifest.json").exists()
        for tar in _tars(out):  # whole shards only
            with tarfile.open(tar) as tf:
                assert len(tf.getmembers()) % 3 == 0
    out = tmp_path / "writing"
    assert len(_tars(out)) >= 4
    assert cli("build", *SIGINT_BUILD, "--workers", "1", "--out", str(out), "--resume") == 0  # in-process: quick
    m = Manifest.load(out)
    assert m.verify() == [] and m.split("train").num_images == m.split("test").num_images == 600


def test_an_image_too_large_to_decode_is_skipped_or_refused_in_one_line(tmp_path, capsys):
    """A decompression bomb (a small PNG claiming 10,000² or 30,000² pixels) is never decoded: skipped with the
    reason, or with --strict one line naming the file."""
    fx = make_folder_tree(tmp_path / "src", {"train": {"a": 2, "b": 2}, "test": {"c": 2, "d": 2}})
    for name, side in (("bomb.png", 10_000), ("huge.png", 30_000)):
        (fx.root / "train" / "a" / name).write_bytes(bomb_png(side, side))
    args = ("build", "--layout", "folder", "--root", str(fx.root), "--quiet", "--workers", "1")
    assert cli(*args, "--out", str(tmp_path / "out")) == 0
    skipped = {s["path"]: s["reason"] for s in Manifest.load(tmp_path / "out").split("train").skipped}
    assert skipped.keys() == {"train/a/bomb.png", "train/a/huge.png"}
    assert "10000 x 10000 = 100,000,000 pixels" in skipped["train/a/bomb.png"]
    assert all("too large to decode" in r for r in skipped.values())
    assert "skipped train/a/bomb.png: too large to decode" in capsys.readouterr().out
    assert cli(*args, "--out", str(tmp_path / "strict"), "--strict") == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "bomb.png: too large to decode" in err, err


def test_images_outside_the_root_are_refused_unless_links_are_followed(tmp_path, capsys):
    """A symbolic link (an image, or a class folder) pointing outside --root is refused in one line unless
    --follow-symlinks; a link inside the root is fine; an index naming ../ is always refused."""
    fx = make_folder_tree(tmp_path / "src", {"train": {"a": 2, "b": 2}, "test": {"c": 2, "d": 2}})
    outside = make_folder_tree(tmp_path / "private", {"train": {"x": 2}})
    secret = outside.root / "train" / "x" / "img0.jpg"
    (fx.root / "train" / "a" / "inside.jpg").symlink_to(fx.root / "train" / "b" / "img0.jpg")
    args = ("build", "--layout", "folder", "--root", str(fx.root), "--quiet", "--workers", "1")
    assert cli(*args, "--out", str(tmp_path / "ok")) == 0  # a link inside the root
    link = fx.root / "train" / "a" / "zz.jpg"
    link.symlink_to(secret)
    assert cli(*args, "--out", str(tmp_path / "no")) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and f"{link}: a symbolic link to {secret}, outside the dataset root" in err, err
    assert not (tmp_path / "no").exists()
    assert cli(*args, "--out", str(tmp_path / "yes"), "--follow-symlinks") == 0
    packed = Manifest.load(tmp_path / "yes").split("train")
    urls = [str(sh.path) for sh in packed.shards]
    paths = [json.loads(s["json"])["path"] for s in wds.WebDataset(urls, shardshuffle=False, nodesplitter=None)]
    assert "train/a/zz.jpg" in paths
    link.unlink()
    (fx.root / "train" / "linked").symlink_to(outside.root / "train" / "x")  # a whole class folder
    assert cli(*args, "--out", str(tmp_path / "no2")) == 2
    assert "train/linked/img0.jpg: a symbolic link to" in capsys.readouterr().err
    sop = make_sop(tmp_path / "sop")
    index = sop.root / "Ebay_train.txt"
    index.write_text(index.read_text() + "99 99 1 ../private/train/x/img0.jpg\n")
    sop_args = ("build", "--layout", "sop", "--root", str(sop.root), "--quiet", "--follow-symlinks")
    assert cli(*sop_args, "--out", str(tmp_path / "sop-out")) == 2
    assert "outside the dataset root" in capsys.readouterr().err
