"""The torch_dist checkpoint (the default format) on real process groups: a same-layout
resume is bit for bit; a resume on another layout (TP 2 -> 1, PP 1 -> 2, DP 2 -> 1 with and
without the distributed optimizer, EP 2 -> 1) continues within a bound measured here; a real
SIGTERM saves the step and exits 0; a kill during a save keeps the previous checkpoint (a
corrupt file, crafted files and megatron-core's own loader: test_dist_checkpoint_safety.py).

The bound of a resharded resume: the resumed run's next 20 losses against the uninterrupted
run on the source layout, relative. A layout sums its partial products in another order, so
the two drift apart by float rounding; megatron-core's resharding itself is exact (the
checkpoint's tensors are the source run's). Measured here (2-core Xeon, fp32): at most 3e-6
over the 20 steps; the bound is 1e-4, and a resume that reshards wrongly (a shard put in
the wrong place: `test_a_wrong_reshard_breaks_the_bound`) is off by 3e-3, 30 times the bound.
"""

import os
import shutil
import signal
import subprocess
import time

import pytest

from tests.helpers import (
    LAUNCH_TIMEOUT_S,
    REPO,
    TINY,
    TORCHRUN,
    pretrain_in_process,
    read_growing_jsonl,
    read_jsonl,
    run_batch,
    run_pretrain,
    train_losses,
)

FIRST, MORE = 10, 20
BOUND = 1e-4
COMMON = [*TINY, "--eval-interval", "100", "--lr-warmup-iters", "2", "--save-interval", "5",
          "--gnmr", "--gnmr-delta", "2", "--gnmr-warmup", "3", "--monitors", "attention",
          "--monitor-interval", "4", "--monitor-delta", "2"]
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "0.01"]
# source layout -> target layout, all in a world of 2 but DP 2 -> 1 (a world of 1)
CASES = {
    "tp2_to_tp1": (["--tensor-model-parallel-size", "2"], []),
    "pp1_to_pp2": ([], ["--pipeline-model-parallel-size", "2"]),
    "dp2_to_dp1": ([], []),
    # the distributed optimizer's default form (DP-reshardable) follows a DP change
    "dp2_to_dp1_distopt": (["--use-distributed-optimizer"], ["--use-distributed-optimizer"]),
    # an EP change reshards the expert optimizer state through the distributed optimizer, in
    # its fully reshardable form (gathered to DP rank 0 alone here)
    "ep2_to_ep1_distopt": ([*MOE, "--expert-model-parallel-size", "2",
                            "--use-distributed-optimizer", "--dist-ckpt-optim-fully-reshardable",
                            "--distrib-optim-fully-reshardable-mem-efficient"],
                           [*MOE, "--use-distributed-optimizer"]),
    # a TP change of the distributed optimizer, fully reshardable, read fully in parallel
    "tp2_to_tp1_distopt": (["--tensor-model-parallel-size", "2", "--use-distributed-optimizer",
                            "--dist-ckpt-optim-fully-reshardable"],
                           ["--use-distributed-optimizer", "--ckpt-fully-parallel-load"]),
}

WORLD_OF_ONE = ("dp2_to_dp1", "dp2_to_dp1_distopt")
# the reshards of the distributed optimizer's state, checked against a planted misplacement
OPTIMIZER_MISPLACED = ("dp2_to_dp1_distopt", "ep2_to_ep1_distopt")


def _args(case: str, side: int, run, steps: int) -> list[str]:
    return [*COMMON, *CASES[case][side], "--train-iters", str(steps), "--save", str(run)]


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """Per case: the uninterrupted source run, and the source stopped at FIRST then resumed
    on the target layout for MORE steps."""
    root = tmp_path_factory.mktemp("reshard")
    full = FIRST + MORE
    run_batch([_args(c, 0, root / c / "straight", full) for c in CASES] +
              [[*_args(c, 0, root / c / "resumed", full), "--exit-interval", str(FIRST)]
               for c in CASES], nproc=2)
    shutil.copytree(root / "tp2_to_tp1" / "resumed", root / "tp2_to_tp1" / "misplaced")
    for case in OPTIMIZER_MISPLACED:
        shutil.copytree(root / case / "resumed", root / case / "optimizer_misplaced")

    def planted(case, defect, name):
        return {"argv": [*_args(case, 1, root / case / name, full), "--resume", "auto",
                         "--override-opt-param-scheduler"], "defect": defect}

    run_batch([[*_args(c, 1, root / c / "resumed", full), "--resume", "auto",
                "--override-opt-param-scheduler"] for c in CASES if c not in WORLD_OF_ONE]
              + [planted("tp2_to_tp1", "reshard_misplaced", "misplaced")]
              + [planted(c, "optimizer_state_misplaced", "optimizer_misplaced")
                 for c in OPTIMIZER_MISPLACED if c not in WORLD_OF_ONE], nproc=2)
    run_batch([[*_args(c, 1, root / c / "resumed", full), "--resume", "auto"]
               for c in WORLD_OF_ONE]
              + [planted(c, "optimizer_state_misplaced", "optimizer_misplaced")
                 for c in OPTIMIZER_MISPLACED if c in WORLD_OF_ONE], nproc=1)
    return root


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_resume_on_another_layout_continues_the_run(resumed, case):
    straight, again = train_losses(resumed / case / "straight"), \
        train_losses(resumed / case / "resumed")
    steps = range(FIRST + 1, FIRST + MORE + 1)
    assert [s for s in again if s > FIRST] == list(steps)
    drift = max(abs(again[s] - straight[s]) / straight[s] for s in steps)
    print(f"\n{case}: largest relative difference over the next {MORE} steps {drift:.2e}")
    assert drift < BOUND, drift
    events = [r for r in read_jsonl(resumed / case / "resumed" / "metrics.jsonl")
              if r.get("event") == "warning"]
    assert any("another layout" in e["checkpoint"] for e in events)  # said at start


def test_a_same_layout_resume_is_bit_for_bit(tmp_path):
    """TP 2 with the distributed optimizer (DP-reshardable, the default form), stopped at step
    6 and resumed: the uninterrupted run's losses and norms, bit for bit. The stopped run
    saves asynchronously (--async-save: written while training goes on), which changes
    nothing of the training and publishes complete checkpoints."""
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    tp2 = [*COMMON, "--tensor-model-parallel-size", "2", "--use-distributed-optimizer",
           "--train-iters", "12"]
    run_batch([[*tp2, "--save", str(straight)],
               [*tp2, "--exit-interval", "6", "--async-save", "--save", str(stopped)]],
              nproc=2)
    saved = [r for r in read_jsonl(stopped / "metrics.jsonl") if r.get("event") == "checkpoint"]
    assert [r["step"] for r in saved] == [5, 6] and saved[0]["loop_seconds"] < \
        saved[0]["seconds"]  # step 5's was written while step 6 trained
    # step 5's state as the writer forked it, although step 6 trained while it wrote
    from_5 = tmp_path / "from_5"
    run_batch([[*tp2, "--load", str(stopped), "--ckpt-step", "5", "--save", str(from_5)],
               [*tp2, "--resume", "auto", "--async-save", "--save", str(stopped)]], nproc=2)
    assert train_losses(stopped) == train_losses(straight)
    again = train_losses(from_5)
    assert min(again) == 6 and again == {s: v for s, v in train_losses(straight).items()
                                         if s > 5}
    trace = [r for r in read_jsonl(stopped / "gnmr_trace.jsonl") if "norms" in r]
    assert [r["norms"] for r in trace] == \
        [r["norms"] for r in read_jsonl(straight / "gnmr_trace.jsonl") if "norms" in r]
    assert (stopped / "latest_checkpointed_iteration.txt").read_text() == "12"
    assert sorted(p.name for p in stopped.glob("iter_*")) == ["iter_0000010", "iter_0000012"]


def test_a_wrong_reshard_breaks_the_bound(resumed):
    """The check can fail: the same TP 2 -> 1 resume with a planted defect (the first
    layer's fc2 weight loaded with its two TP halves swapped: what a reshard that misplaces a
    shard would give; tests/distributed/defects.py) drifts by far more than the bound."""
    straight = train_losses(resumed / "tp2_to_tp1" / "straight")
    again = train_losses(resumed / "tp2_to_tp1" / "misplaced")
    drift = max(abs(again[s] - straight[s]) / straight[s]
                for s in range(FIRST + 1, FIRST + MORE + 1))
    assert drift > 10 * BOUND, drift


def test_a_dp_reshardable_optimizer_refuses_a_tp_change_in_one_line(tmp_path, capfd):
    """Megatron-LM's default form of the distributed optimizer cannot be resharded over TP:
    the resume says so in one line naming both ways out, writes nothing, and the weights-only
    way out (--no-load-optim) resumes."""
    run = tmp_path / "run"
    source = [*COMMON, "--tensor-model-parallel-size", "2", "--use-distributed-optimizer",
              "--train-iters", "12", "--exit-interval", "6", "--save", str(run)]
    run_batch([source], nproc=2)
    before = sorted(p.name for p in run.iterdir())
    target = [*COMMON, "--use-distributed-optimizer", "--train-iters", "12", "--save", str(run),
              "--resume", "auto"]
    capfd.readouterr()
    assert pretrain_in_process(target) == 2
    error = [line for line in capfd.readouterr().err.strip().splitlines()
             if not line.startswith("notice: ")]  # the start notice is no error
    assert len(error) == 1 and "DP-reshardable" in error[0], error
    assert "--tensor-model-parallel-size" in error[0] and "--no-load-optim" in error[0]
    assert "--dist-ckpt-optim-fully-reshardable" in error[0]
    assert sorted(p.name for p in run.iterdir()) == before
    assert pretrain_in_process([*target, "--no-load-optim"]) == 0
    assert max(train_losses(run)) == 12


@pytest.mark.parametrize("case", OPTIMIZER_MISPLACED)
def test_a_misplaced_optimizer_shard_breaks_the_bound(resumed, case):
    """The check can fail for the optimizer's state too: the same DP and EP reshards with the
    largest parameter's Adam moments misplaced after the load (tests/distributed/defects.py)
    drift by far more than the bound, while the correct reshard stays within it."""
    straight = train_losses(resumed / case / "straight")
    again = train_losses(resumed / case / "optimizer_misplaced")
    drift = max(abs(again[s] - straight[s]) / straight[s]
                for s in range(FIRST + 1, FIRST + MORE + 1))
    assert drift > 10 * BOUND, drift


def test_sigterm_mid_run_saves_that_step_and_exits_zero(tmp_path):
    """A real SIGTERM to both ranks of a torchrun launch (what a scheduler's time limit
    sends): each finishes its step, the step is checkpointed, the launch exits 0 and a resume
    continues from it to the end."""
    run = tmp_path / "run"
    args = [*COMMON, "--tensor-model-parallel-size", "2", "--train-iters", "400",
            "--save", str(run)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    launch = subprocess.Popen([TORCHRUN, "--standalone", "--nproc_per_node=2",
                               str(REPO / "pretrain_llama.py"), *args], cwd=REPO, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + LAUNCH_TIMEOUT_S
    while not (run / "metrics.jsonl").is_file() or \
            not any("train/loss" in r and r["step"] >= 3 for r in read_growing_jsonl(
                run / "metrics.jsonl")):
        assert launch.poll() is None and time.monotonic() < deadline, launch.stdout.read()
        time.sleep(0.5)
    workers = _workers(launch.pid)
    assert len(workers) == 2
    for pid in workers:
        os.kill(pid, signal.SIGTERM)
    output = launch.communicate(timeout=LAUNCH_TIMEOUT_S)[0]
    assert launch.returncode == 0, output[-3000:]
    stopped_at = max(train_losses(run))
    assert stopped_at < 400
    assert (run / "latest_checkpointed_iteration.txt").read_text() == str(stopped_at)
    exits = [r for r in read_jsonl(run / "metrics.jsonl") if r.get("event") == "exit"]
    assert len(exits) == 1 and "SIGTERM" in exits[0]["reason"]
    assert not (run / "summary.json").exists()  # not finished: a job script resumes it
    run_pretrain([*args[:-4], "--train-iters", str(stopped_at + 3), "--save", str(run),
                  "--resume", "auto", "--override-opt-param-scheduler"], nproc=2)
    assert max(train_losses(run)) == stopped_at + 3


def _workers(launcher: int) -> list[int]:
    """The training processes a torchrun launch started (its children running the entry
    point; not their own helper processes)."""
    children = subprocess.run(["pgrep", "-P", str(launcher)], capture_output=True,
                              text=True).stdout.split()
    return [int(pid) for pid in children
            if "pretrain_llama.py" in open(f"/proc/{pid}/cmdline").read()]


@pytest.mark.parametrize("how", ["sync", "async"])
def test_kill_during_a_save_keeps_the_previous_checkpoint(tmp_path, how):
    """A rank killed while step 4's checkpoint is being written (synchronously, or by the
    async writer while training goes on): step 2's stays the published one, step 4's is
    never visible, and the resume continues from 2."""
    run = tmp_path / "run"
    args = [*COMMON, "--tensor-model-parallel-size", "2", "--train-iters", "12",
            "--save-interval", "2", "--save", str(run),
            *(["--async-save"] if how == "async" else [])]
    result = run_pretrain(args, nproc=2, check=False,
                          extra_env={"GNMR_TEST_SIGKILL": "4:1:save"})
    assert result.returncode != 0
    assert (run / "latest_checkpointed_iteration.txt").read_text() == "2"
    assert (run / "iter_0000004.tmp").exists() and not (run / "iter_0000004").exists()
    run_pretrain([*args, "--resume", "auto"], nproc=2)
    events = [r for r in read_jsonl(run / "metrics.jsonl") if r.get("event") == "resumed"]
    assert events[-1]["path"].endswith("iter_0000002") and max(train_losses(run)) == 12
