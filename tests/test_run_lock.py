"""The run lock on a cluster (issue 57): a Slurm requeue of the same job (the job id kept,
SLURM_RESTART_COUNT counting) takes over the lock its lost node left; where nothing tells
whether this job's holder lives, the launch waits for the heartbeat to go stale and says so,
and a holder whose heartbeat moves meanwhile is a live job, refused. Before: the requeue was
refused ("in use by a live job") and the job failed."""

import json
import os
import threading
import time

import pytest

from megatron_gnmr.errors import UserError
from megatron_gnmr.checkpoints import run_lock

LOST = {"host": "node-that-was-lost", "pid": 12345, "job": "4242", "attempt": 0,
        "started": "2026-12-05 10:00:00"}


def _plant(directory, holder: dict) -> None:
    (directory / run_lock.LOCK).write_text(json.dumps(holder))


@pytest.fixture
def slurm(monkeypatch):
    for name in ("SLURM_JOB_ID", "SLURM_RESTART_COUNT", "TORCHELASTIC_RUN_ID",
                 "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    return monkeypatch


def test_a_slurm_requeue_takes_over_the_lock_of_its_lost_node(tmp_path, slurm):
    _plant(tmp_path, LOST)  # written by attempt 0, before any requeue counter existed
    slurm.setenv("SLURM_RESTART_COUNT", "1")
    lock = run_lock.RunLock(str(tmp_path))
    lock.acquire()
    try:
        assert "earlier attempt of this job (requeue 0, restart 0)" in lock.taken_over
        assert json.loads((tmp_path / run_lock.LOCK).read_text())["requeue"] == 1
    finally:
        lock.release()


def test_a_later_torchrun_restart_of_an_earlier_requeue_is_still_earlier(tmp_path, slurm):
    _plant(tmp_path, {**LOST, "requeue": 0, "attempt": 3})
    slurm.setenv("SLURM_RESTART_COUNT", "1")  # requeue 1, restart 0: later than (0, 3)
    lock = run_lock.RunLock(str(tmp_path))
    lock.acquire()
    lock.release()
    assert lock.taken_over is not None


def test_where_nothing_tells_it_waits_for_the_heartbeat_then_resumes(tmp_path, slurm, capsys):
    slurm.setattr(run_lock, "STALE_S", 0.6)
    started = time.time()  # before the lock's mtime (the kernel's coarse clock: ms behind)
    _plant(tmp_path, {**LOST, "requeue": 1})  # this job, no counter moved, another host
    slurm.setenv("SLURM_RESTART_COUNT", "1")
    lock = run_lock.RunLock(str(tmp_path))
    lock.acquire()
    lock.release()
    assert time.time() - started >= 0.55 and "no heartbeat for" in lock.taken_over
    assert "waiting up to" in capsys.readouterr().out


def test_a_heartbeat_that_moves_while_waiting_is_a_live_job(tmp_path, slurm):
    slurm.setattr(run_lock, "STALE_S", 1.5)
    _plant(tmp_path, {**LOST, "requeue": 0})
    stop = threading.Event()

    def beat():  # the holder lives: its heartbeat thread touches the lock
        while not stop.wait(0.2):
            os.utime(tmp_path / run_lock.LOCK)

    beating = threading.Thread(target=beat, daemon=True)
    beating.start()
    try:
        with pytest.raises(UserError, match="in use by a live job"):
            run_lock.RunLock(str(tmp_path)).acquire()
    finally:
        stop.set()
        beating.join()


def test_another_jobs_live_lock_is_refused_at_once(tmp_path, slurm):
    _plant(tmp_path, {**LOST, "job": "777"})
    started = time.time()
    with pytest.raises(UserError, match="job 777"):
        run_lock.RunLock(str(tmp_path)).acquire()
    assert time.time() - started < 5
