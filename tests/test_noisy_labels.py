"""``dmltrain noisy-labels`` (#26, sub-center ArcFace's noisy-label recipe): the dominant sub-centers and angles
against a loop-by-loop transcription, and the command on real shards with synthetic label noise and a saved
sub-center checkpoint: the listed samples are exactly the reference's, with the paths the shards record, and
the bad inputs are one line."""

from __future__ import annotations

import csv
import json
import math
import tarfile

import numpy as np
import pytest
import torch

from dmltrain.cli import main
from dmltrain.evaluate.noisy_labels import subcenter_angles


def _reference(x: torch.Tensor, y: list[int], w: torch.Tensor) -> tuple[list[float], list[int], list[int]]:
    """The paper's reading, sample by sample: nearest sub-center, each class's most counted one, the angle to it."""
    C, k, _ = w.shape
    unit = lambda v: v / math.sqrt(sum(float(t) ** 2 for t in v))  # noqa: E731
    cos = [[float(unit(x[i]) @ unit(w[y[i], j])) for j in range(k)] for i in range(len(y))]
    nearest = [max(range(k), key=lambda j: (cos[i][j], -j)) for i in range(len(y))]
    counts = [[0] * k for _ in range(C)]
    for i, c in enumerate(y):
        counts[c][nearest[i]] += 1
    dominant = [max(range(k), key=lambda j: (counts[c][j], -j)) for c in range(C)]
    angle = [math.degrees(math.acos(max(-1.0, min(1.0, cos[i][dominant[y[i]]])))) for i in range(len(y))]
    return angle, nearest, dominant


def test_dominant_subcenters_and_angles_equal_a_transcription():
    g = torch.Generator().manual_seed(0)
    C, k, D, N = 5, 3, 6, 40
    w = torch.randn(C, k, D, generator=g)
    y = torch.randint(0, C - 1, (N,), generator=g)  # the last class has no sample: dominant 0
    x = w[y, torch.randint(0, k, (N,), generator=g)] + 0.8 * torch.randn(N, D, generator=g)
    angle, nearest, dominant = subcenter_angles(x, y, w)
    ref_angle, ref_nearest, ref_dominant = _reference(x, y.tolist(), w)
    assert nearest.tolist() == ref_nearest and dominant.tolist() == ref_dominant
    assert dominant[C - 1] == 0
    assert np.allclose(angle.numpy(), ref_angle, atol=1e-9)


@pytest.fixture(scope="module")
def noisy_run(tmp_path_factory):
    """Synthetic shards with 25 % label noise, and a checkpoint folder of a 2-sub-center classifier over them."""
    from dmltrain.config import load_config
    from dmltrain.distributed import ShardedClassifier
    from dmltrain.distributed.class_checkpoint import save_by_class
    from dmltrain.models import build_model, save_model
    from shards.build.synthetic import build_synthetic_shards

    root = tmp_path_factory.mktemp("noisy")
    build_synthetic_shards(root / "shards", classes=4, per_class=6, image_size=32, seed=0, shard_size=10,
                           workers=0, progress=False, label_noise=0.25)  # fmt: skip
    cfg = load_config(None, ["model.backbone=small_cnn", "model.embedding_dim=64", "data.eval_crop=32",
                             "data.eval_resize=32", f"data.shards={root / 'shards'}",
                             "loss.classifier.kind=cosface", "loss.classifier.params.subcenters=2"])  # fmt: skip
    torch.manual_seed(0)
    ckpt = root / "checkpoint-step00000010"
    save_model(ckpt / "model.pt", build_model(cfg.model), cfg.to_dict())
    clf = ShardedClassifier(4, 64, "cosface", seed=3, subcenters=2)
    save_by_class(clf, ckpt / "classifier")
    return root, ckpt, clf.full_weight().detach()


def test_the_command_lists_the_samples_beyond_the_angle_with_their_paths(noisy_run, tmp_path, capsys):
    root, ckpt, w = noisy_run
    # the reference's inputs: the split's embeddings (dmltrain embed) and each sample's recorded path and label
    assert main(["embed", str(ckpt / "model.pt"), "--shards", str(root / "shards"), "--split", "train",
                 "--out", str(tmp_path / "emb"), "--loader-workers", "0", "--quiet"]) == 0  # fmt: skip
    x = torch.from_numpy(np.load(tmp_path / "emb" / "embeddings.npy").copy())
    meta = {}
    for tar in sorted((root / "shards").glob("train-*.tar")):
        with tarfile.open(tar) as t:
            for m in t:
                if m.name.endswith(".json"):
                    d = json.loads(t.extractfile(m).read())
                    meta[d["index"]] = d
    manifest = json.loads((root / "shards" / "manifest.json").read_text())["splits"]["train"]
    import pyarrow.parquet as pq

    idx = pq.read_table(tmp_path / "emb" / "ids.parquet").column("index").to_pylist()
    y = [meta[i]["label"] for i in idx]
    angle, _, _ = _reference(x, y, w)
    threshold = float(np.median(angle))
    want = {meta[i]["path"] for i, a in zip(idx, angle) if a > threshold}
    assert 0 < len(want) < len(idx)
    capsys.readouterr()

    out = tmp_path / "noisy.csv"
    assert main(["noisy-labels", str(ckpt), "--angle", str(threshold), "--out", str(out), "--loader-workers", "0",
                 "--quiet"]) == 0  # fmt: skip
    rows = list(csv.DictReader(out.open()))
    assert {r["path"] for r in rows} == want
    angles = [float(r["angle"]) for r in rows]
    assert angles == sorted(angles, reverse=True) and min(angles) > threshold
    by_path = {d["path"]: d for d in meta.values()}
    assert all(r["label"] == by_path[r["path"]]["class_id"] for r in rows)
    printed = capsys.readouterr().out
    assert f"{len(want)} of {len(idx)} train samples" in printed
    wrong = len(manifest["noisy_labels"]["index"])
    assert f"of the {wrong} mislabelled are listed" in printed


def test_the_list_holds_no_formula_and_exclude_reads_it_back(noisy_run, tmp_path, monkeypatch):
    """Paths and labels are anyone's text (a table's): a cell starting with ``=``, ``+``, ``-`` or ``@`` (or a tab)
    is written guarded, as in every CSV the project writes, so that no spreadsheet runs it; ``shards build
    --exclude`` reads the paths back as they were."""
    from dmltrain.evaluate import noisy_labels
    from shards.build.exclude import read_exclude

    root, ckpt, _ = noisy_run
    paths = noisy_labels._sample_paths  # each sample's recorded path, made hostile
    hostile = ['=HYPERLINK("http://evil.example","x")', "+cmd|'/c calc'!A1", "-2+3", "@SUM(1)", "\tx=1"]
    monkeypatch.setattr(
        noisy_labels,
        "_sample_paths",
        lambda *a: {i: f"{hostile[i % len(hostile)]}#{i}" for i in paths(*a)},
    )
    out = tmp_path / "noisy.csv"
    assert main(["noisy-labels", str(ckpt), "--angle", "0.001", "--out", str(out), "--loader-workers", "0",
                 "--quiet"]) == 0  # fmt: skip
    rows = list(csv.reader(out.open()))
    assert rows[0] == ["path", "label", "angle", "index", "nearest", "dominant"] and len(rows) > len(hostile)
    assert not [c for r in rows for c in r if c[:1] in ("=", "+", "-", "@", "\t", "\r")]
    listed = read_exclude(out).paths
    assert sorted(listed) == sorted(r[0][1:] if r[0].startswith("'") else r[0] for r in rows[1:])
    assert {p.rsplit("#", 1)[0] for p in listed} == set(hostile)


def test_bad_input_is_one_line(noisy_run, tmp_path, capsys):
    from dmltrain.models import save_model

    root, ckpt, _ = noisy_run
    plain = tmp_path / "plain"
    (plain / "classifier").mkdir(parents=True)
    (plain / "classifier" / "classifier-index.json").write_text("{}")
    model = torch.load(ckpt / "model.pt", weights_only=True)
    model["config"]["loss"]["classifier"]["params"] = {}
    save_model(plain / "model.pt", _small_model(model["config"]), model["config"])
    broken = tmp_path / "broken"
    (broken / "classifier").mkdir(parents=True)
    (broken / "classifier" / "classifier-index.json").write_text("{}")
    (broken / "model.pt").write_bytes((ckpt / "model.pt").read_bytes()[:100])
    emptied = tmp_path / "emptied"
    (emptied / "classifier").mkdir(parents=True)
    (emptied / "classifier" / "classifier-index.json").write_text("{}")
    (emptied / "model.pt").write_bytes((ckpt / "model.pt").read_bytes())
    cases = [
        ([str(ckpt), "--angle", "200"], "--angle: must be in (0, 180) degrees, got 200"),
        ([str(tmp_path), "--angle", "80"], "not a checkpoint folder (needs model.pt and classifier/"),
        ([str(plain), "--angle", "80"], "trained without sub-centers"),
        ([str(broken), "--angle", "80"], "cannot read model file"),
        ([str(emptied), "--angle", "80"], "not a classifier index (needs num_classes, dim and kind)"),
        ([str(ckpt), "--angle", "80", "--split", "test"], "split 'test' does not share the train split's classes"),
    ]
    for argv, message in cases:
        code = main(["noisy-labels", *argv, "--out", str(tmp_path / "n.csv"), "--loader-workers", "0"])
        err = capsys.readouterr().err.strip().splitlines()
        assert code != 0 and len(err) == 1 and message in err[0], (argv, err)
        assert not (tmp_path / "n.csv").exists()


def _small_model(config):
    from dmltrain.config import ModelConfig
    from dmltrain.models import build_model

    return build_model(ModelConfig(**config["model"]))
