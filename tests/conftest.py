"""Fixtures shared by several test modules."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

# The remote-shard tests' moto and s3fs, which `make` installs beside site-packages (tests/s3_stack.py says why).
# PYTHONPATH too: the `dmltrain` subprocesses and Ray workers the tests start read s3:// through s3fs.
# Appending is safe: the folder holds only packages the environment lacks.
S3_STACK = Path(sys.prefix) / "test-s3"
if S3_STACK.is_dir() and str(S3_STACK) not in sys.path:
    sys.path.append(str(S3_STACK))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(S3_STACK)]))


@pytest.fixture(scope="module")
def one_torch_thread():
    """Small tensors on a shared 2-core machine: intra-op threads only add contention (use it per module,
    ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def mlflow_store(tmp_path_factory) -> str:
    """The URI of one SQLite MLflow store for the session (creating a store runs MLflow's migrations, about 7 s on
    the 2-core machine); each test that uses it keeps to an experiment of its own."""
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"
