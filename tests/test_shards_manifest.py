"""A corrupt or hostile ``manifest.json`` is refused when it is loaded, with one line naming the key.

Both readers load the manifest the same way: ``dmltrain shards inspect`` and the streams
(training and evaluation). Byte ranges outside the shard, negative lengths, labels outside
the label space and file names leaving the shard folder must stop them before any read.
"""

from __future__ import annotations

import json
import re
import shutil

import pytest

from dmltrain.cli import main
from dmltrain.errors import UserError
from shards.build.synthetic import build_synthetic_shards
from shards.manifest import Manifest
from shards.read.stream import TrainStream, eval_batches


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("manifest") / "shards"
    build_synthetic_shards(root, classes=4, per_class=3, image_size=16, seed=0, shard_size=6, workers=0, progress=False)
    return root


def _corrupt(built, tmp_path, edit):
    out = tmp_path / "shards"
    shutil.copytree(built, out)
    data = json.loads((out / "manifest.json").read_text())
    edit(data)
    (out / "manifest.json").write_text(json.dumps(data))
    return out


def _first_shard(data, split="test"):
    return data["splits"][split]["shards"][0]


def _set_group(field, value):
    def edit(data):
        _first_shard(data)["groups"][0][field] = value

    return edit


def _set_file(name):
    def edit(data):
        _first_shard(data)["file"] = name

    return edit


CASES = {
    "offset beyond the file": (_set_group(2, 10**9), r"splits\.test\.shards\[0\]\.groups\[0\]: byte range beyond"),
    "negative length": (_set_group(3, -5), r"splits\.test\.shards\[0\]\.groups\[0\]: negative offset or length"),
    "label outside the label space": (_set_group(0, 99), r"groups\[0\]: label outside \[0, 4\)"),
    "zero count": (_set_group(1, 0), r"groups\[0\]: count below 1"),
    "path escaping the folder": (
        _set_file("../../../../etc/passwd"),
        r"splits\.test\.shards\[0\]\.file: '\.\./\.\./\.\./\.\./etc/passwd' is not a plain file name",
    ),
    "absolute path": (_set_file("/etc/passwd"), r"\.file: '/etc/passwd' is not a plain file name"),
    "file listed twice": (
        lambda d: _first_shard(d).update(file=_first_shard(d, "train")["file"]),
        r"is also listed at splits\.train\.shards\[0\]",
    ),
    "bad checksum field": (lambda d: _first_shard(d).update(sha256="x"), r"\.sha256: expected 64"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_inspect_refuses_a_corrupt_manifest_with_one_line(built, tmp_path, capsys, case):
    edit, pattern = CASES[case]
    out = _corrupt(built, tmp_path, edit)
    assert main(["shards", "inspect", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith(f"dmltrain: error: {out / 'manifest.json'}: invalid manifest ("), err
    assert re.search(pattern, err), err


@pytest.mark.parametrize("case", ["offset beyond the file", "negative length", "path escaping the folder"])
def test_streams_refuse_a_corrupt_manifest_before_reading(built, tmp_path, case):
    edit, pattern = CASES[case]
    out = _corrupt(built, tmp_path, edit)
    with pytest.raises(UserError, match=pattern):
        list(eval_batches(out, "test", rank=0, world_size=1, batch_size=4, resize=16, crop=16, loader_workers=0))
    with pytest.raises(UserError, match=pattern):
        TrainStream(
            out,
            split="train",
            rank=0,
            world_size=1,
            sampler="random",
            batch_size=4,
            samples_per_class=2,
            seed=0,
            loader_workers=0,
        )


def test_a_valid_manifest_still_loads_and_reads(built):
    m = Manifest.load(built)
    assert m.verify() == []
    batches = list(
        eval_batches(built, "test", rank=0, world_size=1, batch_size=5, resize=16, crop=16, loader_workers=0)
    )
    assert sum(len(b[1]) for b in batches) == m.split("test").num_images


def test_a_shard_that_is_a_symbolic_link_is_refused_in_one_line(built, tmp_path, capsys):
    """A shard replaced by a link to a file elsewhere (same bytes, so every checksum would match) is refused when
    the manifest is loaded, by ``inspect``, training and evaluation alike; a shard is never opened through a link."""
    from shards.manifest import open_shard

    out = tmp_path / "shards"
    shutil.copytree(built, out)
    name = _first_shard(json.loads((out / "manifest.json").read_text()))["file"]
    elsewhere = tmp_path / "elsewhere.tar"
    (out / name).rename(elsewhere)
    (out / name).symlink_to(elsewhere)
    assert main(["shards", "inspect", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and f"{out / name}: a symbolic link (to {elsewhere})" in err, err
    with pytest.raises(UserError, match="a symbolic link"):
        eval_batches(out, "test", rank=0, world_size=1, batch_size=5, resize=16, crop=16, loader_workers=0)
    with pytest.raises(OSError):
        open_shard(out / name)
    (out / name).unlink()
    elsewhere.rename(out / name)
    assert Manifest.load(out).verify() == []  # the same bytes as a regular file: fine


def test_a_manifests_fields_reach_the_terminal_and_a_run_description_inert(built, tmp_path, capsys):
    """A manifest is anyone's file: its layout, source and date are printed by ``inspect`` without control
    characters (ANSI escapes, a carriage return, a bidirectional override), and a run's description shows its
    folder's name and layout as text, never as a link or an image of their own (the layout broke out of the
    Markdown around it)."""
    from dmltrain.tracking.description import data_line

    layout = "x) [click](http://evil.example) ![i](http://evil.example/i.png) `y"
    out = _corrupt(
        built,
        tmp_path,
        lambda d: d.update(layout=layout + "\x1b[2J", source="\u202eevil\r", created="\x1b]0;title\x07now"),
    )
    assert main(["shards", "inspect", str(out), "--no-verify"]) == 0
    printed = capsys.readouterr().out
    assert "layout x) [click](http://evil.example) ![i](http://evil.example/i.png) `y[2J, source evil, built" in printed
    assert not any(c in printed for c in "\x1b\x07\u202e\r"), repr(printed)
    summary = Manifest.load(out).summary() | {"path": "/data/sh`ards"}
    line = data_line(summary, "train", ["test"])
    assert line.startswith(
        "``sh`ards`` (x) \\[click\\](http&#58;//evil.example) !\\[i\\](http&#58;//evil.example/i.png) \\`y\\[2J layout): "
    ), line
    assert "train 4 classes, 12 images; test 4 classes, 12 images" in line
