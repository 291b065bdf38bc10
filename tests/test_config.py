"""The typed config: every shipped YAML validates; bad keys, types and combinations are refused in one line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from dmltrain.config import Config, apply_overrides, load_config
from dmltrain.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted(p for p in (ROOT / "configs").rglob("*.yaml") if "tune" not in p.parts)


def test_configs_exist():
    names = {str(p.relative_to(ROOT / "configs")) for p in CONFIGS}
    assert "demo.yaml" in names
    for method in ("normsoftmax", "ce_ls", "ice", "rll", "vit"):
        for dataset in ("sop", "cub", "cars", "inshop"):
            assert f"{method}/{dataset}.yaml" in names
    assert "vit/dinov2_sop.yaml" in names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: str(p.relative_to(ROOT / "configs")))
def test_every_config_validates(path):
    cfg = load_config(path)
    assert isinstance(cfg, Config)
    # the resolved YAML is itself a valid config (what `config show` prints can be fed back)
    again = Config.model_validate(yaml.safe_load(cfg.to_yaml()))
    assert again == cfg


def test_recipes_carry_paper_values():
    ns = load_config(ROOT / "configs/normsoftmax/cub.yaml")
    assert (ns.data.P, ns.data.samples_per_class, ns.optim.lr) == (3, 25, 0.001)
    assert ns.loss.classifier.params["temperature"] == 0.05 and ns.schedule.head_only == 1
    sop = load_config(ROOT / "configs/normsoftmax/sop.yaml")
    assert (sop.data.P, sop.data.samples_per_class, sop.optim.lr, sop.eval.ks) == (15, 5, 0.01, [1, 10, 100, 1000])
    ice = load_config(ROOT / "configs/ice/sop.yaml")
    assert (ice.data.P, ice.data.samples_per_class, ice.train.max_steps, ice.loss.classifier) == (90, 2, 20000, None)
    rll = load_config(ROOT / "configs/rll/cub.yaml")
    assert (rll.data.P, rll.optim.lr, rll.loss.instance.params["alpha"]) == (60, 1e-3, 1.2)
    ce = load_config(ROOT / "configs/ce_ls/inshop.yaml")
    assert ce.data.sampler == "random" and ce.optim.momentum == 0.99 and ce.data.eval_splits == ["query", "gallery"]


def test_overrides_apply_with_yaml_values():
    cfg = load_config(
        ROOT / "configs/demo.yaml",
        ["optim.lr=0.5", "loss.instance.kind=ranked_list", "eval.ks=[1,4]", "loss.instance.params={}"],
    )
    assert cfg.optim.lr == 0.5 and cfg.loss.instance.kind == "ranked_list" and cfg.eval.ks == [1, 4]
    cfg = load_config(None, ["loss.instance.kind=ice", "loss.classifier=null"])
    assert cfg.loss.classifier is None and cfg.loss.instance.kind == "ice"


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["optim.lrr=1"], "optim.lrr"),
        (["optim.lr=fast"], "optim.lr"),
        (["data.batch_size=63"], "data.batch_size"),  # not P×K with K=4
        (["data.classes_per_batch=10"], "data.classes_per_batch"),
        (["cluster.num_workers=3"], "data.classes_per_batch"),  # P=16 over 3 workers
        (["data.samples_per_class=1", "data.batch_size=16"], "data.samples_per_class"),  # K < 2 with ICE
        (["loss.classifier.sample_ratio=0"], "loss.classifier.sample_ratio"),
        (["loss.classifier.sample_ratio=1.5"], "loss.classifier.sample_ratio"),
        (["loss.instance.kind=nope"], "loss.instance.kind"),
        (["loss.instance.params.alpha=1"], "loss.instance.params.alpha"),  # ICE has no alpha
        (["loss.classifier.kind=ice"], "loss.classifier.kind"),
        (["loss.classifier=null", "loss.instance=null"], "loss"),
        (["model.embedding_dim=8"], "model.embedding_dim"),
        (["data.sampler=random"], "data.sampler"),  # instance loss without positives
        (["optim.lr.x=1"], "optim.lr"),
        (["train.precision=fp16"], "train.precision"),  # CPU workers
        (["loss.classifier.precision=bf16"], "loss.classifier.precision"),  # fused kernels: CUDA only
        (["loss.classifier.weight_storage=bf16"], "loss.classifier.weight_storage"),
        (
            ["loss.instance.kind=ranked_list", "loss.instance.params.normalize=anchors"],
            "loss.instance.params",
        ),  # a bad value
        (["eval.metric=recall@3"], "eval.metric"),
        (["train.run_name=it's"], "train.run_name"),
        (["data.image_size=1000000"], "data.image_size"),  # a loader would spin for minutes on such crops
        (["data.eval_resize=5000", "data.eval_crop=4500"], "data.eval_resize"),
        (["data.augment.resize=[5000, 5000]"], "data.augment.resize"),
        (["data.synthetic={image_size: 8192}"], "data.synthetic.image_size"),
        (['train.output_dir="runs\\0x"'], "train.output_dir: contains a NUL byte"),
        (['data.shards="data\\0x"'], "data.shards: contains a NUL byte"),
        (['data.storage_options={"a\\0": 1}'], "data.storage_options.a"),
    ],
)
def test_bad_configs_name_the_key(overrides, key):
    with pytest.raises(ConfigError) as err:
        load_config(ROOT / "configs/demo.yaml", overrides)
    msg = str(err.value)
    assert "\n" not in msg and key in msg, msg


def test_bad_values_stop_train_in_one_line_before_anything_starts(tmp_path, monkeypatch, capsys):
    """A NUL byte in a path (the OS would refuse it later, with a traceback) and an image size no loader can serve
    are config errors: one line, exit 2, nothing written."""
    from dmltrain.cli import main

    monkeypatch.chdir(tmp_path)
    for override in ('train.output_dir="runs\\0x"', 'data.shards="data\\0x"', "data.image_size=1000000"):
        assert main(["train", str(ROOT / "configs/demo.yaml"), override]) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and override.split("=")[0] in err, err
    assert list(tmp_path.iterdir()) == []


def test_a_billion_laughs_config_is_one_short_line(tmp_path):
    """YAML aliases nest one list a billion times: refused at once in one line, never expanded (validating the
    storage options, or printing the value in the message, would not end)."""
    lines = ['a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    lines += [f"{b}: &{b} [{', '.join(['*' + a] * 9)}]" for a, b in zip("abcdefgh", "bcdefghi")]
    (tmp_path / "lol.yaml").write_text("\n".join([*lines, "data: {eval_splits: *i, storage_options: {x: *i}}", ""]))
    with pytest.raises(ConfigError) as err:
        load_config(tmp_path / "lol.yaml")
    assert "more than 100,000 values once its YAML aliases are expanded" in str(err.value)


def test_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("optim: {lr: [1,\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: invalid YAML at line"):
        load_config(bad)
    loop = tmp_path / "loop.yaml"
    loop.write_text("extends: loop.yaml\n")
    with pytest.raises(ConfigError, match="loops back"):
        load_config(loop)
    with pytest.raises(ConfigError, match="expected dotted.key=value"):
        apply_overrides({}, ["optim.lr"])


def test_extends_merges_in_order(tmp_path):
    (tmp_path / "a.yaml").write_text("optim: {lr: 0.1, momentum: 0.5}\ndata: {batch_size: 32}\n")
    (tmp_path / "b.yaml").write_text("optim: {lr: 0.2}\n")
    (tmp_path / "c.yaml").write_text("extends: [a.yaml, b.yaml]\noptim: {momentum: 0.7}\n")
    cfg = load_config(tmp_path / "c.yaml")
    assert (cfg.optim.lr, cfg.optim.momentum, cfg.data.batch_size) == (0.2, 0.7, 32)


def test_extends_files_in_merge_order_and_a_diamond(tmp_path):
    """``config_files`` (what ``submit`` uploads) lists a shared base once per path to it, in merge order;
    merging in that order gives what reading each parent whole did (the later parent's copy of the base wins)."""
    from dmltrain.config_tree import config_files, read_tree

    (tmp_path / "base.yaml").write_text("optim: {lr: 0.1, momentum: 0.5}\n")
    (tmp_path / "a.yaml").write_text("extends: base.yaml\noptim: {momentum: 0.9}\n")
    (tmp_path / "b.yaml").write_text("extends: base.yaml\ndata: {batch_size: 32}\n")
    (tmp_path / "c.yaml").write_text("extends: [a.yaml, b.yaml]\n")
    assert [p.name for p, _ in config_files(tmp_path / "c.yaml")] == [
        "base.yaml",
        "a.yaml",
        "base.yaml",
        "b.yaml",
        "c.yaml",
    ]
    assert read_tree(tmp_path / "c.yaml") == {"optim": {"lr": 0.1, "momentum": 0.5}, "data": {"batch_size": 32}}


def test_dotted_setter_replaces_or_merges_and_never_overwrites_a_value():
    from dmltrain.config_tree import set_dotted

    tree = {
        "loss": {"classifier": {"params": {"temperature": 0.05, "margin": 0.1}}},
        "optim": {"lr": 0.1},
        "data": None,
    }
    set_dotted(tree, "loss.classifier.params", {"temperature": 0.07})  # an override replaces the section
    assert tree["loss"]["classifier"]["params"] == {"temperature": 0.07}
    set_dotted(tree, "loss.classifier.params", {"margin": 0.2}, merge=True)  # a Tune choice merges into it
    assert tree["loss"]["classifier"]["params"] == {"temperature": 0.07, "margin": 0.2}
    set_dotted(tree, "data.batch_size", 32)  # a null or missing section on the way is created
    assert tree["data"] == {"batch_size": 32}
    with pytest.raises(ConfigError, match=r"^optim\.lr is a value, not a section$"):
        set_dotted(tree, "optim.lr.x", 1)
    assert tree["optim"] == {"lr": 0.1}
    with pytest.raises(ConfigError, match=r"override 'optim\.lr\.x=1': optim\.lr is a value, not a section"):
        apply_overrides(tree, ["optim.lr.x=1"])


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "dmltrain", *args], capture_output=True, text=True, cwd=ROOT)


def test_cli_config_show():
    ok = _cli("config", "show", "configs/demo.yaml", "optim.lr=0.5")
    assert ok.returncode == 0, ok.stderr
    assert yaml.safe_load(ok.stdout)["optim"]["lr"] == 0.5
    bad = _cli("config", "show", "configs/demo.yaml", "optim.lrr=1")
    assert bad.returncode == 2
    lines = bad.stderr.strip().splitlines()
    assert len(lines) == 1 and "optim.lrr" in lines[0] and "Traceback" not in bad.stderr


def test_cli_every_command_has_help(capsys):
    """Every command's parser, through ``dmltrain.cli.main`` in this process (the ``dmltrain`` script is that
    function; ``python -m dmltrain`` is run by the test above): a process per command cost 30 s of imports."""
    from dmltrain.cli import COMMANDS, main

    for name in COMMANDS:
        with pytest.raises(SystemExit) as done:
            main([name, "--help"])
        out = capsys.readouterr()
        assert done.value.code == 0 and "usage: dmltrain " + name in out.out, (name, out.err[-500:])
