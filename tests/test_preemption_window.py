"""A preemption's save fits its window (issue 57 item 2): torchrun's agent SIGKILLs the
workers 30 s after it passes SIGTERM on, so the save a stop triggers publishes before it
hashes, and it does not wait for an async save in flight, which it supersedes.

In-process (a world of one), the stop being a real SIGTERM to this process during a chosen
step. A SIGKILL while the files are hashed is played by a hash that raises: the checkpoint
must already be the newest, with its sizes, and a resume must load it and say that its
hashes were never written. A writer made to hang on the async save in flight must not hold
the stop up: it is ended, its checkpoint never appears, the stop's own does."""

import hashlib
import json
import os
import signal
import time

import psutil
import pytest
from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

from megatron_gnmr.training.loop import Trainer
from megatron_gnmr.checkpoints.torch_dist import files
from tests.helpers import TINY, pretrain_in_process, read_jsonl, train_losses

RUN = [*TINY, "--eval-interval", "100", "--lr-warmup-iters", "1", "--keep-last", "3"]
HANG_S = 600  # the async writer's hang: far longer than the stop may take, even on a busy CPU


class SigkillWhileHashing(Exception):
    pass


def _sigterm_during_step(monkeypatch, stop_step: int, once=None) -> None:
    """SIGTERM to this process while optimizer step `stop_step` trains (the handler the run
    installed notes it; the step's end agrees to stop), once `once()` is true if given: a
    forked writer reaches its files when the CPU lets it, not by the next step."""
    real = Trainer.train_step

    def train_step(trainer, step):
        if step + 1 == stop_step:
            waited_until = time.monotonic() + HANG_S / 2
            while once is not None and not once() and time.monotonic() < waited_until:
                time.sleep(0.05)
            os.kill(os.getpid(), signal.SIGTERM)
        return real(trainer, step)

    monkeypatch.setattr(Trainer, "train_step", train_step)


def test_the_stop_publishes_before_hashing_and_a_resume_says_so(tmp_path, monkeypatch):
    run = tmp_path / "run"
    _sigterm_during_step(monkeypatch, 2)

    def sigkill(path):
        raise SigkillWhileHashing(str(path))

    monkeypatch.setattr(files, "_sha256", sigkill)
    with pytest.raises(SigkillWhileHashing):
        pretrain_in_process([*RUN, "--train-iters", "20", "--save", str(run)])
    monkeypatch.undo()
    # the stop's checkpoint is the newest, described by its sizes, its hashes pending
    assert (run / "latest_checkpointed_iteration.txt").read_text() == "2"
    directory = run / "iter_0000002"
    manifest = json.loads((directory / "megatron_gnmr.json").read_text())
    assert manifest["sha256_pending"] is True
    on_disk = {p.name: p.stat().st_size for p in directory.iterdir()
               if p.name != "megatron_gnmr.json"}
    assert {name: record["size"] for name, record in manifest["files"].items()} == on_disk
    assert not any("sha256" in record for record in manifest["files"].values())
    # the resume loads it and says so; its own (unhurried) checkpoint is hashed first
    assert pretrain_in_process([*RUN, "--train-iters", "4", "--save", str(run),
                                "--resume", "auto", "--override-opt-param-scheduler"]) == 0
    records = read_jsonl(run / "metrics.jsonl")
    warnings = [r["checkpoint"] for r in records if r.get("event") == "warning"]
    assert any(str(directory) in w and "hashed" in w for w in warnings), warnings
    resumed = [r for r in records if r.get("event") == "resumed"]
    assert resumed[-1]["path"] == str(directory) and max(train_losses(run)) == 4
    final = json.loads((run / "iter_0000004" / "megatron_gnmr.json").read_text())
    assert "sha256_pending" not in final


def test_the_stop_does_not_wait_for_the_async_save_in_flight(tmp_path, monkeypatch):
    run = tmp_path / "run"
    hung, woke = tmp_path / "hung_writers", tmp_path / "a_hung_writer_woke"
    real = FileSystemWriterAsync.write_preloaded_data

    def hang_on_step_1(*args, **kwargs):  # in the writer's per-file processes
        if "iter_0000001.tmp" in str(kwargs["write_bucket"][0]):
            with open(hung, "a") as file:
                file.write(f"{os.getpid()}\n")
            time.sleep(HANG_S)
            woke.touch()  # only if nobody ended it: a stop that waited for it
        return real(*args, **kwargs)

    monkeypatch.setattr(FileSystemWriterAsync, "write_preloaded_data",
                        staticmethod(hang_on_step_1))
    _sigterm_during_step(monkeypatch, 2, once=hung.is_file)  # the writer of step 1 hangs
    assert pretrain_in_process([*RUN, "--train-iters", "20", "--async-save",
                                "--save-interval", "1", "--save", str(run)]) == 0
    assert hung.is_file() and not woke.exists()  # the stop did not wait for the hung writer
    assert (run / "latest_checkpointed_iteration.txt").read_text() == "2"
    assert sorted(p.name for p in run.glob("iter_*")) == ["iter_0000002"]  # 1's never appears
    records = read_jsonl(run / "metrics.jsonl")
    abandoned = [r for r in records if r.get("event") == "checkpoint_abandoned"]
    assert [r["path"] for r in abandoned] == [str(run / "iter_0000001.tmp")]
    for pid in map(int, hung.read_text().split()):  # the hung processes were ended
        assert not psutil.pid_exists(pid) or \
            psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, pid
    directory = run / "iter_0000002"
    manifest = json.loads((directory / "megatron_gnmr.json").read_text())
    assert manifest.get("hashed_after_publication") is True
    for name, record in manifest["files"].items():  # hashlib over the published bytes
        assert record["sha256"] == hashlib.sha256((directory / name).read_bytes()).hexdigest()
