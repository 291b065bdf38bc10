"""Tiny shard sets for the shard tests: uneven classes (some below K, two bigger than a shard), JPEG members.

``make_shards`` builds them with the real builder; ``garble_members`` damages members in place;
``stream`` is a :class:`~shards.read.stream.TrainStream` over them with the tests' defaults.
"""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

from dataset_fixtures import class_image

from shards.build.builder import build_shards
from shards.build.layouts import Entry, Layout
from shards.read.stream import TrainStream

# class sizes: below K=3 (with replacement), around K, and two classes (12, 13) bigger than a shard (10)
SIZES = [1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 13, 3, 4, 5, 6, 3, 3, 4, 10, 2, 6, 7, 5, 4]
K, P = 3, 6  # global P×K = 18 images
IMG = 16


def render(job: tuple[int, int]) -> tuple[bytes, str]:
    c, i = job
    buf = io.BytesIO()
    class_image(c, i, (20, 18)).save(buf, format="JPEG", quality=85)
    return buf.getvalue(), "jpg"


def make_shards(out: Path, sizes=SIZES, shard_size: int = 10, seed: int = 3) -> Path:
    """Train: ``sizes[c]`` images of class ``c``; test: the first 37 of those images under their own class ids (1000 + c)."""
    entries, jobs = [], []
    for c, n in enumerate(sizes):
        for i in range(n):
            entries.append(Entry(f"c{c}/{i}.jpg", str(c), f"c{c}/{i}.jpg"))
            jobs.append((c, i))
    test = [Entry(e.path, str(1000 + int(e.class_id)), e.relpath) for e in entries[:37]]
    layout = Layout("folder", "memory", {"train": entries, "test": test})
    build_shards(
        out,
        layout,
        load=render,
        args={"train": jobs, "test": jobs[:37]},
        shard_size=shard_size,
        seed=seed,
        workers=1,
        progress=False,
    )
    return out


def garble_members(path: Path, group: list[int], positions: list[int]) -> None:
    """Overwrite the image bytes of samples ``positions`` of a class group in place (the tar stays valid)."""
    raw = bytearray(path.read_bytes())
    label, count, offset, length = group
    with tarfile.open(fileobj=io.BytesIO(bytes(raw[offset : offset + length])), mode="r|") as tf:
        images = [t for t in tf if t.name.endswith(".jpg")]
    assert len(images) == count
    for pos in positions:
        t = images[pos]
        raw[offset + t.offset_data : offset + t.offset_data + t.size] = b"JUNK" * (t.size // 4) + b"J" * (t.size % 4)
    path.write_bytes(bytes(raw))


def stream(shard_dir, rank=0, world_size=1, **kw) -> TrainStream:
    args = dict(
        sampler="pk",
        batch_size=P * K,
        samples_per_class=K,
        seed=11,
        image_size=IMG,
        loader_workers=0,
        shuffle_images=60,
    )
    args.update(kw)
    return TrainStream(shard_dir, rank=rank, world_size=world_size, **args)
