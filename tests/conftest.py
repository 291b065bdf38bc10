"""Fixtures shared by several test modules."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# The remote-shard tests' moto and s3fs and the docs tests' mkdocs, which `make` installs beside site-packages
# (tests/side_stack.py says why). PYTHONPATH too: the `dmltrain` subprocesses and Ray workers the tests start read
# s3:// through s3fs. Appending is safe: each folder holds only packages the environment lacks.
for _stack in (Path(sys.prefix) / "test-s3", Path(sys.prefix) / "docs"):
    if _stack.is_dir() and str(_stack) not in sys.path:
        sys.path.append(str(_stack))
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(_stack)]))


@pytest.fixture(scope="module")
def one_torch_thread():
    """Small tensors on a shared 2-core machine: intra-op threads only add contention (use it per module,
    ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def _torch_threads_kept():
    """Code under test may set torch's thread count for its process (a worker's ``cluster.cpus_per_worker``, the
    validation task's ``eval.async_cpus``); tests run in one process, so each gets back the count it started with
    and no test's figures depend on which tests ran before it."""
    before = torch.get_num_threads()
    yield
    if torch.get_num_threads() != before:
        torch.set_num_threads(before)


def pytest_collection_modifyitems(config, items):
    """Tests marked ``cuda`` need a CUDA device: skipped without one, selected alone by ``pytest -m cuda``
    (``make gpu-check``)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


def pytest_runtest_logreport(report):
    """With ``DMLTRAIN_TEST_LOG`` set (``make gpu-check``'s tests part), one JSON line per test appended to that
    file as the test ends (``nodeid``, ``outcome``: passed, failed, error or skipped, ``message``), so a run
    cut short still tells what ran."""
    path = os.environ.get("DMLTRAIN_TEST_LOG")
    if not path or not (report.when == "call" or report.outcome != "passed"):
        return
    outcome = report.outcome if report.when == "call" or report.skipped else "error"
    crash = getattr(report.longrepr, "reprcrash", None)
    if crash is not None:
        message = crash.message
    elif isinstance(report.longrepr, tuple):  # a skip: (file, line, reason)
        message = report.longrepr[2]
    else:
        message = str(report.longrepr or "")
    line = {"nodeid": report.nodeid, "outcome": outcome, "message": message.strip().split("\n")[0][:300]}
    with open(path, "a") as f:
        f.write(json.dumps(line) + "\n")


@pytest.fixture
def one_process_group(monkeypatch):
    """A one-process gloo group on the CPU for a DeepSpeed engine at W = 1, ended through DeepSpeed afterwards."""
    from multiproc import end_process_group

    from dmltrain.distributed.process_group import ensure_process_group

    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    monkeypatch.setenv("LOCAL_RANK", "0")
    ensure_process_group()
    yield
    end_process_group()


@pytest.fixture
def read_only_dir(tmp_path):
    """A folder nothing can be created in, for root too (root ignores permission bits: the folder is made immutable)."""
    d = tmp_path / "read-only"
    d.mkdir()
    if os.geteuid() == 0:
        made = subprocess.run(["chattr", "+i", str(d)], capture_output=True)
        if made.returncode:
            pytest.skip(
                f"running as root and chattr +i failed ({made.stderr.decode().strip()}): cannot make a read-only folder"
            )
        yield d
        subprocess.run(["chattr", "-i", str(d)], check=True)
    else:
        d.chmod(0o555)
        yield d
        d.chmod(0o755)


@pytest.fixture(scope="session")
def mlflow_store(tmp_path_factory) -> str:
    """The URI of one SQLite MLflow store for the session (creating a store runs MLflow's migrations, about 7 s on
    the 2-core machine); each test that uses it keeps to an experiment of its own."""
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"
