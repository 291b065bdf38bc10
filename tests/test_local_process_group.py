"""The process groups dmltrain starts itself on one machine listen on loopback only: the gloo group of one a training
without Ray Train starts (``ensure_process_group``) and the classifier bench's workers (``bench_runs._dist_entry``).

Two child processes (ranks 0 and 1 of the bench's group; rank 0 first starts and ends the group of one) list their
listening TCP sockets while their group and a later ``new_group`` of it (DeepSpeed's, the elastic run's host flags)
are up, as ``ss -ltnp`` would. With ``init_method="tcp://127.0.0.1:PORT"``
torch's rendezvous store listens on ``::``. Run as root with ``unshare``, each child also gets its own host name set
to this machine's outward address, where gloo binds its own sockets unless told otherwise.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from netcheck import is_loopback

REPO = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent

CHILD = """
import json, os, socket, sys
rank, port, outward = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
if outward:
    socket.sethostname(outward)  # gloo's default address: the one the host name resolves to
import torch
import torch.distributed as dist
from netcheck import listening
from dmltrain.distributed import bench_runs
from dmltrain.distributed.bench_job import ClassifierJob
from dmltrain.distributed.process_group import ensure_process_group

seen = {}
if rank == 0:
    ensure_process_group()
    group = dist.new_group(backend="gloo")  # as DeepSpeed and the elastic run's host flags make them
    dist.all_reduce(torch.ones(1), group=group)
    seen["one"] = listening([os.getpid()])
    dist.destroy_process_group()

def probe(rank, job):  # in place of the measured steps: the groups work, and what listens meanwhile
    t = torch.ones(1)
    dist.all_reduce(t)
    dist.all_reduce(t, group=dist.new_group(backend="gloo"))
    return {"sum": t.item(), "sockets": listening([os.getpid()])}

class Queue:
    def put(self, item):
        seen["two"] = item[1]

bench_runs._ours_rank = probe
bench_runs._dist_entry(rank, ClassifierJob("ours", "cpu", N=8, D=4, B=2, W=2), port, Queue())
print("RESULT " + json.dumps(seen))
"""


def _outward_address() -> str:
    """An IPv4 address of this machine beyond loopback to set as the children's host name, or '' (then gloo's
    default is whatever this machine's host name resolves to): needs root and ``unshare`` for a host name of their
    own."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return ""
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family == socket.AF_INET and not is_loopback(a.address):
                return a.address
    return ""


@pytest.mark.timeout(240)
def test_the_process_groups_started_here_listen_on_loopback_only():
    env = {k: v for k, v in os.environ.items() if k not in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(TESTS), os.environ.get("PYTHONPATH", "")])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    outward = _outward_address()
    wrap = ["unshare", "--uts"] if outward else []
    procs = [
        subprocess.Popen(
            [*wrap, sys.executable, "-c", CHILD, str(rank), str(port), outward],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    try:
        outputs = [p.communicate(timeout=200) for p in procs]
    finally:
        for p in procs:  # a rank whose peer failed would wait for it: gone with the test
            p.kill()
            p.wait()
    for p, (out, err) in zip(procs, outputs):
        assert p.returncode == 0, (out + err)[-4000:]
    results = [json.loads(out.split("RESULT ", 1)[1]) for out, _ in outputs]
    one = [tuple(s) for s in results[0]["one"]]
    assert len(one) >= 3, f"the check saw too little: {one}"  # the store; gloo's of each group
    assert [s for s in one if not is_loopback(s[2])] == [], f"group of one, listening beyond loopback: {one}"
    for rank, result in enumerate(results):
        two = [tuple(s) for s in result["two"]["sockets"]]
        assert result["two"]["sum"] == 4.0
        assert len(two) >= (3 if rank == 0 else 2), two  # rank 0: the store; gloo's of each group
        assert [s for s in two if not is_loopback(s[2])] == [], f"rank {rank}, listening beyond loopback: {two}"
