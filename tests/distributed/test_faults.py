"""Faults survived: NaN gradients, SIGKILLed ranks, a kill during a checkpoint write, and
ranks that disagree. Real signals on real processes (torchrun, 2 processes)."""

import json

import pytest
import torch

from tests.helpers import TINY, read_jsonl, run_pretrain, trace_records, train_losses

STEPS = 12
# The per-rank format, whose files these tests read (the default torch_dist's faults:
# tests/distributed/test_dist_checkpoint.py)
GNMR = ["--gnmr", "--gnmr-delta", "2", "--gnmr-warmup", "3", "--gnmr-max-o", "2",
        "--gnmr-alpha", "1.2", "--gnmr-beta", "1.1", "--ckpt-format", "torch"]
TP2 = [*TINY, *GNMR, "--train-iters", str(STEPS), "--eval-interval", "100",
       "--tensor-model-parallel-size", "2", "--save-interval", "2", "--keep-last", "3",
       "--resume", "auto"]
UNIT = "layers.1.mlp.linear_fc2"


def _weights(checkpoint_dir):
    return torch.load(checkpoint_dir / "rank_00000.pt", weights_only=False)["model"][0]


def test_nonfinite_gradient_is_skipped_reported_and_recovered(tmp_path):
    run_pretrain([*TINY, *GNMR, "--train-iters", "6", "--eval-interval", "100",
                  "--save-interval", "1", "--keep-last", "10", "--inject-nonfinite", f"4:{UNIT}",
                  "--save", str(tmp_path)])
    records = read_jsonl(tmp_path / "metrics.jsonl")
    events = [r for r in records if r.get("event") == "nonfinite_gradient"]
    assert [(e["step"], e["units"]) for e in events] == [(4, [UNIT])]
    assert [r["train/skipped"] for r in records if "train/skipped" in r] == [0, 0, 0, 1, 0, 0]
    # skipped: the weights after step 4 are the weights after step 3
    before = _weights(tmp_path / "checkpoints" / "iter_0000003")
    after = _weights(tmp_path / "checkpoints" / "iter_0000004")
    assert all(torch.equal(before[k], after[k]) for k in before if torch.is_tensor(before[k]))
    trace = trace_records(tmp_path)
    unit = json.loads((tmp_path / "gnmr_trace.jsonl").read_text().splitlines()[0])["units"]
    index = unit.index(UNIT)
    assert trace[3]["norms"][index] is None  # recorded as non-finite ...
    assert index in trace[3]["recovery"]  # ... and the unit recovers in step 5
    # the history was not poisoned: later norms are finite and scored normally
    assert all(r["norms"][index] is not None for r in trace[4:])


def test_raise_stops_with_a_kept_checkpoint_that_resumes(tmp_path):
    result = run_pretrain([*TINY, *GNMR, "--train-iters", "6", "--eval-interval", "100",
                           "--gnmr-nonfinite", "raise", "--inject-nonfinite", f"4:{UNIT}",
                           "--save", str(tmp_path)], check=False, new_process=True)
    assert result.returncode == 3
    stopped = [line for line in result.stderr.splitlines() if line.startswith("stopped:")]
    assert len(stopped) == 1 and "step 4" in stopped[0] and UNIT in stopped[0]
    assert "Traceback" not in result.stderr
    assert (tmp_path / "checkpoints" / "latest").read_text() == "iter_0000003"
    run_pretrain([*TINY, *GNMR, "--train-iters", "6", "--eval-interval", "100",
                  "--resume", "auto", "--save", str(tmp_path)])
    assert max(train_losses(tmp_path)) == 6


def test_consecutive_nonfinite_steps_stop_the_run(tmp_path):
    injections = ",".join(f"{s}:{UNIT}" for s in (3, 4, 5))
    result = run_pretrain([*TINY, *GNMR, "--train-iters", "8", "--eval-interval", "100",
                           "--inject-nonfinite", injections, "--gnmr-max-nonfinite-steps", "3",
                           "--save", str(tmp_path)], check=False)
    assert result.returncode == 3
    assert "3 consecutive steps with non-finite gradients" in result.stderr


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("uninterrupted")
    run_pretrain([*TP2, "--save", str(run_dir)], nproc=2)
    return train_losses(run_dir)


def test_sigkilled_rank_restarts_from_checkpoint_and_finishes_identically(uninterrupted,
                                                                          tmp_path):
    run_pretrain([*TP2, "--save", str(tmp_path)], nproc=2, torchrun_args=["--max-restarts=1"],
                 extra_env={"GNMR_TEST_SIGKILL": "7:1"})
    events = [r["event"] for r in read_jsonl(tmp_path / "metrics.jsonl") if "event" in r]
    assert "resumed" in events  # the restart picked up checkpoint 6
    assert train_losses(tmp_path)[STEPS] == uninterrupted[STEPS]
    kept = sorted(p.name for p in (tmp_path / "checkpoints").glob("iter_*"))
    assert kept == ["iter_0000008", "iter_0000010", "iter_0000012"]  # --keep-last 3


def test_kill_during_checkpoint_write_keeps_the_previous_one(uninterrupted, tmp_path):
    result = run_pretrain([*TP2, "--save", str(tmp_path)], nproc=2, check=False,
                          extra_env={"GNMR_TEST_SIGKILL": "4:1:save"})
    assert result.returncode != 0
    root = tmp_path / "checkpoints"
    assert (root / "latest").read_text() == "iter_0000002"
    assert (root / "iter_0000004.tmp").exists() and not (root / "iter_0000004").exists()
    run_pretrain([*TP2, "--save", str(tmp_path)], nproc=2)  # --resume auto: from step 2
    assert train_losses(tmp_path)[STEPS] == uninterrupted[STEPS]


def test_ranks_that_disagree_stop_the_run_naming_step_and_ranks(tmp_path):
    result = run_pretrain([*TP2, "--gnmr-agreement-interval", "1", "--save", str(tmp_path)],
                          nproc=2, check=False,
                          extra_env={"GNMR_TEST_CORRUPT_CONTROLLER": "5:1"})
    assert result.returncode != 0
    assert "step 5: ranks disagree on the controller state: ranks [0] vs ranks [1]" in \
        result.stderr
