"""The trainer's input side: one-batch lookahead in stream order, the same batches with or without it (both
decodings), step timing without device waits, statistics kept on the device until a log point. The CUDA tests
(skipped without a GPU) run device decoding on the prefetcher's side stream against a busy compute stream."""

from __future__ import annotations

import pytest
import torch
from shard_fixtures import make_shards, stream

from dmltrain.config import load_config
from dmltrain.training.metrics import TrainMetrics
from dmltrain.training.prefetch import Prefetcher
from dmltrain.training.timing import StepTimer
from shards.config import AugmentConfig
from shards.decode.device import DeviceInput
from shards.decode.transforms import IMAGENET_STD

pytestmark = pytest.mark.usefixtures("one_torch_thread")

cuda = pytest.mark.cuda  # skipped without a CUDA device (conftest.py)


def test_prefetcher_prepares_one_ahead_in_order():
    calls: list[int] = []

    def prepare(x, y):
        calls.append(int(x))
        return torch.tensor([x * 10]), torch.tensor([y])

    fetch = Prefetcher(prepare, torch.device("cpu"))
    seen = []
    for i, (a, b) in enumerate(fetch((k, -k) for k in range(5))):
        seen.append((int(a), int(b)))
        assert calls == list(range(min(i + 2, 5)))  # batch i+1 was prepared before batch i came out
    assert seen == [(10 * k, -k) for k in range(5)] and calls == list(range(5))  # each prepared once, in order
    assert list(fetch(iter([]))) == []
    assert [int(a) for a, _ in fetch([(7, 0)])] == [70]


@pytest.fixture(scope="module")
def shard_dir(tmp_path_factory):
    return make_shards(tmp_path_factory.mktemp("prefetch") / "shards")


@pytest.mark.parametrize("decode", ["cpu", "device"])
def test_prefetched_batches_are_the_streams(shard_dir, decode):
    """Through the prefetcher the trainer sees exactly the batches the stream gives, prepared directly: with 0 or 2
    loader processes, and from a resumed position."""
    aug = AugmentConfig(scale=(0.3, 1.0), color_jitter=[0.2, 0.2, 0.2, 0.05])
    prep = DeviceInput(aug, "cpu", torch.bfloat16, channels_last=True)
    direct = [prep(*b) for b in stream(shard_dir, augment=aug, decode=decode, normalize=False).epoch(0)]
    fetch = Prefetcher(prep, torch.device("cpu"))
    for workers, start in ((0, 0), (2, 0), (2, 3)):
        got = list(
            fetch(
                stream(shard_dir, augment=aug, decode=decode, normalize=False, loader_workers=workers).epoch(
                    0, start_batch=start
                )
            )
        )
        assert len(got) == len(direct) - start
        for (x, y), (wx, wy) in zip(got, direct[start:]):
            assert torch.equal(y, wy) and torch.equal(x, wx) and x.dtype == torch.bfloat16
            assert x.is_contiguous(memory_format=torch.channels_last)


def _busy(load: torch.Tensor, churn: int) -> torch.Tensor:
    """Work queued on the current (compute) stream, with memory allocated, dirtied and freed there."""
    for _ in range(4):
        load = torch.tanh(load @ load / load.shape[0] ** 0.5)
        torch.empty(churn, device=load.device).fill_(float("nan"))
    return load


@cuda
def test_prefetched_device_decoding_on_cuda_under_a_busy_stream(shard_dir):
    """Batches decoded on the side stream while the compute stream runs (and reuses freed memory) are the batches
    prepared directly, one at a time with a synchronization after each: the step waits for its batch's event and
    the allocator keeps the batch's memory until the step is done with it."""
    dev = torch.device("cuda")
    aug = AugmentConfig(scale=(0.3, 1.0), color_jitter=[0.2, 0.2, 0.2, 0.05], erase=0.3)
    batches = list(stream(shard_dir, augment=aug, decode="device", normalize=False).epoch(0))
    prep = DeviceInput(aug, dev)
    direct = []
    for b in batches:
        x, y = prep(*b)
        torch.cuda.synchronize()
        direct.append((x.cpu(), y.cpu()))
    load, got = torch.randn(1024, 1024, device=dev), []
    for x, y in Prefetcher(prep, dev)(batches):
        load = _busy(load, 4 * x.numel())
        got.append((x.clone(), y.clone()))  # on the compute stream, after the batch's event
    torch.cuda.synchronize()
    assert len(got) == len(direct) and torch.isfinite(load).all()
    for (x, y), (wx, wy) in zip(got, direct):
        assert torch.equal(y.cpu(), wy)
        # the same kernels on another stream; a float32 sum on a rounding boundary may round the other way
        levels = (x.cpu() - wx).abs() * (255 * torch.tensor(IMAGENET_STD).view(1, 3, 1, 1))
        assert levels.max() <= 1.01 and (levels < 0.5).float().mean() > 0.999


@cuda
def test_preparing_a_device_decoded_batch_does_not_wait_for_the_device(shard_dir):
    """With torch's sync debug mode at "error", preparing batches (the one copy from pinned memory, decoding,
    augmentation, normalization, noise) and handing them over raises on any host synchronization torch makes.
    torchvision's nvJPEG call waits through the CUDA runtime for its own stream only (the decoding itself),
    which this mode does not see and which does not wait for the compute stream."""
    dev = torch.device("cuda")
    aug = AugmentConfig(scale=(0.3, 1.0), color_jitter=[0.2, 0.2, 0.2, 0.05], erase=0.5, noise=0.1)
    batches = list(stream(shard_dir, augment=aug, decode="device", normalize=False).epoch(0))
    prep = DeviceInput(aug, dev, torch.bfloat16, channels_last=True)
    prep(*batches[0])  # first use: nvJPEG's handle, the normalization constants, the pinned pool
    torch.cuda.synchronize()
    load, seen = torch.randn(1024, 1024, device=dev), 0
    torch.cuda.set_sync_debug_mode("error")
    try:
        for x, y in Prefetcher(prep, dev)(batches[1:]):  # noqa: B007 — y is checked after the loop
            load = _busy(load, x.numel())
            seen += 1
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert seen == len(batches) - 1 and x.dtype == torch.bfloat16 and y.device.type == "cuda"


def test_step_timer_parts_and_aside():
    timer = StepTimer(torch.device("cpu"))
    for _ in range(3):
        timer.start()
        for part in StepTimer.PARTS:
            timer.lap(part)
    with timer.aside():
        sum(range(10000))
    out = timer.summary(global_batch=8)
    assert set(out) == {
        "time/data_ms",
        "time/forward_ms",
        "time/backward_ms",
        "time/optimizer_ms",
        "time/step_ms",
        "images_per_s",
    }
    assert all(v >= 0 for v in out.values()) and timer.steps == 0


def test_work_aside_inside_a_step_is_left_out_of_its_part_and_of_the_step():
    """The classifier's probe runs inside a step, aside: neither the forward part nor the step time counts it."""
    import time

    timer = StepTimer(torch.device("cpu"))
    timer.start()
    timer.lap("data")
    with timer.aside(sync=True):
        time.sleep(0.2)
    for part in StepTimer.PARTS[1:]:
        timer.lap(part)
    out = timer.summary(global_batch=8)
    assert out["time/forward_ms"] < 100 and out["time/step_ms"] < 100


def test_statistics_stay_on_the_device_until_the_summary():
    """The sharded classifier's statistics are device scalars until read; the objective hands them over as such,
    TrainMetrics sums them as tensors, and the summary equals the host floats read step by step."""
    from dmltrain.distributed.process_group import ensure_process_group
    from dmltrain.training.objective import Objective

    cfg = load_config(None, ["cluster.num_workers=1", "loss.instance.kind=ice", "loss.classifier.sample_ratio=0.5"])
    ensure_process_group()
    try:
        obj = Objective(cfg, num_classes=20, dim=16, world_size=1)
        metrics, host = TrainMetrics(), []
        g = torch.Generator().manual_seed(0)
        for step in range(3):
            obj(torch.randn(8, 16, generator=g, requires_grad=True), torch.arange(8) // 2, step=step)
            dev = obj.device_stats
            assert isinstance(dev["classifier/loss"], torch.Tensor) and isinstance(dev["classifier/active_rows"], float)
            assert isinstance(dev["loss"], torch.Tensor)
            metrics.add(dev)
            assert isinstance(metrics.sums["classifier/accuracy"], torch.Tensor)  # summed where it lives
            host.append(obj.stats)
        summary = metrics.summary()
        for k in host[0]:
            assert summary[k] == pytest.approx(sum(h[k] for h in host) / 3, rel=1e-6), k
        assert set(obj.classifier.stats) >= {
            "loss",
            "accuracy",
            "active_rows",
            "active_classes",
            "active_share",
            "target_cos",
        }
    finally:
        torch.distributed.destroy_process_group()
