"""`dmltrain export`: ONNX (through onnxruntime), pt2 and TorchScript files of an embedding model, their contract,
their check against PyTorch, and the run's MLflow logged model."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime
import pytest
import torch

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
        runner, contract = load_exported(result.path)
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
