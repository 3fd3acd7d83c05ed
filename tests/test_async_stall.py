"""An async save's stall on the training loop is counted whole, and its hashing is not part of
it (issue 57 item 3).

The publication of an async save (megatron's finalize, the manifest, the rename, the tracker)
runs on the training thread at a later step. Made slow on purpose by a known delay, it must
show up in the checkpoint's `loop_seconds` and in the `train/step_time_s` of the step it
stalled; the sha256 of the files the writer wrote must be computed by the writer process, not
the training process, and agree with hashlib's over the published bytes."""

import hashlib
import json
import os
import time

from megatron_gnmr.checkpoints.torch_dist import files
from megatron_gnmr.checkpoints.torch_dist.async_save import AsyncSaves
from tests.helpers import TINY, pretrain_in_process, read_jsonl

RUN = [*TINY, "--eval-interval", "100", "--lr-warmup-iters", "1", "--train-iters", "6",
       "--save-interval", "2", "--keep-last", "3", "--async-save"]
DELAY_S = 1.0  # per durable write; a publication makes two (the manifest, the tracker)


def test_a_slow_publication_is_in_the_loop_stall_and_the_step_time(tmp_path, monkeypatch):
    real = files.write_durably

    def slow(path, text):
        time.sleep(DELAY_S)
        real(path, text)

    monkeypatch.setattr(files, "write_durably", slow)
    # how long the writer takes varies with the machine's load, and a tiny model's steps take
    # milliseconds: unless the first poll after a save waits for the writer, the publication
    # may fall in no step at all (the next save waits for it, outside step times)
    monkeypatch.setattr(AsyncSaves, "poll", AsyncSaves.wait)
    run = tmp_path / "run"
    interval = 3  # async saves at 3 and 6; 9 is the run's last, synchronous
    assert pretrain_in_process([*RUN, "--save", str(run), "--train-iters", "9",
                                "--save-interval", str(interval)]) == 0
    records = read_jsonl(run / "metrics.jsonl")
    saves = [r for r in records if r.get("event") == "checkpoint" and r["step"] < 9]
    assert [r["step"] for r in saves] == [3, 6]
    steps = [r for r in records if "train/step_time_s" in r]
    for saved in saves:
        assert saved["loop_seconds"] >= 2 * DELAY_S, saved
        # published in the step after the save, and logged before that step's record
        after = next(r for r in steps if r["time"] >= saved["time"])
        assert after["step"] == saved["step"] + 1, (saved, after)
        assert after["train/step_time_s"] >= 2 * DELAY_S, (saved, after)


def test_the_writer_hashes_its_files_off_the_training_thread(tmp_path, monkeypatch):
    log = tmp_path / "hashed_by.jsonl"
    real = files._sha256

    def recorded(path):
        with open(log, "a") as file:
            file.write(json.dumps({"pid": os.getpid(), "file": f"{path.parent.name}/"
                                   f"{path.name}"}) + "\n")
        return real(path)

    monkeypatch.setattr(files, "_sha256", recorded)
    run = tmp_path / "run"
    assert pretrain_in_process([*RUN, "--save", str(run)]) == 0
    hashed_by = {}
    for record in read_jsonl(log):
        hashed_by.setdefault(record["file"], set()).add(record["pid"])
    for step in (2, 4):
        directory = run / f"iter_{step:07d}"
        manifest = json.loads((directory / "megatron_gnmr.json").read_text())
        shards = [name for name in manifest["files"] if name.endswith(".distcp")]
        assert shards
        for name in shards:  # hashed in the staging directory, by another process
            assert os.getpid() not in hashed_by[f"{directory.name}.tmp/{name}"], name
        for name, record in manifest["files"].items():  # hashlib over the published bytes
            assert record["sha256"] == hashlib.sha256((directory / name).read_bytes()).hexdigest()
        # nothing else published: the writer's notes of its hashes are gone
        assert sorted(p.name for p in directory.iterdir()) == \
            sorted([*manifest["files"], "megatron_gnmr.json"])
