"""A local Ray (``dmltrain train``/``tune``/``study`` without ``cluster.address``, and the test fixtures)
listens on loopback only, and runs with token authentication, without Ray's WARNING about it on the terminal.

A child process starts Ray through :func:`cluster.launch.start_local_ray` (dashboard included),
runs a task and an actor, and lists the listening TCP sockets of itself and every process it
started, as ``ss -ltnp`` would. Plain ``ray.init()`` puts the GCS, raylet, workers and agents on
``::``/``0.0.0.0``.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from netcheck import is_loopback

REPO = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent

CHILD = """
import json, os, psutil, ray
from cluster.launch import _local_token_auth, start_local_ray
from netcheck import listening
from ray._raylet import AuthenticationMode, get_authentication_mode

start_local_ray(num_cpus=1, include_dashboard=True, log_to_driver=False)

@ray.remote
def task():
    return os.getpid()

@ray.remote(num_cpus=0)
class Actor:
    def pid(self):
        return os.getpid()

actor = Actor.remote()
ray.get([task.remote(), actor.pid.remote()])
me = psutil.Process()
pids = [me.pid] + [p.pid for p in me.children(recursive=True)]
result = {"sockets": listening(pids), "node_ip": ray.util.get_node_ip_address(),
          "token_auth": get_authentication_mode() == AuthenticationMode.TOKEN,
          "session": ray._private.worker._global_node.get_session_dir_path()}
ray.shutdown()
# joining a cluster of this machine by its loopback address (a `dmltrain cluster local`), RAY_AUTH_MODE unset: the
# token this user has
os.environ.pop("RAY_AUTH_MODE")
_local_token_auth()
result["join_mode"] = os.environ.get("RAY_AUTH_MODE")
print("RESULT " + json.dumps(result))
"""


@pytest.mark.ray
@pytest.mark.timeout(300)
def test_local_ray_listens_on_loopback_only_with_token_auth(tmp_path):
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_ADDRESS")
    }
    env.update(
        PYTHONPATH=os.pathsep.join([str(REPO), str(TESTS), os.environ.get("PYTHONPATH", "")]),
        HOME=str(tmp_path),
        RAY_USAGE_STATS_ENABLED="0",
    )  # HOME: the token Ray makes for a local instance goes to tmp_path/.ray
    proc = subprocess.run(
        [sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=280, cwd=tmp_path
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    result = json.loads(proc.stdout.split("RESULT ", 1)[1])
    sockets = [tuple(s) for s in result["sockets"]]
    names = {s[1] for s in sockets}
    assert {"gcs_server", "raylet"} <= names, f"the check saw too little of Ray: {sockets}"
    open_beyond = [s for s in sockets if not is_loopback(s[2])]
    assert not open_beyond, f"listening beyond loopback: {open_beyond}"
    assert result["node_ip"] == "127.0.0.1"
    assert result["token_auth"], "Ray >= 2.59 starts a local instance with token authentication"
    assert result["join_mode"] == "token"
    # chosen, not defaulted to: Ray prints nothing about it; its other messages still reach the terminal
    assert "Token authentication is enabled" not in proc.stderr, proc.stderr[-2000:]
    assert "Started a local Ray instance" in proc.stderr, proc.stderr[-2000:]
    # the token and the session folders are this user's alone (Ray's own: 0644 in a 0755 ~/.ray, /tmp/ray 0777)
    token = tmp_path / ".ray" / "auth_token"
    assert token.is_file() and _mode(token) == 0o600 and _mode(token.parent) == 0o700
    session = Path(result["session"])
    private = Path(tempfile.gettempdir()) / f"dmltrain-ray-{os.getuid()}"
    assert session.is_relative_to(private) and _mode(private) == 0o700 and private.stat().st_uid == os.getuid()


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)
