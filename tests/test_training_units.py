"""Pieces of the training system that need no Ray: DeepSpeed JSON, the objective."""

from __future__ import annotations

import json

import pytest
import torch

from dmltrain.config import load_config
from dmltrain.errors import UserError


def test_deepspeed_config_generated_and_overridden(tmp_path):
    from dmltrain.training.engine import deepspeed_config

    cfg = load_config(None, ["train.precision=bf16", "train.zero_stage=2", "train.grad_clip=1.5", "data.batch_size=64", "cluster.num_workers=2"])
    ds = deepspeed_config(cfg, world_size=2)
    assert ds["train_micro_batch_size_per_gpu"] == 32 and ds["train_batch_size"] == 64
    assert ds["zero_optimization"] == {"stage": 2} and ds["bf16"]["enabled"] and not ds["fp16"]["enabled"]
    assert ds["gradient_clipping"] == 1.5
    user = tmp_path / "ds.json"
    user.write_text(json.dumps({"zero_optimization": {"stage": 2, "overlap_comm": True}, "gradient_clipping": 0.5}))
    ds = deepspeed_config(load_config(None, [f"train.deepspeed_config={user}", "cluster.num_workers=2"]), world_size=2)
    assert ds["zero_optimization"] == {"stage": 2, "overlap_comm": True} and ds["gradient_clipping"] == 0.5
    user.write_text(json.dumps({"train_micro_batch_size_per_gpu": 7}))
    with pytest.raises(UserError, match="train_micro_batch_size_per_gpu.*data.batch_size"):
        deepspeed_config(load_config(None, [f"train.deepspeed_config={user}"]), world_size=2)
    user.write_text("{not json")
    with pytest.raises(UserError, match=r"ds.json: invalid JSON at line 1"):
        deepspeed_config(load_config(None, [f"train.deepspeed_config={user}"]), world_size=2)


def test_objective_single_worker_is_the_plain_weighted_sum():
    """At W=1 the objective is w1 × NormSoftmax + w2 × ICE of the registry losses, gradients included."""
    from dmltrain.losses import build_loss
    from dmltrain.training.objective import Objective

    cfg = load_config(None, ["loss.classifier.weight=0.7", "loss.instance.kind=ice", "loss.instance.weight=0.3",
                             "loss.classifier.params={temperature: 0.1}", "cluster.num_workers=1"])
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("gloo", init_method="tcp://127.0.0.1:29533", rank=0, world_size=1)
    try:
        obj = Objective(cfg, num_classes=10, dim=8, world_size=1)
        g = torch.Generator().manual_seed(0)
        x = torch.randn(12, 8, generator=g, requires_grad=True)
        y = torch.arange(12) % 6
        loss = obj(x, y, step=0)
        loss.backward()
        ref_cls = build_loss("normsoftmax", num_classes=10, dim=8, temperature=0.1)
        with torch.no_grad():
            ref_cls.weight.copy_(obj.classifier.full_weight())
        x2 = x.detach().clone().requires_grad_(True)
        ref = 0.7 * ref_cls(x2, y) + 0.3 * build_loss("ice", scale=64.0)(x2, y)
        ref.backward()
        torch.testing.assert_close(loss, ref)
        torch.testing.assert_close(x.grad, x2.grad)
        torch.testing.assert_close(obj.classifier.weight.grad, ref_cls.weight.grad)
        assert set(obj.stats) >= {"loss", "classifier/loss", "instance/loss"}
    finally:
        torch.distributed.destroy_process_group()


def _proxy_objective_worker(rank, world, kind):
    """Objective with a replicated proxy loss at W workers vs the loss of the concatenated batch."""
    from dmltrain.losses import make_loss
    from dmltrain.training.objective import Objective

    cfg = load_config(None, ["loss.classifier=null", f"loss.instance.kind={kind}", "loss.instance.params={}", f"cluster.num_workers={world}",
                             "data.batch_size=48"])
    torch.manual_seed(100 + rank)  # different RNG per rank: the replicas must still start equal
    obj = Objective(cfg, num_classes=7, dim=6, world_size=world)
    g = torch.Generator().manual_seed(0)
    x_all = torch.randn(12, 6, generator=g, dtype=torch.float32)
    y_all = torch.arange(12) % 7
    lo, hi = (0, 5) if rank == 0 else (5, 12)
    x = x_all[lo:hi].clone().requires_grad_(True)
    loss = obj(x, y_all[lo:hi], step=0)
    loss.backward()
    obj.average_replicated_grads()
    ref = make_loss(kind, {}, num_classes=7, dim=6)
    with torch.no_grad():
        for a, b in zip(ref.parameters(), obj.replicated_parameters()):
            a.copy_(b)
    xr = x_all.clone().requires_grad_(True)
    ref_loss = ref(xr, y_all)
    ref_loss.backward()
    # the objective scales embedding grads by W for DeepSpeed's averaging: undo it to compare
    return (float(loss.detach()), float(ref_loss.detach()), torch.allclose(x.grad / world, xr.grad[lo:hi], atol=1e-6),
            all(torch.allclose(p.grad, q.grad, atol=1e-6) for p, q in zip(obj.replicated_parameters(), ref.parameters())),
            [p.detach().tolist() for p in obj.replicated_parameters()])


@pytest.mark.multiprocess
@pytest.mark.parametrize("kind", ["proxy_nca", "center"])
def test_proxy_instance_losses_are_replicated_and_exact(kind):
    from multiproc import run_workers

    out = run_workers(_proxy_objective_worker, 2, kind)
    for loss, ref, emb_ok, proxy_ok, _ in out:
        assert loss == pytest.approx(ref, rel=1e-5) and emb_ok and proxy_ok
    assert out[0][4] == out[1][4]  # replicas identical
