"""A run stopped at step N and resumed continues exactly like the uninterrupted run."""

from tests.helpers import TINY, read_jsonl, run_pretrain, trace_records, train_losses

N = 6
GNMR = ["--gnmr", "--gnmr-delta", "2", "--gnmr-warmup", "3", "--gnmr-max-o", "2",
        "--gnmr-alpha", "1.2", "--gnmr-beta", "1.1"]


def test_stop_at_n_and_resume_matches_uninterrupted_tp2(tmp_path):
    common = [*TINY, "--train-iters", str(2 * N), "--eval-interval", "100", *GNMR,
              "--tensor-model-parallel-size", "2", "--monitors", "attention",
              "--monitor-interval", "4", "--monitor-delta", "2",
              "--monitor-baseline-samples", "2"]
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    run_pretrain([*common, "--save", str(straight)], nproc=2)
    run_pretrain([*common, "--save", str(stopped), "--exit-interval", str(N)], nproc=2)
    assert max(train_losses(stopped)) == N
    run_pretrain([*common, "--save", str(stopped), "--resume", "auto"], nproc=2)

    expected, got = train_losses(straight), train_losses(stopped)
    # Bit-for-bit on CPU: model, optimizer, scheduler, RNG, data position and controller.
    assert [got[s] for s in range(1, 2 * N + 1)] == [expected[s] for s in range(1, 2 * N + 1)]
    assert [r["recovery"] for r in trace_records(stopped)] == \
        [r["recovery"] for r in trace_records(straight)]
    events = [r["event"] for r in read_jsonl(stopped / "metrics.jsonl") if "event" in r]
    assert "resumed" in events
    # monitor state (snapshot taken at step 6, alarm baselines) survived the stop
    def monitors(run):
        return {(r["step"], k): v for r in read_jsonl(run / "metrics.jsonl") for k, v in r.items()
                if k.startswith("monitor/")}
    resumed, expected_monitors = monitors(stopped), monitors(straight)
    assert (8, "monitor/attention/layer0/H_D2_mean") in resumed
    assert resumed == expected_monitors


def test_distributed_optimizer_shards_resume_exactly(tmp_path):
    """The distributed optimizer keeps Adam's moments and (bf16) the fp32 main weights in
    per-rank shards that megatron's state_dict() leaves out; each rank saves its own, and a
    resumed run continues bit for bit, with both overlaps on."""
    common = [*TINY, "--train-iters", str(2 * N), "--eval-interval", "100", *GNMR, "--bf16",
              "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
              "--micro-batch-size", "2"]
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    run_pretrain([*common, "--save", str(straight)], nproc=2)
    run_pretrain([*common, "--save", str(stopped), "--exit-interval", str(N)], nproc=2)
    run_pretrain([*common, "--save", str(stopped), "--resume", "auto"], nproc=2)
    expected, got = train_losses(straight), train_losses(stopped)
    assert [got[s] for s in range(1, 2 * N + 1)] == [expected[s] for s in range(1, 2 * N + 1)]
    assert expected[2 * N] < expected[1]
