"""Shards on object storage: build to, inspect, stream and evaluate from moto's S3 server and a Range-honouring
HTTP server on loopback, with faults injected (503 SlowDown, hangs past the time limit, a truncated body).

The references are the same shards read from local disk: the batches must be equal, whatever was retried.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from object_store import Faults, RangeHTTPServer, s3_server
from shard_fixtures import make_shards, stream

from dmltrain.cli import main
from dmltrain.errors import UserError
from shards.manifest import Manifest
from shards.read.stream import eval_batches
from shards.read.tar_index import GroupReader
from shards.storage.location import Location, parse_storage_options
from shards.storage.remote_reads import RemoteSource, coalesce
from shards.storage.retries import IOStats, transient_kind

pytestmark = pytest.mark.timeout(300)
# requests time out after 2 s, hangs last 3 s; on a loaded machine a slow answer is a timeout too, and is retried
FAST = {"timeout_s": 2.0, "retries": 8, "cache": False}
HANG = {"p_hang": 0.03, "hang_s": 3.0}


@pytest.fixture(scope="module")
def s3():
    faults = Faults(seed=7)
    with s3_server(faults) as server:
        server.opts = {"endpoint_url": server.endpoint}
        Location("s3://shards", server.opts).fs.mkdir("shards")
        yield server


@pytest.fixture(autouse=True)
def _no_faults(s3):
    s3.faults.clear()
    yield
    s3.faults.clear()


@pytest.fixture(scope="module")
def local(tmp_path_factory) -> Path:
    return make_shards(tmp_path_factory.mktemp("remote") / "local")


@pytest.fixture(scope="module")
def uploaded(s3, local) -> str:
    """The local shards copied object by object to s3://shards/copy."""
    loc = Location("s3://shards/copy", s3.opts)
    for p in sorted(local.iterdir()):
        loc.upload(p, p.name)
    return loc.root


def _cli(*argv: str) -> int:
    return main(list(argv))


def _opts(s3) -> list[str]:
    return ["--storage-option", f"endpoint_url={s3.endpoint}"]


def _same_epoch(a, b) -> int:
    """Both streams' epoch 0 is the same; the reference is read first (the S3 server shares this process)."""
    ref = list(a.epoch(0, with_index=True))
    got = list(b.epoch(0, with_index=True))
    assert len(got) == len(ref)
    for r, g in zip(ref, got):
        assert all(torch.equal(x, y) for x, y in zip(r, g))
    return len(ref)


# -- units ----------------------------------------------------------------------------------------
def test_coalesce_merges_neighbours_and_cuts_long_ranges():
    ranges = [(1, 100, 50), (0, 0, 10), (0, 15, 5), (0, 5000, 10), (1, 160, 40), (2, 0, 25)]
    assert coalesce(ranges, gap=10, limit=1000) == [(0, 0, 20), (0, 5000, 5010), (1, 100, 200), (2, 0, 25)]
    assert coalesce([(0, 0, 2500)], gap=0, limit=1000) == [(0, 0, 1000), (0, 1000, 2000), (0, 2000, 2500)]
    assert coalesce([(0, 0, 600), (0, 600, 600)], gap=0, limit=1000) == [
        (0, 0, 600),
        (0, 600, 1200),
    ]  # merged would exceed


def test_transient_failures_are_told_from_permanent_ones():
    class ClientError(Exception):
        def __init__(self, status, code):
            self.response = {"ResponseMetadata": {"HTTPStatusCode": status}, "Error": {"Code": code}}

    class ClientResponseError(Exception):
        status = 502

    class ClientPayloadError(Exception):
        pass

    wrapped = OSError("Please reduce your request rate")
    wrapped.__cause__ = ClientError(503, "SlowDown")
    assert transient_kind(wrapped) == "throttled"
    assert transient_kind(ClientError(500, "InternalError")) == "server_error"
    assert transient_kind(ClientResponseError()) == "server_error"
    assert transient_kind(TimeoutError()) == "timeout"
    assert transient_kind(ConnectionResetError()) == "connection"
    assert transient_kind(ClientPayloadError("Response payload is not completed")) == "truncated"
    assert transient_kind(ClientError(403, "AccessDenied")) is None
    assert transient_kind(FileNotFoundError("no such key")) is None
    assert transient_kind(ValueError("bad")) is None


def test_urls_are_never_paths_and_credentials_stay_out_of_options(tmp_path, capsys):
    assert Location("file://" + str(tmp_path)).remote is False and Location("s3://b/x/").root == "s3://b/x"
    with pytest.raises(UserError, match="not a folder URL"):
        Location("https://host/shards?sig=1")
    with pytest.raises(UserError, match="credentials do not belong"):
        parse_storage_options(["client_kwargs.aws_secret_access_key=abc"])
    assert parse_storage_options(
        ["anon=true", "client_kwargs.region_name=eu-west-1", "endpoint_url=http://127.0.0.1:9"]
    ) == {"anon": True, "client_kwargs": {"region_name": "eu-west-1"}, "endpoint_url": "http://127.0.0.1:9"}
    assert _cli("shards", "inspect", "nosuchscheme://bucket/x") == 2
    assert "unknown URL scheme 'nosuchscheme'" in capsys.readouterr().err
    assert _cli("shards", "inspect", "s3://b/x", "--storage-option", "secret=abc") == 2
    assert "credentials do not belong" in capsys.readouterr().err


def test_a_missing_sdk_is_one_line_naming_the_package(capsys):
    try:
        import gcsfs  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("gcsfs is installed here")
    assert _cli("shards", "inspect", "gs://bucket/sop") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "gcsfs" in err[0] and "dmltrain[gcs]" in err[0]


# -- build and inspect ----------------------------------------------------------------------------
def test_build_to_s3_writes_objects_not_a_local_folder(s3, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    args = (
        "shards",
        "build",
        "--layout",
        "synthetic",
        "--classes",
        "6",
        "--per-class",
        "4",
        "--image-size",
        "16",
        "--shard-size",
        "10",
        "--quiet",
    )
    assert _cli(*args, "--out", "s3://shards/built", *_opts(s3)) == 0
    assert "uploaded 6 shards to s3://shards/built" in capsys.readouterr().out
    assert not (tmp_path / "s3:").exists() and list(tmp_path.iterdir()) == []
    assert _cli(*args, "--out", str(tmp_path / "ref")) == 0
    remote, ref = Manifest.load("s3://shards/built", s3.opts), Manifest.load(tmp_path / "ref")
    assert remote.data["splits"] == ref.data["splits"]  # byte-identical shards: same checksums
    capsys.readouterr()
    assert _cli("shards", "inspect", "s3://shards/built", *_opts(s3)) == 0
    assert "checksums: all 6 shards match" in capsys.readouterr().out
    # an altered object is found by its checksum
    loc = Location("s3://shards/built", s3.opts)
    name = remote.split("train").shards[0].file
    data = bytearray(loc.read_bytes(name))
    data[1000] ^= 0xFF
    loc.write_bytes(name, bytes(data))
    assert _cli("shards", "inspect", "s3://shards/built", *_opts(s3)) == 1
    assert f"s3://shards/built/{name}: checksum mismatch" in capsys.readouterr().err


def test_interrupted_upload_leaves_no_manifest_and_resume_finishes_it(s3, tmp_path, capsys):
    out = "s3://shards/resumed"
    args = (
        "shards",
        "build",
        "--layout",
        "synthetic",
        "--classes",
        "6",
        "--per-class",
        "4",
        "--image-size",
        "16",
        "--shard-size",
        "5",
        "--quiet",
        "--out",
        out,
        *_opts(s3),
    )
    s3.faults.set(fail_puts=r"/train-000002\.tar$")
    assert _cli(*args) == 2
    err = capsys.readouterr().err
    assert "train-000002.tar: upload failed" in err and "--resume" in err
    loc = Location(out, s3.opts)
    present = set(loc.listing())
    assert "manifest.json" not in present and {"train-000000.tar", "train-000001.tar"} <= present
    with pytest.raises(UserError, match="manifest.json: not found"):
        Manifest.load(loc)
    assert _cli(*args) == 2 and "--resume" in capsys.readouterr().err  # not empty: refused without --resume
    s3.faults.clear()
    puts_before = len(s3.faults.puts())
    assert _cli(*args, "--resume") == 0
    assert f"{len(present)} already there with the same checksum (kept)" in capsys.readouterr().out
    new_puts = s3.faults.puts()[puts_before:]
    m = Manifest.load(loc)
    total = sum(len(m.split(s).shards) for s in m.splits)
    assert (
        total == 12
        and len(new_puts) == total - len(present) + 1
        and not any(p.rsplit("/", 1)[1] in present for p in new_puts)
    )
    assert new_puts[-1].endswith("/manifest.json")  # the manifest last
    assert m.verify() == []
    assert _cli(*args, "--resume") == 2 and "complete (nothing to resume)" in capsys.readouterr().err
    # --overwrite removes what the old manifest lists, and nothing else
    loc.write_bytes("notes.txt", b"mine")
    assert _cli(*args, "--overwrite") == 0
    assert loc.read_bytes("notes.txt") == b"mine" and Manifest.load(loc).verify() == []


# -- reading --------------------------------------------------------------------------------------
@pytest.mark.parametrize("loader_workers", [0, 2])
def test_stream_from_s3_equals_local_disk_through_faults(s3, local, uploaded, loader_workers):
    remote = stream(
        uploaded, loader_workers=loader_workers, storage_options=s3.opts, remote={**FAST, "requests_in_flight": 3}
    )
    before = dict(s3.faults.injected)
    s3.faults.set(p_503=0.15, truncate=1, **HANG)  # after the manifest was read
    assert _same_epoch(stream(local, loader_workers=loader_workers), remote) > 3
    io = remote.io_counts()
    assert io["retries/throttled"] > 0 and io["failed"] == 0 and remote.skipped == 0
    assert s3.faults.injected["truncated"] == before["truncated"] + 1
    assert io["retries"] == sum(
        io[f"retries/{k}"] for k in ("timeout", "throttled", "server_error", "connection", "truncated")
    )


@pytest.mark.parametrize("fault", ["truncate", "hang", "503"])
def test_each_fault_is_retried_and_counted_by_kind(s3, uploaded, fault):
    loc = Location(uploaded, s3.opts, FAST)
    expected = loc.read_bytes("train-000000.tar")[100:-7]
    s3.faults.set(
        **{
            "truncate": {"truncate": 1},
            "hang": {"p_hang": 1.0, "hang_s": 3.0, "limit": 1},
            "503": {"p_503": 1.0, "limit": 1},
        }[fault]
    )
    stats = IOStats()
    got = loc.run(loc.call("cat_file", loc.url("train-000000.tar"), start=100, end=100 + len(expected), stats=stats))
    kind = {"truncate": "truncated", "hang": "timeout", "503": "throttled"}[fault]
    assert (
        got == expected
        and stats.counts[f"retries/{kind}"] == 1
        and stats.retries == 1
        and stats.counts["requests"] == 2
    )


def test_eval_batches_from_s3_equal_local_disk(s3, local, uploaded):
    s3.faults.set(p_503=0.2)
    kw = dict(rank=1, world_size=2, batch_size=7, resize=20, crop=16, loader_workers=0)
    ref = list(eval_batches(local, "test", **kw))
    got_batches = eval_batches(uploaded, "test", storage_options=s3.opts, remote=FAST, **kw)
    got = list(got_batches)
    assert len(got) == len(ref) and all(torch.equal(a, b) for r, g in zip(ref, got) for a, b in zip(r, g))
    assert got_batches.skipped == 0 and got_batches.io["requests"] > 0


def test_shard_cache_downloads_each_shard_once_and_stays_bounded(s3, local, uploaded, tmp_path, monkeypatch):
    """Reads never wait for a download, so how many shards an epoch leaves in the cache depends on the machine's
    speed; what is checked waits for the downloads themselves (:meth:`RemoteSource.wait_for_downloads`), never
    on time, and holds on a machine too slow to finish any download within an epoch (made so for the bounded
    cache's epoch)."""
    import asyncio
    import threading

    from shards.storage.shard_cache import ShardCache

    go, fetch = threading.Event(), ShardCache.fetch

    async def slow(self, sha256, size, download):  # a download starts only once ``go`` is set
        while not go.is_set():
            await asyncio.sleep(0.01)
        return await fetch(self, sha256, size, download)

    go.set()
    cache = tmp_path / "cache"
    settings = {**FAST, "cache": True, "cache_dir": str(cache)}
    s3.faults.set(p_503=0.2, **HANG)
    remote = stream(uploaded, storage_options=s3.opts, remote=settings)
    assert _same_epoch(stream(local), remote) > 3
    first = remote.io_counts()
    shards = Manifest.load(local).split("train").shards
    shas = {sh.sha256 for sh in shards}
    # the downloads an epoch finished (any number: those still running when it ended were stopped, leaving nothing)
    # are whole shards named by their content, each counted once
    cached = {p.stem for p in cache.glob("*.tar")}
    assert cached <= shas and first["cache_downloads"] <= len(cached) and not list(cache.glob("*.tmp"))
    assert first["retries/throttled"] > 0
    # the others downloaded through the same faults, waited for: then every shard is in the cache, verified
    loc = Location(uploaded, s3.opts, remote=settings)
    source = RemoteSource(Manifest.load(loc).split("train"), loc)
    for i in range(len(shards)):
        source.read(i, 0, 512)  # the first read of a shard starts its download
    assert source.wait_for_downloads() == len(shards)
    source.close()
    assert {p.stem for p in cache.glob("*.tar")} == shas and not list(cache.glob("*.tmp"))
    assert source.stats.counts["cache_downloads"] == len(shas - cached)  # only those not there yet
    # shards in the cache (content-addressed: <sha256>.tar) are read from there, not requested
    _same_epoch(stream(local), remote)
    assert remote.io_counts()["requests"] == first["requests"]
    # bounded: downloaded one after another into room for three, the least recently used make room
    small = tmp_path / "small"
    limit = 3 * max(sh.bytes for sh in shards)
    bounded = {**settings, "cache_dir": str(small), "cache_gb": limit / 2**30}
    go.clear()
    monkeypatch.setattr(ShardCache, "fetch", slow)  # no download finishes within this epoch: it ends them all
    _same_epoch(stream(local), stream(uploaded, storage_options=s3.opts, remote=bounded))  # the batches do not change
    assert sum(p.stat().st_size for p in small.glob("*.tar")) == 0 and not list(small.glob("*.tmp"))
    go.set()
    small = tmp_path / "lru"  # from an empty cache, so that what it holds after each download is known
    loc = Location(uploaded, s3.opts, remote={**bounded, "cache_dir": str(small)})
    source = RemoteSource(Manifest.load(loc).split("train"), loc)
    kept = []
    for i, sh in enumerate(shards):
        source.read(i, 0, 512)
        source.wait_for_downloads()
        kept = [*kept, sh]
        while sum(k.bytes for k in kept) > limit:  # what an LRU of ``limit`` bytes holds after this download
            kept.pop(0)
        assert {p.stem for p in small.glob("*.tar")} == {k.sha256 for k in kept}, i
    source.close()
    assert 0 < sum(p.stat().st_size for p in small.glob("*.tar")) <= limit and len(kept) < len(shards)


def test_memory_is_bounded_by_requests_in_flight_not_by_shard_size(s3, local, uploaded):
    """Each request is at most request_mb, at most requests_in_flight run at once, and only the current and
    the next batch's ranges are held: all far below the shard size."""
    settings = {**FAST, "requests_in_flight": 2, "request_mb": 4096 / 2**20}
    st = stream(uploaded, storage_options=s3.opts, remote=settings)
    info = st.split
    reader = GroupReader(info, st.table)
    source = reader.source
    assert isinstance(source, RemoteSource)
    held, ranged = 0, 0
    ref = GroupReader(Manifest.load(local).split("train"), st.table)
    for _, pieces in reader.read_ahead(st.plan(0)):
        ranged = max(ranged, sum(n for _, _, n in reader.ranges(pieces)))
        for p in pieces:
            for pos in p.positions:
                assert reader.sample(p.group, pos) == ref.sample(p.group, pos)
        held = max(held, source.held_bytes())
    largest = max(sh.bytes for sh in info.shards)
    assert source.stats.peak_in_flight <= 2 and source.stats.peak_in_flight_bytes <= 2 * 4096 < largest
    assert held <= 2 * (ranged + 4096 + 1024 * 1024)  # two batches' coalesced ranges
    assert source.stats.counts["requests"] > len(info.shards)  # ranges, not whole shards
    reader.close()


# -- HTTP -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def http(local):
    server = RangeHTTPServer(local.parent, Faults(seed=3)).start()
    yield server
    server.stop()


def test_http_shards_stream_inspect_and_refuse_writes(http, local, capsys):
    url = f"{http.url}/{local.name}"
    http.faults.set(p_503=0.15)
    assert _cli("shards", "inspect", url) == 0
    assert "checksums: all" in capsys.readouterr().out
    http.faults.set(truncate=1, p_503=0.15)
    remote = stream(url, remote=FAST)
    assert _same_epoch(stream(local), remote) > 3
    io = remote.io_counts()
    assert io["retries/throttled"] > 0 and io["failed"] == 0
    http.faults.clear()
    assert (
        _cli(
            "shards",
            "build",
            "--layout",
            "synthetic",
            "--classes",
            "2",
            "--per-class",
            "2",
            "--out",
            f"{http.url}/new",
            "--quiet",
        )
        == 2
    )
    assert "read-only" in capsys.readouterr().err


def test_a_url_password_is_used_but_never_printed(http, local, capsys):
    """``shards inspect https://user:PASSWORD@host/...`` reads the shards and prints the URL without the password,
    in the summary, the JSON summary and the problem lines alike."""
    url = http.url.replace("http://", "http://reader:hunter2-PASSWORD@") + f"/{local.name}"
    for extra in ([], ["--json"]):
        assert _cli("shards", "inspect", url, *extra) == 0
        out, err = capsys.readouterr()
        assert "http://<redacted>@127.0.0.1" in out and "PASSWORD" not in out + err
    assert _cli("shards", "inspect", url.replace(local.name, "missing")) == 2
    err = capsys.readouterr().err
    assert "not found" in err and "PASSWORD" not in err


def test_eval_cli_reads_a_url(http, local, tmp_path, capsys):
    """``dmltrain eval --shards URL`` gives the metrics of the same shards on local disk."""
    from dmltrain.config import ModelConfig
    from dmltrain.models import build_model, save_model

    torch.manual_seed(0)
    cfg = ModelConfig(backbone="small_cnn", embedding_dim=64, pretrained="none")
    ckpt = tmp_path / "model.pt"
    data = {
        "eval_resize": 20,
        "eval_crop": 16,
        "loader_workers": 0,
        "eval_batch_size": 16,
        "remote": {"cache_dir": str(tmp_path / "cache")},
    }
    save_model(ckpt, build_model(cfg), {"model": cfg.model_dump(mode="json"), "data": data})
    outs = {}
    for name, where in (("local", str(local)), ("http", f"{http.url}/{local.name}")):
        http.faults.set(p_503=0.2)
        assert (
            _cli(
                "eval",
                str(ckpt),
                "--shards",
                where,
                "--out",
                str(tmp_path / f"{name}.json"),
                "--no-nmi",
                "--device",
                "cpu",
            )
            == 0
        )
        outs[name] = json.loads((tmp_path / f"{name}.json").read_text())["metrics"]
    assert outs["http"] == outs["local"]
    assert "remote requests" in capsys.readouterr().err and list(
        (tmp_path / "cache").glob("*.tar")
    )  # cached on the way


def test_file_urls_are_local_paths(local):
    m = Manifest.load("file://" + str(local))
    assert not m.location.remote and m.split("train").shards[0].path.is_file()
    assert np.array_equal(
        m.split("train").group_table().offset, Manifest.load(local).split("train").group_table().offset
    )
    assert os.fspath(m.root) == str(local.resolve())


def test_drivers_take_a_url_for_data_shards(s3, local, uploaded, tmp_path, monkeypatch):
    """The launcher's up-front checks and a study's shard table keep ``data.shards`` a URL (no local folder)."""
    from cluster.launch import check_outputs
    from cluster.study import prepare_shards
    from dmltrain.config import load_config

    monkeypatch.chdir(tmp_path)
    over = [
        f"data.shards={uploaded}",
        f"data.storage_options.endpoint_url={s3.endpoint}",
        f"train.output_dir={tmp_path / 'runs'}",
        "data.eval_splits=[test]",
    ]
    cfg = load_config(None, [*over, "data.synthetic=null"])
    check_outputs(cfg)
    assert prepare_shards(cfg, None, progress=False) == {Manifest.load(local).split("train").num_classes: uploaded}
    synthetic = load_config(None, [*over, "data.synthetic.classes=24", "data.synthetic.per_class=4"])
    check_outputs(synthetic)
    with pytest.raises(UserError, match="is a URL"):
        prepare_shards(synthetic, [4, 8], progress=False)
    assert list(tmp_path.iterdir()) == []
