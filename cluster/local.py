"""``dmltrain cluster local``: a Ray cluster of several nodes on this machine, on loopback, for elastic runs and tests.

``dmltrain cluster local --nodes N`` starts a head and ``N`` worker nodes with Ray's own ``ray start``,
each a real raylet with its own resources (``--cpus`` logical CPUs each, ``--gpus`` GPUs), its own
temporary folder and ports, and its own session of processes; ``--stop`` ends them all (and removes
their session folders, logs included), ``--status`` lists them. Train on it with
``cluster.address=127.0.0.1:PORT`` (printed). Losing a node is then one command away: kill its
processes (``--kill-node I``: a machine gone), or send SIGTERM to its ``ray start`` (``--preempt-node
I``: what a cloud or Kubernetes does to a reclaimed node; Ray drains the node for up to
``RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S``, 30 s, then stops it), and start it again (``--start-node
I``); what an elastic run does meanwhile is in ``docs/how-to/cluster.md``.

Each node runs under ``ray start --block``, as in a container (KubeRay's pods), so that it is stopped
the way a cloud stops one: SIGTERM to that process drains the node first. (A raylet sent SIGTERM
itself sends SIGTERM and SIGKILL to its workers in the same instant, Ray 2.60: nothing can be saved.)

Everything listens on 127.0.0.1 only: ``ray start`` would replace a loopback node address by the
machine's outward one (it does for every multi-node cluster), so the nodes are started through
:func:`ray_start_on_loopback`, which keeps it. The cluster runs with token authentication (the
token in ``~/.ray/auth_token``, made private: :mod:`cluster.ray_files`); its head notices a node
that stopped answering within about 3 s (``RAY_health_check_*``: Ray's default, about 15 s, suits
real networks). The cluster's record (``cluster.json``: address, and each node's session of
processes) is in its folder, by default ``<tmp>/dmltrain-ray-<uid>/local-cluster`` (0700).

A command module: Ray is imported only where a node starts.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil

from dmltrain.errors import UserError
from dmltrain.fileio import write_json

RECORD = "cluster.json"
LOOPBACK = "127.0.0.1"
# the head declares a node dead after this many missed health checks of this period (Ray's default: 5 of 3 s)
HEALTH_CHECKS = {"RAY_health_check_period_ms": "1000", "RAY_health_check_timeout_ms": "1000",
                 "RAY_health_check_failure_threshold": "3"}  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    local = sub.add_parser(
        "local",
        help="start (or stop) a head and N worker nodes on loopback",
        description="Start a Ray head and N worker nodes on this machine, every one a real raylet with its own "
        "resources, all listening on 127.0.0.1; or stop them, list them, kill one or start it again.",
    )
    local.add_argument("--nodes", type=int, default=2, help="worker nodes besides the head (default 2)")
    local.add_argument("--cpus", type=int, default=1, help="logical CPUs of each node, the head's too (default 1)")
    local.add_argument("--gpus", type=int, default=0, help="GPUs of each node (default 0)")
    local.add_argument(
        "--dir", default=None, help="the cluster's folder (default <tmp>/dmltrain-ray-<uid>/local-cluster)"
    )
    local.add_argument("--no-dashboard", action="store_true", help="no dashboard (and no Job API for dmltrain submit)")
    what = local.add_mutually_exclusive_group()
    what.add_argument("--stop", action="store_true", help="stop every node of the cluster")
    what.add_argument("--status", action="store_true", help="list the nodes and whether they run")
    what.add_argument("--kill-node", type=int, metavar="I", help="kill worker node I's processes (SIGKILL)")
    what.add_argument(
        "--preempt-node", type=int, metavar="I", help="SIGTERM to worker node I's `ray start`: drained, then stopped"
    )
    what.add_argument("--start-node", type=int, metavar="I", help="start worker node I again")


def run(args: argparse.Namespace) -> int:
    folder = Path(args.dir) if args.dir else default_folder()
    if args.stop:
        cluster = LocalCluster.load(folder)
        cluster.stop()
        print(f"stopped the local cluster at {cluster.address} ({len(cluster.nodes)} nodes)")
        return 0
    if args.status:
        cluster = LocalCluster.load(folder)
        print(f"local cluster at {cluster.address}, folder {folder}")
        for i, node in enumerate(cluster.nodes):
            name = "head" if i == 0 else f"node {i}"
            print(f"  {name:<7} {'running' if cluster.alive(i) else 'stopped'}  {node.cpus} CPUs, {node.gpus} GPUs")
        return 0
    if args.kill_node is not None or args.start_node is not None or args.preempt_node is not None:
        cluster = LocalCluster.load(folder)
        if args.kill_node is not None:
            cluster.kill_node(args.kill_node)
            print(f"killed node {args.kill_node}")
        elif args.preempt_node is not None:
            cluster.preempt_node(args.preempt_node)
            print(f"sent SIGTERM to node {args.preempt_node}'s ray start (it drains, then stops)")
        else:
            cluster.start_node(args.start_node)
            print(f"started node {args.start_node}")
        return 0
    if args.nodes < 0 or args.cpus < 0 or args.gpus < 0:
        raise UserError("--nodes, --cpus and --gpus: must be >= 0")
    cluster = LocalCluster.start(folder, args.nodes, cpus=args.cpus, gpus=args.gpus, dashboard=not args.no_dashboard)
    nodes = f"{args.nodes} worker node{'s' * (args.nodes != 1)}"
    print(f"local Ray cluster at {cluster.address}: a head and {nodes}, {args.cpus} CPU{'s' * (args.cpus != 1)} each")
    print(f"  train on it:  dmltrain train CONFIG cluster.address={cluster.address}")
    if cluster.dashboard:
        print(f"  dashboard:    {cluster.dashboard}")
    print("  stop it:      dmltrain cluster local --stop" + ("" if args.dir is None else f" --dir {args.dir}"))
    return 0


def default_folder() -> Path:
    from cluster.ray_files import private_temp_dir

    return Path(private_temp_dir()).parent / "local-cluster"


def ray_start_on_loopback(argv: list[str] | None = None) -> None:
    """Ray's ``ray start`` with ``argv``, a 127.0.0.1 node address kept as it is (see the module docstring)."""
    from ray._private import services
    from ray.scripts.scripts import start

    resolve = services.resolve_ip_for_localhost
    services.resolve_ip_for_localhost = lambda host: host if services.is_localhost(host) else resolve(host)
    start.main(sys.argv[1:] if argv is None else argv, prog_name="ray start", standalone_mode=True)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def session_pids(sid: int) -> list[int]:
    """The live processes of session ``sid`` (a node's: ``ray start`` and the processes it starts)."""
    pids = []
    for p in psutil.process_iter(["status"]):
        try:
            if p.info["status"] != psutil.STATUS_ZOMBIE and os.getsid(p.pid) == sid:
                pids.append(p.pid)
        except (OSError, psutil.Error):
            continue
    return pids


def end_session(sid: int, sig: int = signal.SIGTERM, grace: float = 5.0) -> None:
    """Send ``sig`` to every process of session ``sid``; SIGKILL what is left after ``grace`` seconds."""
    for s, wait in ((sig, grace), (signal.SIGKILL, 5.0)):
        for pid in session_pids(sid):
            try:
                os.kill(pid, s)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait
        while session_pids(sid) and time.monotonic() < deadline:
            time.sleep(0.2)
        if s == signal.SIGKILL or not session_pids(sid):
            return


@dataclass
class Node:
    temp_dir: str
    cpus: int
    gpus: int
    sid: int | None = None  # the session of its processes while it runs


@dataclass
class LocalCluster:
    """A head (node 0) and worker nodes on loopback, each in its own session of processes."""

    folder: str
    port: int
    nodes: list[Node] = field(default_factory=list)
    dashboard: str | None = None
    _procs: dict[int, subprocess.Popen] = field(default_factory=dict, repr=False)  # ours to reap

    @property
    def address(self) -> str:
        return f"{LOOPBACK}:{self.port}"

    # -- lifecycle ----------------------------------------------------------------------------------
    @classmethod
    def start(cls, folder: Path, workers: int, *, cpus: int = 1, gpus: int = 0, dashboard: bool = True) -> LocalCluster:
        """A head and ``workers`` worker nodes, started (the worker nodes at once); refused if one runs in ``folder``."""
        from cluster.ray_files import private_token
        from dmltrain.private import private_folder

        folder = Path(folder)
        if (folder / RECORD).exists():
            running = cls.load(folder)
            if any(running.alive(i) for i in range(len(running.nodes))):
                raise UserError(f"{folder}: a local cluster runs there ({running.address}); stop it first (--stop)")
        private_folder(folder, "the local cluster's folder")
        private_token()  # the nodes and the drivers that join them share this user's token
        # short: a raylet's socket path must fit in 107 bytes
        base = Path(tempfile.mkdtemp(prefix="dmlt-", dir="/tmp" if Path("/tmp").is_dir() else None))
        cluster = cls(str(folder), free_port())
        cluster.nodes = [Node(str(base / f"n{i}"), cpus, gpus) for i in range(workers + 1)]
        if dashboard:
            cluster.dashboard = f"http://{LOOPBACK}:{free_port()}"
        try:
            cluster.start_node(0)
            procs = {i: cluster._launch(i) for i in range(1, workers + 1)}
            for i, proc in procs.items():
                cluster._started(i, proc)
        except BaseException:
            cluster.stop()
            raise
        return cluster

    @classmethod
    def load(cls, folder: Path) -> LocalCluster:
        record = Path(folder) / RECORD
        try:
            data = json.loads(record.read_text())
            return cls(data["folder"], int(data["port"]), [Node(**n) for n in data["nodes"]], data.get("dashboard"))
        except FileNotFoundError:
            raise UserError(f"{folder}: no local cluster here (no {RECORD}); start one with --nodes N") from None
        except (ValueError, KeyError, TypeError) as e:
            raise UserError(f"{record}: not a local cluster's record ({type(e).__name__}: {e})") from None

    def save(self) -> None:
        record = {"folder": self.folder, "port": self.port, "nodes": [asdict(n) for n in self.nodes]}
        write_json(Path(self.folder) / RECORD, {**record, "dashboard": self.dashboard})

    def stop(self) -> None:
        """End every node's processes (SIGTERM, SIGKILL after 5 s), worker nodes first; forget the record."""
        for i in reversed(range(len(self.nodes))):
            if self.nodes[i].sid is not None:
                end_session(self.nodes[i].sid)
                self.nodes[i].sid = None
            self._reap(i)
        (Path(self.folder) / RECORD).unlink(missing_ok=True)
        if self.nodes:  # the nodes' sessions (logs, sockets) go with them
            shutil.rmtree(Path(self.nodes[0].temp_dir).parent, ignore_errors=True)

    # -- nodes --------------------------------------------------------------------------------------
    def alive(self, i: int) -> bool:
        sid = self.nodes[i].sid
        return sid is not None and any(_is_raylet(pid) for pid in session_pids(sid))

    def start_node(self, i: int) -> None:
        """Start node ``i`` (0: the head) and wait until it runs. What is left of its previous session (a raylet
        that died leaves its log monitor behind) is ended first."""
        if self.alive(i):
            raise UserError(f"node {i} runs already")
        if self.nodes[i].sid is not None:
            end_session(self.nodes[i].sid)
        self._reap(i)
        self._started(i, self._launch(i))

    def kill_node(self, i: int, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to every process of worker node ``i`` (a lost machine), and wait until they are gone."""
        if i < 1 or i >= len(self.nodes):
            raise UserError(f"--kill-node: worker nodes are 1..{len(self.nodes) - 1}")
        if self.nodes[i].sid is not None:
            end_session(self.nodes[i].sid, sig, grace=10.0)
        self.nodes[i].sid = None
        self._reap(i)
        self.save()

    def preempt_node(self, i: int) -> None:
        """SIGTERM to worker node ``i``'s ``ray start --block``, as a cloud does to a reclaimed node: Ray marks the node
        draining (a preemption, with a deadline) and stops it once idle or at the deadline. Returns at once."""
        if i < 1 or i >= len(self.nodes) or self.nodes[i].sid is None:
            raise UserError(f"--preempt-node: no running worker node {i}")
        os.kill(self.nodes[i].sid, signal.SIGTERM)  # the session leader is the node's `ray start`

    def draining(self, i: int) -> bool:
        """Whether the head has node ``i`` draining (asked through this process's Ray connection)."""
        import ray

        node = self.nodes[i]
        ids = {n["NodeID"] for n in ray.nodes() if n.get("Alive") and n.get("NodeManagerAddress") == LOOPBACK
               and str(n.get("ObjectStoreSocketName", "")).startswith(node.temp_dir)}  # fmt: skip
        return bool(ids & set(ray._private.state.state.get_draining_nodes()))

    def _reap(self, i: int) -> None:
        proc = self._procs.pop(i, None)
        if proc is not None:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def raylet_pid(self, i: int) -> int | None:
        sid = self.nodes[i].sid
        return next((pid for pid in session_pids(sid) if _is_raylet(pid)), None) if sid is not None else None

    def _launch(self, i: int) -> subprocess.Popen:
        node = self.nodes[i]
        args = [
            f"--node-ip-address={LOOPBACK}",
            f"--num-cpus={node.cpus}",
            f"--num-gpus={node.gpus}",
            f"--temp-dir={node.temp_dir}",
            f"--dashboard-agent-listen-port={free_port()}",
            "--disable-usage-stats",
            "--block",  # a node's life is this process's: SIGTERM to it drains the node, then stops it
        ]
        if i == 0:
            args += ["--head", f"--port={self.port}", f"--ray-client-server-port={free_port()}"]
            if self.dashboard:
                port = self.dashboard.rsplit(":", 1)[1]
                args += ["--include-dashboard=true", f"--dashboard-host={LOOPBACK}", f"--dashboard-port={port}"]
            else:
                args += ["--include-dashboard=false"]
        else:
            args += [f"--address={self.address}"]
        # token authentication unless this environment turned it off (then its drivers join without a token too)
        auth = os.environ.get("RAY_AUTH_MODE", "token")
        env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": auth, **HEALTH_CHECKS}
        code = "from cluster.local import ray_start_on_loopback; ray_start_on_loopback()"
        with open(
            self._start_log(i), "w"
        ) as log:  # a file, not a pipe: `ray start --block` writes for as long as it runs
            proc = subprocess.Popen(
                [sys.executable, "-c", code, *args],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # the node's processes stay in this session: they are ended by it
            )
        self._procs[i] = proc
        return proc

    def _start_log(self, i: int) -> Path:
        return Path(f"{self.nodes[i].temp_dir}.start.log")

    def _started(self, i: int, proc: subprocess.Popen, timeout: float = 300.0) -> None:
        """Wait until node ``i``'s ``ray start --block`` says it runs (or fails)."""
        self.nodes[i].sid = proc.pid  # the session leader's pid is the session's id
        self.save()
        log, deadline = self._start_log(i), time.monotonic() + timeout
        while proc.poll() is None and time.monotonic() < deadline:
            if "block forever" in log.read_text(errors="replace") and self.alive(i):
                return
            time.sleep(0.5)
        tail = "\n".join(log.read_text(errors="replace").strip().splitlines()[-3:])
        raise UserError(f"node {i}: ray start failed (exit {proc.poll()}): {tail}")


def _is_raylet(pid: int) -> bool:
    try:
        return psutil.Process(pid).name() == "raylet"
    except psutil.Error:
        return False
