"""``dmltrain tune``: the search-space file, and a real two-trial Ray Tune search over Ray Train V2.

The fast tests check the space file against the config (every mistake is one line naming the
key, before anything starts) and that the shipped spaces load against their recipes. The Ray
test runs the CLI on tiny synthetic shards: two trials (a grid over the learning rate) under
ASHA, each a Ray Train V2 training logging into its own MLflow child run. What the search
reports (the best trial, its value, the parent's metrics) is checked against the MLflow runs
read back here, not against the search's own bookkeeping.
"""

from __future__ import annotations

import contextlib
import csv
import io
import math
from pathlib import Path

import pytest
import yaml

from cluster.tune.results import TrialRow, reconcile_with_mlflow
from cluster.tune.space import apply_params, load_space
from cluster.tune.trial import EvaluationsToTune, run_trial, trial_index
from dmltrain.cli import main
from dmltrain.config import build_config, load_config
from dmltrain.errors import UserError
from dmltrain.tracking.run import RunHandle

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "configs/demo.yaml"


def _space(tmp_path: Path, doc) -> Path:
    p = tmp_path / "space.yaml"
    p.write_text(doc if isinstance(doc, str) else yaml.safe_dump(doc))
    return p


# -- the space file ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "space, key, words",
    [
        ({"optim.lr": {"normal": [0, 1]}}, "space.optim.lr", "unknown distribution 'normal'"),
        ({"optim.lr": {"uniform": [0.1, 0.01]}}, "space.optim.lr", "low < high"),
        ({"optim.lr": {"loguniform": [0.0, 0.1]}}, "space.optim.lr", "low > 0"),
        ({"optim.lr": {"uniform": [0.1]}}, "space.optim.lr", "[low, high]"),
        ({"optim.lr": {"choice": []}}, "space.optim.lr", "non-empty list"),
        ({"optim.lr": 0.1}, "space.optim.lr", "one distribution"),
        ({"optim.lrr": {"choice": [0.1]}}, "space.optim.lrr", "optim.lrr is not a config key"),
        (
            {"loss.classifier.params.temprature": {"choice": [0.05]}},
            "space.loss.classifier.params.temprature",
            "not a parameter of normsoftmax",
        ),
        ({"loss.classifier.sample_ratio": {"choice": [1.0, 1.5]}}, "space.loss.classifier.sample_ratio", "1.5"),
        (
            {"loss.classifier.params.temperature": {"uniform": [-0.1, 0.1]}},
            "space.loss.classifier.params.temperature",
            "temperature must be positive",
        ),
        ({"data.samples_per_class": {"uniform": [2, 8]}}, "space.data.samples_per_class", "integer"),
        ({"optim.lr.value": {"choice": [0.1]}}, "space.optim.lr.value", "optim.lr is a value"),
    ],
)
def test_space_mistakes_are_one_line_naming_the_key(tmp_path, space, key, words):
    path = _space(tmp_path, {"metric": "recall@1", "space": space})
    with pytest.raises(UserError) as e:
        load_space(path, load_config(DEMO).to_dict())
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{path}: {key}:") and words in msg, msg


def test_space_keys_under_a_null_section_and_bad_metric(tmp_path):
    base = load_config(DEMO, ["loss.instance=null"]).to_dict()
    path = _space(tmp_path, {"space": {"loss.instance.params.scale": {"uniform": [16, 64]}}})
    with pytest.raises(UserError, match=r"space\.loss\.instance\.params\.scale: loss\.instance is null"):
        load_space(path, base)
    for doc, words in (
        ({"metric": "recall@3", "space": {"optim.lr": {"choice": [0.1]}}}, "metric: 'recall@3' is not reported"),
        ({"metric": "recall@1", "mode": "up", "space": {"optim.lr": {"choice": [0.1]}}}, "mode: 'up'"),
        ({"metric": "recall@1", "spaces": {}}, "spaces: unknown key"),
        ({"metric": "recall@1", "space": {}}, "space: give a mapping"),
        ("space: [unclosed", "invalid YAML"),
    ):
        with pytest.raises(UserError, match=words.replace("[", r"\[").replace("(", r"\(")):
            load_space(_space(tmp_path, doc), base)


def test_combinations_all_refused_stop_some_refused_warn(tmp_path, capsys):
    base = load_config(DEMO).to_dict()  # batch 64 = 16 x 4 over 2 workers
    # each value is valid alone (48 = 12 x 4, 64 = 4 x 16) but together P = 48 / 16 = 3 cannot split over 2 workers
    none = _space(
        tmp_path, {"space": {"data.batch_size": {"choice": [48]}, "data.samples_per_class": {"choice": [16]}}}
    )
    with pytest.raises(
        UserError,
        match=r"space: no combination of the values is a valid config, e\.g\. data\.batch_size=48, "
        r"data\.samples_per_class=16: .*cannot be split evenly",
    ):
        load_space(none, base)
    partly = _space(
        tmp_path,
        {
            "space": {
                "data.batch_size": {"choice": [64, 48]},
                "data.samples_per_class": {"choice": [4, 16]},
                "optim.lr": {"loguniform": [0.01, 0.1]},
            }
        },
    )
    space = load_space(partly, base)
    assert [d.key for d in space.dims] == ["data.batch_size", "data.samples_per_class", "optim.lr"]
    err = capsys.readouterr().err
    assert "1 of 4 value combinations are refused" in err and "data.batch_size=48, data.samples_per_class=16" in err


def test_dotted_keys_and_section_choices_merge(tmp_path):
    base = load_config(DEMO).to_dict()
    tree = apply_params(
        base,
        {
            "optim.lr": 0.3,
            "data": {"batch_size": 32, "samples_per_class": 2},
            "loss.classifier.params.temperature": 0.07,
        },
    )
    cfg = build_config(tree, "t")
    assert cfg.optim.lr == 0.3 and (cfg.data.batch_size, cfg.data.P) == (32, 16)
    assert cfg.data.shards == base["data"]["shards"]  # merged into the section, not replacing it
    assert cfg.loss.classifier.params == {"temperature": 0.07}
    assert base["optim"]["lr"] == 0.003  # the base tree is untouched
    assert [trial_index(t) for t in ("a1b2c_00000", "a1b2c_00013", "t007")] == [0, 13, 7]


SHIPPED = {  # space -> the recipe (and overrides) it is written for, as its header says
    "normsoftmax": [("normsoftmax/sop.yaml", []), ("normsoftmax/cub.yaml", [])],
    "cosface": [("normsoftmax/sop.yaml", ["loss.classifier.kind=cosface", "loss.classifier.params={}"])],
    "arcface": [("normsoftmax/cars.yaml", ["loss.classifier.kind=arcface", "loss.classifier.params={}"])],
    "ce_ls": [("ce_ls/cub.yaml", []), ("ce_ls/sop.yaml", [])],
    "ice": [("ice/sop.yaml", []), ("ice/cub.yaml", [])],
    "rll": [("rll/sop.yaml", []), ("rll/cub.yaml", [])],
    "demo": [("demo.yaml", [])],
}


def test_shipped_spaces_load_against_their_recipes():
    assert {p.stem for p in (ROOT / "configs/tune").glob("*.yaml")} == set(SHIPPED)
    tuned = set()
    for name, bases in SHIPPED.items():
        for config, overrides in bases:
            space = load_space(
                ROOT / "configs/tune" / f"{name}.yaml", load_config(ROOT / "configs" / config, overrides).to_dict()
            )
            assert space.metric == "recall@1" and space.mode == "max"
            tuned |= {d.key.rsplit(".", 1)[-1] for d in space.dims}
    # the list: temperature, s, margins, lr, sample_ratio, P×K
    assert {"temperature", "scale", "margin", "lr", "sample_ratio", "samples_per_class"} <= tuned


def test_cli_refuses_a_bad_space_before_starting_anything(tmp_path, capsys):
    path = _space(tmp_path, {"space": {"optim.lrr": {"choice": [0.1]}}})
    rc = main(["tune", str(DEMO), f"data.shards={tmp_path / 'missing'}", "--space", str(path), "--trials", "2"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1
    assert err[0].startswith(
        f"dmltrain: error: {path}: space.optim.lrr: optim.lrr is not a config key (optim has: name, lr,"
    )
    assert not (tmp_path / "missing").exists()  # nothing was built


def test_tune_into_a_read_only_folder_fails_in_one_line_before_ray_starts(tmp_path, read_only_dir, capsys):
    import ray

    space = _space(tmp_path, {"metric": "recall@1", "space": {"optim.lr": {"choice": [0.1]}}})
    argv = ["tune", str(DEMO), f"train.output_dir={read_only_dir / 'runs'}", "--space", str(space), "--trials", "1"]
    assert main([*argv, f"data.shards={tmp_path / 'shards'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"dmltrain: error: train.output_dir: cannot write to {read_only_dir} (") and "\n" not in err
    assert not ray.is_initialized() and not (tmp_path / "shards").exists()  # refused before Ray and the shards


class _Planted:
    """A pickle payload: unpickling it calls ``open(marker, 'w')``."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_only_this_users_own_search_state_is_resumed(tmp_path, monkeypatch, capsys):
    """Tune unpickles a search's state on resume: a search is resumed only with --resume, and only when every file
    Ray would unpickle carries this user's tag; anything else is one line, exit 2, before Ray starts, and no code of
    it runs. The file system Tune reads through checks the very bytes it hands over."""
    import pickle
    import stat

    import pyarrow.fs
    import ray

    from cluster.tune.sealed_state import SIG_SUFFIX, SealedFileSystem, StateNotAuthentic, tag
    from dmltrain.private import state_key

    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))  # this user's key: made on first use, 0600
    runs, marker = tmp_path / "runs", tmp_path / "code-ran"
    folder = runs / "s"
    folder.mkdir(parents=True)
    payload = pickle.dumps(_Planted(marker))
    space = _space(tmp_path, {"metric": "recall@1", "space": {"optim.lr": {"choice": [0.1]}}})
    argv = ["tune", str(DEMO), f"train.output_dir={runs}", f"data.shards={tmp_path / 'none'}", "--space", str(space)]

    def refused(*extra: str) -> str:
        assert main([*argv, "--name", "s", *extra]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("dmltrain: error: ") and "\n" not in err, err
        assert not marker.exists() and not ray.is_initialized() and not (tmp_path / "none").exists()
        return err

    (folder / "tuner.pkl").write_bytes(payload)  # a search planted in the folder (or an older, unsealed one)
    assert f"tune s: {runs}/s holds a search already; resume it with --resume, or choose another --name" in refused()
    err = refused("--resume")
    assert (
        f"{folder / 'tuner.pkl'}: not written by this user's dmltrain (no valid signature); Ray would unpickle" in err
    )
    assert main([*argv, "--resume"]) == 2 and "--resume: name the search to resume" in capsys.readouterr().err
    key = state_key()
    assert stat.S_IMODE((tmp_path / "config" / "dmltrain" / "state.key").stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "config" / "dmltrain").stat().st_mode) == 0o700

    # this user's own search, as Tune writes it through the sealing file system; a file planted beside it is refused
    sealed = SealedFileSystem(pyarrow.fs.LocalFileSystem(), str(runs), key)
    fs = pyarrow.fs.PyFileSystem(sealed)
    for name, data in (("tuner.pkl", pickle.dumps({"a": 1})), ("experiment_state-1.json", b'{"trial_data": []}')):
        with fs.open_output_stream(f"{folder}/{name}") as f:
            f.write(data)
    for planted in ("experiment_state-2.json", "basic-variant-state-2.json", "t000/error.pkl", "callback-states-2.pkl"):
        path = folder / planted
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(payload)
        assert f"{path}: not written by this user's dmltrain" in refused("--resume")
        # a tag copied from another file, or made for another name, does not pass either
        good = (folder / "tuner.pkl.dmltrain-sig").read_text()
        Path(f"{path}{SIG_SUFFIX}").write_text(f"{good}\n{tag(key, 's/tuner.pkl', payload)}\n{'0' * 64}")
        assert f"{path}: not written by this user's dmltrain" in refused("--resume")
        path.unlink()
        Path(f"{path}{SIG_SUFFIX}").unlink()

    # what Tune reads is the bytes that were checked; a sealed file swapped afterwards is never handed over
    assert fs.open_input_stream(f"{folder}/experiment_state-1.json").read() == b'{"trial_data": []}'
    (folder / "experiment_state-1.json").write_bytes(payload)
    with pytest.raises(StateNotAuthentic, match="experiment_state-1.json: not written by this user's dmltrain"):
        fs.open_input_file(f"{folder}/experiment_state-1.json")
    # Ray's copies of the file system: within this process they keep the key; what is pickled never holds it
    shipped = pickle.dumps(fs)
    assert key not in shipped and pickle.loads(shipped).handler.key == key
    keyless = pyarrow.fs.PyFileSystem(SealedFileSystem(pyarrow.fs.LocalFileSystem(), str(runs), None))
    with pytest.raises(StateNotAuthentic):
        keyless.open_input_stream(f"{folder}/tuner.pkl")
    assert not marker.exists()


@pytest.mark.parametrize("name", ["../x", "team/s", ".x", "ABS"])
def test_a_search_name_that_is_not_one_folder_name_is_refused(tmp_path, monkeypatch, capsys, name):
    """--name is a folder name, as train.run_name is: ``../x`` would resume a search outside the storage, ``team/s``
    would put Tune's state where the sealing does not look; refused in one line before anything of it is read."""
    import pickle

    import ray

    from cluster.tune import search
    from cluster.tune.sealed_state import SearchState

    name = name.replace("ABS", str(tmp_path / "x"))  # an absolute path
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.setattr(search, "prepare_driver", lambda cfg: pytest.fail(f"--name {name} was accepted"))
    runs, marker = tmp_path / "runs", tmp_path / "code-ran"
    for planted in (tmp_path / "x", runs / "team" / "s"):  # searches planted where the names lead
        planted.mkdir(parents=True)
        (planted / "tuner.pkl").write_bytes(pickle.dumps(_Planted(marker)))
    space = _space(tmp_path, {"metric": "recall@1", "space": {"optim.lr": {"choice": [0.1]}}})
    argv = ["tune", str(DEMO), f"train.output_dir={runs}", f"data.shards={tmp_path / 'none'}", "--space", str(space)]
    for extra in ([], ["--resume"]):
        assert main([*argv, "--name", name, *extra]) == 2
        err = capsys.readouterr().err.strip()
        assert err == f"dmltrain: error: --name {name}: not a search name (letters, digits, _ . -)", err
        assert not marker.exists() and not ray.is_initialized() and not (tmp_path / "none").exists()
    with pytest.raises(UserError, match="not a search name"):
        SearchState(str(runs), name)


def test_the_sealed_file_system_refuses_state_outside_its_root(tmp_path, monkeypatch):
    """A file Ray may unpickle is read only from the storage root, verified: one outside it (``<root>/../x``, another
    folder) is refused, not handed through unverified, and nothing is sealed there either."""
    import pickle

    import pyarrow.fs

    from cluster.tune.sealed_state import SealedFileSystem, StateNotAuthentic
    from dmltrain.private import state_key

    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    runs, outside = tmp_path / "runs", tmp_path / "x"
    (runs / "s").mkdir(parents=True)
    outside.mkdir()
    payload = pickle.dumps(_Planted(tmp_path / "code-ran"))
    for name in ("tuner.pkl", "experiment_state-1.json", "notes.txt"):
        (outside / name).write_bytes(payload)
    fs = pyarrow.fs.PyFileSystem(SealedFileSystem(pyarrow.fs.LocalFileSystem(), str(runs), state_key()))
    for path in (f"{runs}/../x/tuner.pkl", f"{runs}/s/../../x/experiment_state-1.json", f"{outside}/tuner.pkl"):
        with pytest.raises(StateNotAuthentic, match="outside the storage"):
            fs.open_input_stream(path)
        with pytest.raises(StateNotAuthentic, match="outside the storage"):
            fs.open_input_file(path)
    with pytest.raises(StateNotAuthentic, match="outside the storage"):
        with fs.open_output_stream(f"{runs}/../x/new.pkl") as f:
            f.write(b"x")
    assert not (outside / "new.pkl").exists()
    assert fs.open_input_stream(f"{outside}/notes.txt").read() == payload  # other files are data: they pass


def test_tags_are_compared_in_constant_time_and_the_key_is_never_left_half_made(tmp_path, monkeypatch):
    """The tag check uses hmac.compare_digest for every stored tag; the key file appears whole or not at all, so a
    start that dies while making it (or a concurrent one) never leaves an empty key that refuses every later run."""
    import hmac
    import secrets

    import pyarrow.fs

    from cluster.tune import sealed_state
    from dmltrain import private

    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))

    def dies_making_the_key(n):  # the start ends (Ctrl-C, a kill) as the key's bytes are drawn
        if n == private.KEY_BYTES:
            raise KeyboardInterrupt
        return real_bytes(n)

    real_bytes = secrets.token_bytes
    monkeypatch.setattr(private.secrets, "token_bytes", dies_making_the_key)
    with pytest.raises(KeyboardInterrupt):
        private.state_key()
    monkeypatch.setattr(private.secrets, "token_bytes", real_bytes)
    key = private.state_key()  # made anew, not refused as a 0-byte key
    assert len(key) == private.KEY_BYTES and private.state_key() == key
    assert [p.name for p in (tmp_path / "config" / "dmltrain").iterdir()] == [private.KEY_FILE]

    compared = []
    real = hmac.compare_digest
    monkeypatch.setattr(sealed_state.hmac, "compare_digest", lambda a, b: compared.append(1) or real(a, b))
    runs = tmp_path / "runs"
    (runs / "s").mkdir(parents=True)
    fs = pyarrow.fs.PyFileSystem(sealed_state.SealedFileSystem(pyarrow.fs.LocalFileSystem(), str(runs), key))
    with fs.open_output_stream(f"{runs}/s/tuner.pkl") as f:
        f.write(b"state")
    compared.clear()
    assert fs.open_input_stream(f"{runs}/s/tuner.pkl").read() == b"state" and compared


def test_only_new_evaluations_reach_tune(monkeypatch):
    from types import SimpleNamespace

    from ray.tune.integration.ray_train import TuneReportCallback

    # what the trainer reports over a run: the untrained model, each evaluation, then the checkpoint repeating it
    # (eval.before_training, then checkpoints at steps 2 and 6 that repeat the latest metrics)
    ev = {"evaluation": 1}
    reports = [
        {"eval/recall@1": 0.1, "step": 0, **ev},
        {"eval/recall@1": 0.1, "step": 2},
        {"eval/recall@1": 0.3, "step": 4, **ev},
        {"eval/recall@1": 0.3, "step": 4},
        {"eval/recall@1": 0.3, "step": 6},
        {"eval/recall@1": 0.4, "step": 8, **ev},
        {"eval/recall@1": 0.4, "step": 8},
    ]
    forwarded = []

    def outside_tune(self):  # Ray's __init__ needs a Tune session for its queue; this one records what it would carry
        self._training_actor_item_queue = SimpleNamespace(put=forwarded.append)

    monkeypatch.setattr(TuneReportCallback, "__init__", outside_tune)
    callback = EvaluationsToTune("eval/recall@1", {"mlflow_run_id": "r1"})
    for m in reports:
        callback.after_report(None, [m, dict(m)], None)  # every rank reports; rank 0's is forwarded
    assert [(m["step"], m["eval/recall@1"], m["mlflow_run_id"]) for m in forwarded] == [(4, 0.3, "r1"), (8, 0.4, "r1")]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """One MLflow store for the unit tests (creating its tables takes seconds); each test its own experiment."""
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path_factory.mktemp('store') / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    client.search_experiments()  # creates the tables
    return uri, client


def _store(store, experiment):
    uri, client = store
    return uri, load_config(DEMO, [f"tracking.uri={uri}", f"tracking.experiment={experiment}"]), client


def test_a_trial_whose_draw_the_config_refuses_fails_as_a_child_run(store, tmp_path, monkeypatch):
    from types import SimpleNamespace

    import ray.tune

    uri, cfg, client = _store(store, "refused")
    parent = RunHandle.for_config(cfg, "srch", {"optim.lr": 0.05}, tags={"dmltrain.kind": "tune"})
    monkeypatch.setattr(ray.tune, "get_context", lambda: SimpleNamespace(get_trial_id=lambda: "abcde_00003"))
    setup = {
        "base": cfg.to_dict(),
        "name": "srch",
        "parent_run_id": parent.run_id,
        "runs_root": str(tmp_path / "runs"),
        "result_key": "eval/recall@1",
    }
    with pytest.raises(UserError) as e:
        run_trial({"data.batch_size": 30}, setup)  # 30 is not P x K with K = 4
    assert str(e.value).startswith("trial 3 (data.batch_size=30): data.batch_size: 30 is not divisible into P×K")
    (kid,) = client.search_runs(
        [client.get_run(parent.run_id).info.experiment_id],
        filter_string=f"tags.`mlflow.parentRunId` = '{parent.run_id}'",
    )
    assert kid.data.tags["dmltrain.run_name"] == "srch-t003" and kid.info.status == "FAILED"
    assert kid.data.tags["dmltrain.error"] == str(e.value) and kid.data.params == {"data.batch_size": "30"}


def test_trials_the_scheduler_stopped_end_killed_and_tagged(store):
    uri, cfg, client = _store(store, "stopped")
    parent = RunHandle.for_config(cfg, "srch", {}, tags={})
    ends = {  # run: (status the trial left, error tag, how Tune saw the trial) -> expected status, row status
        "srch-t000": ("RUNNING", None, "finished", "KILLED", "stopped early"),  # its process was killed mid-step
        "srch-t001": ("FAILED", "ActorDiedError: placement group removed", "finished", "KILLED", "stopped early"),
        "srch-t002": ("RUNNING", None, "failed", "FAILED", "failed"),
        "srch-t003": ("FINISHED", None, "finished", "FINISHED", "finished"),
    }
    rows = []
    for name, (left, err, tune_status, _, _) in ends.items():
        rid = RunHandle.open(
            uri, "stopped", name, {}, tags={"dmltrain.error": err} if err else None, parent_run_id=parent.run_id
        ).run_id
        if left != "RUNNING":
            RunHandle(uri, rid).finish(left)
        rows.append(TrialRow(trial_index(name), "", name, tune_status, {}, None, None, None, 0, None, None))
    reconcile_with_mlflow(rows, parent)
    for row, (name, (_, err, _, status, row_status)) in zip(rows, ends.items()):
        run = client.get_run(row.mlflow_run_id)
        assert (run.info.status, row.status) == (status, row_status), name
        stopped = row_status == "stopped early"
        assert (run.data.tags.get("dmltrain.tune.stopped_early") == "true") == stopped
        assert ("dmltrain.error" in run.data.tags) == (bool(err) and not stopped)


# -- a real search ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def search(tmp_path_factory):
    import ray
    from mlflow import MlflowClient

    from cluster.launch import start_local_ray
    from shards.build.synthetic import build_synthetic_shards

    root = tmp_path_factory.mktemp("tune")
    shards = root / "shards"
    build_synthetic_shards(shards, classes=16, per_class=6, image_size=32, seed=0, shard_size=40, progress=False)
    space = _space(
        root,
        {
            "metric": "recall@1",
            "space": {
                "optim.lr": {"grid": [0.05, 0.002]},
                "loss.classifier.params.temperature": {"uniform": [0.04, 0.08]},
            },
        },
    )
    overrides = {
        "data.shards": str(shards),
        "data.synthetic": "null",
        "data.batch_size": 32,
        "data.samples_per_class": 4,
        "data.loader_workers": 0,
        "data.eval_batch_size": 96,
        "model.embedding_dim": 64,
        "loss.instance": "null",
        "train.epochs": 1,
        "train.log_every": 1,
        "train.output_dir": str(root / "runs"),
        "eval.unit": "step",
        "eval.every": 2,
        "eval.before_training": False,
        "eval.plots": False,
        "eval.binary": False,
        "eval.nmi": False,
        "tracking.uri": f"sqlite:///{root / 'mlflow.db'}",
        "tracking.experiment": "tune-test",
        "tracking.system_metrics": False,
        "tracking.log_models": False,
        "cluster.num_workers": 1,
        "cluster.cpus_per_worker": 0.5,
    }
    start_local_ray(num_cpus=2, include_dashboard=False, log_to_driver=False)
    patch = pytest.MonkeyPatch()
    patch.setenv("XDG_CONFIG_HOME", str(root / "config"))  # the key that seals the search's state
    try:
        argv = [
            "tune",
            str(DEMO),
            *(f"{k}={v}" for k, v in overrides.items()),
            "--space",
            str(space),
            "--trials",
            "1",
            "--scheduler",
            "asha",
            "--name",
            "search",
            "--max-concurrent",
            "2",
            "--no-progress",
        ]
        printed, resumed = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(printed):
            rc = main(argv)
        with contextlib.redirect_stdout(resumed):  # the finished search again: Tune restores its sealed state
            rc_resumed = main([*argv, "--resume"])
    finally:
        patch.undo()
        ray.shutdown()
    client = MlflowClient(tracking_uri=f"sqlite:///{root / 'mlflow.db'}")
    return {
        "rc": rc,
        "printed": printed.getvalue(),
        "rc_resumed": rc_resumed,
        "resumed": resumed.getvalue(),
        "root": root,
        "client": client,
        "exp": client.get_experiment_by_name("tune-test"),
        "out": root / "runs" / "search",
    }


@pytest.mark.ray
@pytest.mark.timeout(600)
def test_search_runs_trials_as_mlflow_children_and_writes_the_best_config(search, capsys):
    assert search["rc"] == 0
    client, exp, out = search["client"], search["exp"], search["out"]
    parents = client.search_runs([exp.experiment_id], filter_string="tags.`dmltrain.run_name` = 'search'")
    assert len(parents) == 1
    parent = parents[0]
    assert parent.info.status == "FINISHED" and parent.data.tags["dmltrain.kind"] == "tune"
    assert parent.data.params["tune.metric"] == "recall@1" and parent.data.params["optim.lr"] == "0.003"
    kids = client.search_runs([exp.experiment_id], filter_string=f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
    assert sorted(k.data.tags["dmltrain.run_name"] for k in kids) == ["search-t000", "search-t001"]
    assert len(client.search_runs([exp.experiment_id])) == 3  # the parent and its two trials, nothing else

    # each trial: its sampled values as params, its evaluations as metrics, a status that says how it ended
    best_of = {}
    for kid in kids:
        lr = float(kid.data.params["optim.lr"])
        assert lr in (0.05, 0.002)
        assert 0.04 <= float(kid.data.params["loss.classifier.params.temperature"]) <= 0.08
        evals = [(m.step, m.value) for m in client.get_metric_history(kid.info.run_id, "eval/recall_at_1")]
        assert evals, kid.data.tags["dmltrain.run_name"]
        if kid.info.status == "KILLED":  # ASHA stopped it after its first evaluation
            assert kid.data.tags.get("dmltrain.tune.stopped_early") == "true" and "dmltrain.error" not in kid.data.tags
        else:
            assert kid.info.status == "FINISHED" and len(evals) == 2  # at step 2 and at the end (step 4)
        best_of[kid.data.tags["dmltrain.run_name"]] = (max(v for _, v in evals), kid)
    assert any(k.info.status == "FINISHED" for _, k in best_of.values())  # ASHA never stops the first to a rung

    # the best trial is the one with the highest Recall@1 at any evaluation
    best_name, (best_value, best_run) = max(best_of.items(), key=lambda kv: kv[1][0])
    rows = list(csv.DictReader((out / "results.csv").open()))
    assert [r["trial"] for r in rows] == ["search-t000", "search-t001"]
    by_trial = {r["trial"]: r for r in rows}
    for name, (value, kid) in best_of.items():
        assert math.isclose(float(by_trial[name]["best recall@1"]), value, rel_tol=1e-9)
        assert by_trial[name]["MLflow run"] == kid.info.run_id
        assert by_trial[name]["status"].split(" (")[0] == (
            "stopped early" if kid.info.status == "KILLED" else "finished"
        )
    assert by_trial[best_name]["status"].endswith("(best)")
    # the tuned keys in the space file's order (yaml.safe_dump sorted them)
    assert (
        "| trial | status | loss.classifier.params.temperature | optim.lr | best recall@1 |"
        in (out / "results.md").read_text()
    )

    # the best config re-loads as a run config with the best trial's values
    cfg = load_config(out / "best_config.yaml")
    assert cfg.optim.lr == float(best_run.data.params["optim.lr"])
    assert cfg.loss.classifier.params == {
        "temperature": float(best_run.data.params["loss.classifier.params.temperature"])
    }
    assert cfg.train.run_name is None and cfg.cluster.storage_path is None and cfg.train.epochs == 1

    # the parent: the space, the results and the best config as artifacts; the best trial's metrics and tags
    arts = {a.path for a in client.list_artifacts(parent.info.run_id, "tune")}
    assert arts == {"tune/space.yaml", "tune/results.md", "tune/results.csv", "tune/best_config.yaml"}
    assert math.isclose(parent.data.metrics["eval/recall_at_1"], best_value, rel_tol=1e-9)
    assert parent.data.tags["dmltrain.tune.best_run_id"] == best_run.info.run_id

    # printed: the table, the best trial, the YAML
    printed = search["printed"]
    assert f"best trial {best_name}: recall@1 {best_value:.4f}" in printed and "optim:\n" in printed

    # resumed with --resume: Tune read its own (sealed) state back and found every trial finished
    assert search["rc_resumed"] == 0 and f"best trial {best_name}: recall@1 {best_value:.4f}" in search["resumed"]
    assert (out / "tuner.pkl.dmltrain-sig").is_file() and list(out.glob("experiment_state-*.json.dmltrain-sig"))


@pytest.mark.ray
@pytest.mark.timeout(600)
def test_report_over_the_search_compares_its_trials(search, tmp_path):
    from dmltrain.report.cli import build_report

    rep = build_report(
        "tune-test",
        runs=["search"],
        out=tmp_path / "report",
        tracking_uri=f"sqlite:///{search['root'] / 'mlflow.db'}",
        progress=False,
    )
    assert sorted(r.name for r in rep.records) == ["search-t000", "search-t001"]
    text = rep.markdown.read_text()
    assert "optim.lr" in text and rep.html.is_file() and (tmp_path / "report" / "recall_at_1.png").is_file()


def test_a_stopped_trial_is_scored_by_every_evaluation_its_run_logged(store):
    """ASHA's stop reaches a trial asynchronously: it may evaluate again after its last Tune result."""
    from mlflow.entities import Metric

    uri, cfg, client = _store(store, "rescored")
    parent = RunHandle.for_config(cfg, "srch", {}, tags={})
    rid = RunHandle.open(uri, "rescored", "srch-t000", {}, parent_run_id=parent.run_id).run_id
    history = [
        (0, 0.9, 0.5),
        (2, 0.30, 0.6),
        (4, 0.45, 0.7),
        (6, 0.45, 0.8),
    ]  # step, recall@1, map@r; step 0: untrained
    client.log_batch(
        rid,
        metrics=[
            Metric(k, v, 0, s)
            for s, r, m in history
            for k, v in (("eval/recall_at_1", r), ("eval/ranking/map_at_r", m))
        ],
    )
    row = TrialRow(0, "", "srch-t000", "finished", {}, 0.30, 2, 0.30, 1, 2, rid, {"eval/recall@1": 0.30})
    reconcile_with_mlflow([row], parent, "eval/recall@1", "max")
    assert (row.status, row.best, row.best_step, row.last, row.evaluations, row.steps) == (
        "stopped early",
        0.45,
        4,
        0.45,
        3,
        6,
    )
    assert row.best_metrics == {"eval/recall@1": 0.45, "eval/map@r": 0.7}
    # mode min picks the lowest, and a row Tune already saw complete is left alone
    row_min = TrialRow(0, "", "srch-t000", "finished", {}, 0.30, 2, 0.30, 1, 2, rid)
    reconcile_with_mlflow([row_min], parent, "eval/recall@1", "min")
    assert (row_min.best, row_min.best_step) == (0.30, 2)
    full = TrialRow(0, "", "srch-t000", "finished", {}, 0.1, 2, 0.2, 3, 6, rid)
    reconcile_with_mlflow([full], parent, "eval/recall@1", "max")
    assert (full.best, full.evaluations) == (0.1, 3)
