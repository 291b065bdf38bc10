"""Elastic runs without Ray: the config's checks, what every rank decides after a step (a leaving node, a
checkpoint due by time), and the account of a restart (the worker count logged, the line, the tag with the steps
replayed and the seconds lost)."""

from __future__ import annotations

import os
import signal
import time

import pytest
from multiproc import run_workers

from dmltrain.training import elastic


class _Method:
    def __init__(self, fn):
        self.remote = fn


class _Board:
    """The driver's board as the workers call it (``board.<method>.remote(...)``), its answers plain values."""

    def __init__(self, previous=None, number=0):
        self.answer, self.reached_steps, self.events = (previous, number), [], []
        self.restarted = _Method(lambda: self.answer)
        self.reach = _Method(lambda step, world, at: self.reached_steps.append((step, world)))
        self.event = _Method(self.events.append)


class _Logger:
    def __init__(self):
        self.metrics, self.tags = [], {}

    def log_metrics(self, metrics, step=0, *, again=False):
        self.metrics.append((dict(metrics), step, again))

    def set_tag(self, key, value):
        self.tags[key] = value


@pytest.fixture
def no_ray_get(monkeypatch):
    import ray

    monkeypatch.setattr(ray, "get", lambda value, timeout=None: value)


def test_a_first_start_logs_the_worker_count_and_nothing_else(no_ray_get):
    board, logger = _Board(), _Logger()
    restarts = elastic.Restarts(board, logger, world=3)
    restarts.started(0, None)
    assert logger.metrics == [({"cluster/workers": 3}, 0, True)] and board.events == [] and logger.tags == {}
    restarts.reached(1)
    assert board.reached_steps == [(1, 3)] and logger.tags == {}


def test_a_restart_is_accounted_once_its_replay_is_over(no_ray_get):
    t0 = time.time() - 30
    board, logger = _Board({"step": 12, "world": 3, "time": t0}, number=1), _Logger()
    restarts = elastic.Restarts(board, logger, world=2)
    restarts.started(8, saved_world=3)
    assert logger.metrics == [({"cluster/workers": 2}, 8, True)]  # logged again at a step the run may hold
    assert board.events == ["workers: 3 -> 2 workers: restarted from the checkpoint of step 8 (the previous group had "
                            "reached step 12)"]  # fmt: skip
    for step in (9, 10, 11):
        restarts.reached(step)
        assert logger.tags == {}, step
    restarts.reached(12)
    (text,) = logger.tags.values()
    assert list(logger.tags) == ["dmltrain.resize.1"]
    assert (
        text.startswith("3 -> 2 workers at step 12: resumed from step 8, first step ")
        and ", 4 steps replayed, " in text
    )
    lost = float(text.rsplit(", ", 1)[1].split(" s lost")[0])
    assert 30 <= lost < 60, text
    restarts.reached(13)
    assert len(logger.tags) == 1 and board.events[-1] == f"workers: {text}"


def test_a_restart_from_the_step_reached_replays_nothing(no_ray_get):
    board, logger = _Board({"step": 15, "world": 3, "time": time.time() - 5}, number=3), _Logger()
    restarts = elastic.Restarts(board, logger, world=2)
    restarts.started(15, saved_world=3)
    assert logger.tags == {}  # its first step is not taken yet
    restarts.reached(16)
    assert ", 0 steps replayed, " in logger.tags["dmltrain.resize.3"]


def test_the_same_worker_count_is_no_change(no_ray_get):
    """A group restarted at the size it had (a crashed worker) logs no new worker count; the restart is still told."""
    board, logger = _Board({"step": 4, "world": 2, "time": time.time()}, number=1), _Logger()
    elastic.Restarts(board, logger, world=2).started(4, saved_world=2)
    assert logger.metrics == [] and board.events


def _signals_worker(rank, world, every_s):
    import torch.distributed as dist

    signals = elastic.StepSignals(rank, world, every_s)
    first = signals.poll()
    elastic.install_sigterm_notice()  # the worker's main thread here, as under Ray Train (SigtermNotice)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGTERM)  # this process lives on: the notice is read after the next step
    dist.barrier()
    second = signals.poll()
    return first, second, signals.reason


def test_every_rank_stops_when_one_is_sent_sigterm():
    got = run_workers(_signals_worker, 2, None, timeout=120)
    assert [g[0] for g in got] == [(False, False)] * 2
    assert [g[1] for g in got] == [(True, False)] * 2, "one rank's notice is every rank's"
    assert got[1][2].startswith("its process was sent SIGTERM") and got[0][2] is None


def test_checkpoints_by_time_follow_rank_0s_clock():
    signals = elastic.StepSignals(0, 1, every_s=0.2)
    assert signals.poll() == (False, False)
    time.sleep(0.25)
    assert signals.poll() == (False, True)
    signals.checkpointed()
    assert signals.poll() == (False, False)
    assert elastic.StepSignals(0, 1, every_s=None).poll() == (False, False)


def test_an_elastic_range_is_checked_when_the_config_is_read(tmp_path, capsys):
    from cluster.launch import fixed_workers
    from dmltrain.cli import main
    from dmltrain.config import load_config
    from dmltrain.errors import UserError

    cfg = load_config(None, ["cluster.num_workers=[1,4]", "cluster.max_failures=-1", "data.batch_size=48"])
    assert cfg.cluster.elastic and list(cfg.cluster.worker_counts()) == [1, 2, 3, 4]
    assert cfg.cluster.workers_text() == "1-4 workers (elastic)" and cfg.flat()["cluster.num_workers"] == "[1, 4]"
    with pytest.raises(UserError, match=r"^cluster.num_workers: \[1, 4\] is an elastic range, for dmltrain train"):
        fixed_workers(cfg, "tune")
    # one line, exit 2, before anything starts: a range whose counts cannot split a step, a range without restarts
    for overrides, text in [
        (["cluster.num_workers=[3,4]", "cluster.max_failures=-1"], "cluster.num_workers: at 3 workers the P = 16"),
        (["cluster.num_workers=[1,2]"], "cluster.max_failures: an elastic run"),
        (["cluster.num_workers=[3,1]"], "cluster.num_workers: must be >= 1, or [min, max]"),
    ]:
        assert main(["train", "configs/demo.yaml", *overrides, f"train.output_dir={tmp_path}"]) == 2
        err = capsys.readouterr().err.strip()
        assert text in err and "\n" not in err, err


def test_rays_messages_go_to_the_runs_log_file_and_what_a_user_must_act_on_to_the_terminal_too(
    tmp_path, capfd, monkeypatch
):
    """Through Ray's loggers (``ray`` and below, as ``ray.init`` and Ray's token setup write them), not a filter of
    the output: Ray's INFO and WARNING records land in the run's log file only, ERROR in both; afterwards Ray's
    loggers are as they were."""
    import logging
    import sys

    from cluster.ray_logging import route_ray_logs

    ray_logger = logging.getLogger("ray")
    # Ray's own handler writes to the terminal (here: this test's stderr, which Ray's import, earlier, did not see)
    monkeypatch.setattr(ray_logger, "handlers", [logging.StreamHandler(sys.stderr)])
    before = ray_logger.handlers[:], ray_logger.propagate, ray_logger.level
    log_file = tmp_path / "run" / "driver.log"
    to_terminal = logging.StreamHandler(sys.stderr)  # and a handler of the driver's own on the root logger
    logging.getLogger().addHandler(to_terminal)
    try:
        with route_ray_logs(log_file) as routed:
            assert routed == log_file
            logging.getLogger("ray._private.worker").info("Connecting to existing Ray cluster at 127.0.0.1:1")
            logging.getLogger("ray._private.authentication").warning("Token authentication is enabled")
            logging.getLogger("ray.train").error("a worker group could not start")
    finally:
        logging.getLogger().removeHandler(to_terminal)
    assert (ray_logger.handlers, ray_logger.propagate, ray_logger.level) == before
    logging.getLogger("ray").info("after the run")
    text, terminal = log_file.read_text(), "".join(capfd.readouterr())
    assert "Connecting to existing Ray cluster" in text and "Token authentication is enabled" in text
    assert "Connecting" not in terminal and "Token" not in terminal
    assert "a worker group could not start" in text and "ERROR ray.train: a worker group could not start" in terminal
    assert "after the run" not in text and log_file.stat().st_mode & 0o777 == 0o600
    with route_ray_logs(None) as routed:  # a run under a URL: no local folder, nothing changes
        assert routed is None and ray_logger.handlers == before[0]


def test_runs_training_at_once_each_get_rays_messages_and_leave_rays_loggers_as_they_were(tmp_path, capfd, monkeypatch):
    """A study trains its points at once, in threads of one driver: their runs' blocks overlap and end in any order.
    Meanwhile Ray's records go to every active run's file, none to the terminal; once the last block ends Ray's
    loggers are as they were (no handler of a closed file left behind)."""
    import logging
    import sys

    from cluster.ray_logging import route_ray_logs

    ray_logger = logging.getLogger("ray")
    monkeypatch.setattr(ray_logger, "handlers", [logging.StreamHandler(sys.stderr)])
    before = ray_logger.handlers[:], ray_logger.propagate, ray_logger.level
    first, second = (route_ray_logs(tmp_path / run / "driver.log") for run in ("first", "second"))
    first.__enter__()
    second.__enter__()
    ray_logger.warning("while both train")
    first.__exit__(None, None, None)  # the run that started first ends first
    ray_logger.warning("while the second trains")
    second.__exit__(None, None, None)
    assert (ray_logger.handlers, ray_logger.propagate, ray_logger.level) == before
    ray_logger.warning("after both")
    one, two = ((tmp_path / run / "driver.log").read_text() for run in ("first", "second"))
    assert "while both train" in one and "while both train" in two
    assert "while the second trains" in two and "while the second trains" not in one
    terminal = "".join(capfd.readouterr())
    assert "while" not in terminal and "after both" in terminal


def test_the_drivers_printer_writes_to_the_stderr_it_finds_when_made(monkeypatch):
    """It is made for every run now (the workers' lines are printed without a progress line too): the ``sys.stderr``
    of the moment, not the one of the module's import, which a study's caller may have closed since."""
    import io
    import sys

    from dmltrain.training.progress import ProgressPrinter

    now = io.StringIO()
    monkeypatch.setattr(sys, "stderr", now)
    assert ProgressPrinter(None, progress=False).stream is now
