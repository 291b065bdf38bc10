"""`dmltrain export`: ONNX (through onnxruntime), pt2 and TorchScript files of an embedding model, their contract,
their check against PyTorch, and the run's MLflow logged model."""

from __future__ import annotations

import http.server
import json
import shutil
import threading

import numpy as np
import onnx
import onnxruntime
import pytest
import torch
from hostile_files import PLANTS, OverwritesAFile, planted_pt2, rewrite_zip

from dmltrain.cli import main
from dmltrain.config import backbone_input, load_config
from dmltrain.models import build_model, save_model
from dmltrain.models.contract import Contract, contract_path, load_contract
from dmltrain.models.serving import TOLERANCE, export_model, load_exported

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# One entry per backbone family: (backbone, model config overrides, image side). Adding a family is one line.
FAMILIES = [
    pytest.param("small_cnn", {}, 32, id="small_cnn"),
    pytest.param("resnet18", {}, 32, id="resnet"),  # the ResNet family at a tiny input size
    pytest.param("test_vit", {}, 32, id="timm_vit"),  # timm's tiny ViT: attention through SDPA, a class token
]


def _config(backbone: str, side: int, **model):
    overrides = [
        f"model.backbone={backbone}",
        "model.embedding_dim=64",
        f"data.eval_crop={side}",
        f"data.image_size={side}",
    ]
    overrides += [f"data.eval_resize={side + 4}", *(f"model.{k}={v}" for k, v in model.items())]
    return load_config(None, overrides)


@pytest.mark.parametrize("backbone, model, side", FAMILIES)
def test_onnx_matches_pytorch_through_onnxruntime(tmp_path, backbone, model, side):
    cfg = _config(backbone, side, **model)
    torch.manual_seed(0)
    net = build_model(cfg.model).eval()
    result = export_model(net, cfg.to_dict(), "onnx", tmp_path / "model.onnx")
    assert result.max_abs_diff <= TOLERANCE["fp32"]
    proto = onnx.load(str(result.path))
    graph = proto.graph
    assert graph.input[0].type.tensor_type.shape.dim[0].dim_param  # a dynamic (named) batch axis
    session = onnxruntime.InferenceSession(str(result.path), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(1)
    for batch in (1, 7):  # independent of the export's own check: fresh inputs, onnxruntime called directly
        x = rng.standard_normal((batch, 3, side, side), dtype=np.float32)
        (got,) = session.run(None, {"images": x})
        with torch.no_grad():
            want = net(torch.from_numpy(x)).numpy()
        assert got.shape == (batch, 64) and np.abs(got - want).max() <= TOLERANCE["fp32"]
    c = load_contract(result.path)
    assert c == result.contract and c.embedding_dim == 64 and c.crop == side and c.resize == side + 4
    opset = next(o.version for o in proto.opset_import if o.domain in ("", "ai.onnx"))
    assert c.normalized and c.format == "onnx" and c.opset == opset
    # the backbone's own input normalization and resampling (timm's ViT: 0.5, 0.5; the others ImageNet's)
    mean, std, interpolation = backbone_input(backbone)
    assert (c.mean, c.std, c.interpolation) == (tuple(mean), tuple(std), interpolation)


def test_contract_round_trips_and_other_formats(tmp_path):
    cfg = _config("small_cnn", 32)
    torch.manual_seed(0)
    net = build_model(cfg.model).eval()
    x = torch.randn(5, 3, 32, 32)
    with torch.no_grad():
        want = net(x)
    for fmt, name, fp16 in (("pt2", "model.pt2", False), ("torchscript", "half.pt", True)):
        result = export_model(net, cfg.to_dict(), fmt, tmp_path / name, fp16=fp16, source={"run_name": "r"})
        runner, contract = load_exported(result.path, trust_torchscript=fmt == "torchscript")
        with torch.no_grad():
            diff = (runner(x) - want).abs().max().item()
        assert diff <= TOLERANCE[contract.precision], (fmt, diff)
        data = json.loads(contract_path(result.path).read_text())
        assert Contract.from_json(data) == contract and Contract.from_json(data).to_json() == data
        assert contract.check["max_abs_diff"] == result.max_abs_diff and contract.source == {"run_name": "r"}
        assert [f.name for f in result.files] == sorted(f.name for f in tmp_path.iterdir() if f.name.startswith(name))
    assert contract.precision == "fp16" and contract.check["tolerance"] == TOLERANCE["fp16"]  # the torchscript one
    data["model"].pop("sha256")
    from dmltrain.errors import UserError

    with pytest.raises(UserError, match="missing key 'sha256'"):
        Contract.from_json(data, "c.json")


def test_export_command(tmp_path, capsys, monkeypatch, mlflow_store):
    """A run folder exported to ONNX lands on the run's logged model; bad paths, formats and a check beyond the
    tolerance are one line each."""
    from mlflow import MlflowClient

    from dmltrain.tracking.run import RunHandle

    monkeypatch.chdir(tmp_path)
    cfg = _config("small_cnn", 32)
    cfg.tracking.experiment = "test-export"
    save_model(tmp_path / "runs/r1/best_model/model.pt", build_model(cfg.model), cfg.to_dict(), extra={"step": 3})
    uri = mlflow_store
    handle = RunHandle.open(uri, cfg.tracking.experiment, "r1", {})
    assert main(["export", "runs/r1", "--tracking-uri", uri, "--fp16"]) == 0
    out = capsys.readouterr().out
    assert "wrote runs/r1/best_model/model.onnx (onnx, opset" in out and "through onnxruntime" in out
    contract = load_contract(tmp_path / "runs/r1/best_model/model.onnx")
    assert contract.precision == "fp16" and contract.check["max_abs_diff"] <= TOLERANCE["fp16"]
    x = np.random.default_rng(2).standard_normal((3, 3, 32, 32), dtype=np.float32)  # float32 in and out
    session = onnxruntime.InferenceSession(str(tmp_path / "runs/r1/best_model/model.onnx"))
    assert session.run(None, {"images": x})[0].dtype == np.float32
    client = MlflowClient(tracking_uri=uri)
    (logged,) = client.search_logged_models([client.get_run(handle.run_id).info.experiment_id])
    assert logged.name == "best_model" and logged.source_run_id == handle.run_id
    files = {f.path for f in client.list_logged_model_artifacts(logged.model_id, "serving/onnx")}
    assert files == {"serving/onnx/model.onnx", "serving/onnx/model.onnx.json"}
    assert logged.tags["dmltrain.serving.onnx.embedding_dim"] == "64"
    assert contract.source["step"] == 3 and contract.source["run_name"] == "r1"
    cases = [
        (["export", "runs/none"], 2, "runs/none: no such file or folder"),
        (["export", "runs/r1", "--format", "tflite"], 2, "--format: unknown format 'tflite'"),
        (["export", "runs/r1", "--format", "pt2", "--opset", "17"], 2, "--opset: only for --format onnx"),
        (
            [
                "export",
                "runs/r1",
                "--out",
                "t/m.pt",
                "--format",
                "torchscript",
                "--fp16",
                "--tolerance",
                "1e-30",
                "--no-tracking",
            ],
            1,
            "above the tolerance",
        ),
    ]
    for argv, code, message in cases:
        assert main(argv) == code, argv
        err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("dmltrain: ")]
        assert len(err) == 1 and message in err[0], (argv, err)
    assert not (tmp_path / "t/m.pt").exists() and not (tmp_path / "t/m.pt.json").exists()


# -- model files as someone else wrote them ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pt2(tmp_path_factory):
    """A real small CNN exported as model.pt2 (torch.export.save), its contract beside it."""
    cfg = _config("small_cnn", 32)
    torch.manual_seed(0)
    return export_model(
        build_model(cfg.model).eval(), cfg.to_dict(), "pt2", tmp_path_factory.mktemp("pt2") / "model.pt2"
    ).path


def _one_error_line(capsys) -> str:
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("dmltrain: error: "), err
    return err[0]


@pytest.mark.parametrize("how", list(PLANTS))
def test_a_pt2_that_would_run_code_is_refused_before_torch_reads_it(pt2, tmp_path, how):
    """Each way torch.export.load runs a file's code (pickled payloads, custom objects, legacy entries, sympy
    expressions, guard code, operator targets, names pasted into generated code, compiled libraries) is refused in
    one line naming the file; the planted code never runs (its marker file is not made)."""
    from dmltrain.errors import UserError
    from dmltrain.models.serving import load_embedder

    marker, bad = tmp_path / "marker", tmp_path / "model.pt2"
    planted_pt2(pt2, bad, how, marker)
    shutil.copy(contract_path(pt2), contract_path(bad))
    with pytest.raises(UserError) as refused:
        module, _, _ = load_embedder(bad)
        module(torch.zeros(2, 3, 32, 32))  # what embed does next (guard code runs here)
    line = str(refused.value)
    assert "\n" not in line and line.startswith(f"{bad}: refused: ") and PLANTS[how][1] in line, line
    assert not marker.exists()
    rewrite_zip(pt2, tmp_path / "same.pt2", lambda entries: None)  # the same rewriting, nothing planted: loads
    shutil.copy(contract_path(pt2), contract_path(tmp_path / "same.pt2"))
    assert load_embedder(tmp_path / "same.pt2")[0](torch.zeros(2, 3, 32, 32)).shape == (2, 64)


def test_embed_refuses_a_planted_pt2_and_writes_nothing(pt2, tmp_path, capsys):
    from PIL import Image

    marker, bad = tmp_path / "marker", tmp_path / "m" / "model.pt2"
    bad.parent.mkdir()
    planted_pt2(pt2, bad, "pickled-weight", marker)
    shutil.copy(contract_path(pt2), contract_path(bad))
    (tmp_path / "images").mkdir()
    Image.new("RGB", (40, 36), (200, 10, 10)).save(tmp_path / "images" / "a.jpg")
    argv = ["embed", str(bad), "--folder", str(tmp_path / "images"), "--out", str(tmp_path / "emb"), "--quiet"]
    assert main(argv) == 2
    assert f"{bad}: refused: " in _one_error_line(capsys)
    assert not marker.exists() and not (tmp_path / "emb").exists()


@pytest.mark.filterwarnings("ignore:`torch.jit:FutureWarning")
def test_the_file_name_picks_the_loader_and_torchscript_needs_trust(tmp_path, capsys):
    """A TorchScript program named model.onnx whose contract says torchscript is refused (the contract does not
    pick the loader); under its own name it loads only with --trust-torchscript. Unrefused, it overwrites a file
    outside the run when it runs (here it is let run once, with the flag, to show the flag is what stands in the way)."""
    victim = tmp_path / "victim.txt"
    victim.write_text("safe")
    program = torch.jit.script(OverwritesAFile(str(victim)))
    contract = Contract(
        file="", format="torchscript", precision="fp32", sha256="", crop=32, resize=36,
        embedding_dim=64, normalized=False, binarizable=False,
    )  # fmt: skip
    (tmp_path / "images").mkdir()
    from PIL import Image

    Image.new("RGB", (40, 36), (10, 200, 10)).save(tmp_path / "images" / "a.jpg")
    for name, extra, message in [
        ("model.onnx", [], "model.onnx.json: says format 'torchscript', but model.onnx is a onnx file by its name"),
        ("model.torchscript.pt", [], "TorchScript programs can run arbitrary code"),
        ("model.bin", [], "not an exported model's name"),
    ]:
        torch.jit.save(program, str(tmp_path / name))
        contract.replace(file=name).save(contract_path(tmp_path / name))
        argv = ["embed", str(tmp_path / name), "--folder", str(tmp_path / "images"), "--out", str(tmp_path / "e")]
        assert main([*argv, "--quiet", *extra]) == 2, name
        assert message in _one_error_line(capsys), name
        assert victim.read_text() == "safe" and not (tmp_path / "e").exists()
    # a contract that names another format than the file's own name, the other way round: refused as well
    contract.replace(format="onnx").save(contract_path(tmp_path / "model.torchscript.pt"))
    assert main([*argv[:1], str(tmp_path / "model.torchscript.pt"), *argv[2:], "--quiet", "--trust-torchscript"]) == 2
    assert "says format 'onnx', but model.torchscript.pt is a torchscript file" in _one_error_line(capsys)
    contract.replace(file="model.torchscript.pt").save(contract_path(tmp_path / "model.torchscript.pt"))
    assert main([*argv[:1], str(tmp_path / "model.torchscript.pt"), *argv[2:], "--quiet", "--trust-torchscript"]) == 0
    assert victim.read_text() == "XXXX"  # what --trust-torchscript lets a program do


def test_sizes_from_a_model_file_or_contract_are_bounded(pt2, tmp_path, capsys):
    """A model file or a contract asking for a 30000-pixel crop (21.6 GB for embed's first batch) is one line."""
    cfg = _config("small_cnn", 32).to_dict()
    cfg["data"]["eval_crop"], cfg["data"]["eval_resize"] = 30000, 30000
    save_model(tmp_path / "big/model.pt", build_model(_config("small_cnn", 32).model), cfg)
    (tmp_path / "images").mkdir()
    from PIL import Image

    Image.new("RGB", (40, 36)).save(tmp_path / "images" / "a.jpg")
    argv = ["--folder", str(tmp_path / "images"), "--out", str(tmp_path / "e"), "--quiet"]
    assert main(["embed", str(tmp_path / "big/model.pt"), *argv]) == 2
    assert "big/model.pt: stored config data.eval_crop: 30000 is outside [8, 4096] pixels" in _one_error_line(capsys)
    shutil.copy(pt2, tmp_path / "model.pt2")
    data = json.loads(contract_path(pt2).read_text())
    data["input"]["crop"] = data["input"]["resize"] = 30000
    contract_path(tmp_path / "model.pt2").write_text(json.dumps(data))
    assert main(["embed", str(tmp_path / "model.pt2"), *argv]) == 2
    assert "model.pt2.json: malformed contract (input.crop: 30000 is outside [8, 4096] pixels)" in _one_error_line(
        capsys
    )
    # Python's JSON parser takes Infinity and NaN: a number, but no side (it was an OverflowError traceback)
    contract_path(tmp_path / "model.pt2").write_text(json.dumps(data).replace("30000", "Infinity"))
    assert main(["embed", str(tmp_path / "model.pt2"), *argv]) == 2
    assert "model.pt2.json: malformed contract (cannot convert float infinity to integer)" in _one_error_line(capsys)
    contract_path(tmp_path / "model.pt2").write_text(json.dumps({**data, "version": 1.5}))
    assert main(["embed", str(tmp_path / "model.pt2"), *argv]) == 2
    assert "model.pt2.json: version: '1.5' is not a whole number" in _one_error_line(capsys)
    assert not (tmp_path / "e").exists()


class _Capture(http.server.BaseHTTPRequestHandler):
    """Records every request (method, path, Authorization) and answers 404 in MLflow's JSON."""

    seen: list = []

    def _answer(self):
        type(self).seen.append((self.command, self.path, self.headers.get("Authorization")))
        body = b'{"error_code": "RESOURCE_DOES_NOT_EXIST", "message": "no"}'
        self.send_response(404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _answer

    def log_message(self, *args):
        pass


def test_export_never_contacts_the_store_a_model_file_names(tmp_path, capsys, monkeypatch):
    """A model file whose stored config says tracking.uri = a listener on loopback (or a sqlite: file elsewhere)
    exports without sending anything there, the user's MLflow credentials included, and creates no database."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Capture)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        monkeypatch.chdir(tmp_path)
        monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
        monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "alice")
        monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "s3cret-of-alice")
        (tmp_path / "elsewhere").mkdir()
        for uri in (f"http://127.0.0.1:{server.server_port}", f"sqlite:///{tmp_path / 'elsewhere' / 'planted.db'}"):
            cfg = _config("small_cnn", 32)
            config = cfg.to_dict()
            config["tracking"]["uri"] = uri
            save_model(tmp_path / "runs/r1/best_model/model.pt", build_model(cfg.model), config)
            assert main(["export", "runs/r1", "--format", "torchscript"]) == 0
            assert "MLflow: not attached (no MLflow store found" in capsys.readouterr().err
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
    assert _Capture.seen == [] and list((tmp_path / "elsewhere").iterdir()) == []
