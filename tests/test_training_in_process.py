"""The whole product in the fast tier: the entry point trains in this process (a world of
one) with the controller, an emulated recipe, the attention monitor and checkpoints; a run
stopped at step 3 and resumed equals the uninterrupted one bit for bit; the report renders
and replay reproduces the live decisions. The slow tier runs the same under torchrun."""

import sys

import pytest

from tests.helpers import (
    REPO,
    TINY,
    pretrain_in_process,
    read_jsonl,
    trace_records,
    train_losses,
)

RUN = [*TINY, "--train-iters", "6", "--lr-warmup-iters", "1", "--eval-interval", "3",
       "--precision-recipe", "fp8-emulated", "--gnmr", "--gnmr-delta", "1",
       "--gnmr-warmup", "2", "--gnmr-alpha", "1.05", "--gnmr-beta", "1.05", "--gnmr-max-o", "2",
       "--gnmr-agreement-interval", "1", "--monitors", "attention", "--monitor-interval", "2",
       "--monitor-delta", "1", "--image-interval", "0"]


def pretrain(args: list[str]) -> dict:
    sys.path.insert(0, str(REPO))
    try:
        from pretrain_llama import main
    finally:
        sys.path.remove(str(REPO))
    return main(args)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("in_process")
    pretrain([*RUN, "--save", str(root / "straight")])
    pretrain([*RUN, "--exit-interval", "3", "--save", str(root / "stopped")])
    pretrain([*RUN, "--resume", "auto", "--save", str(root / "stopped")])
    return root


def test_a_resumed_run_equals_the_uninterrupted_one(runs):
    straight, stopped = train_losses(runs / "straight"), train_losses(runs / "stopped")
    assert sorted(stopped) == list(range(1, 7)) and stopped == straight
    assert [r["recovery"] for r in trace_records(runs / "stopped")] == \
        [r["recovery"] for r in trace_records(runs / "straight")]
    assert any(r["recovery"] for r in trace_records(runs / "straight"))
    monitors = [{k: v for k, v in r.items() if k.startswith("monitor/")}
                for r in read_jsonl(runs / "straight" / "metrics.jsonl")]
    assert any(monitors)
    events = [r["event"] for r in read_jsonl(runs / "stopped" / "metrics.jsonl") if "event" in r]
    assert events.count("resumed") == 1 and events.count("summary") == 2  # one per launch


def test_report_and_replay_of_the_run(runs):
    from argparse import Namespace

    from megatron_gnmr.controller.config import GNMRConfig
    from megatron_gnmr.controller.replay import replay
    from megatron_gnmr.controller.trace import read_trace
    from megatron_gnmr.observe import report

    out = report.run(Namespace(runs=[str(runs / "straight"), str(runs / "stopped")], out=None))
    assert out.stat().st_size > 10_000
    trace = read_trace(str(runs / "straight" / "gnmr_trace.jsonl"))
    config = GNMRConfig(**{k: v for k, v in trace.config.items()
                           if k in GNMRConfig.__dataclass_fields__})
    result = replay(trace, config)
    assert result.matches_recorded == len(trace.steps) == 6


def test_the_logged_params_norm_and_zero_gradients_against_float64(tmp_path, monkeypatch):
    """--log-params-norm is the L2 norm of every parameter after the step (float64 over the
    model's own tensors), --log-num-zeros-in-grad the gradient elements that are exactly zero,
    counted here over the model's gradients (thousands: the embedding rows of the tokens no
    sample of the step holds)."""
    import math

    import torch

    from megatron_gnmr.training import loop

    seen = {}
    original = loop.Trainer.train_step

    def recording(self, step):
        metrics = original(self, step)
        seen[step + 1] = (metrics, math.sqrt(sum(float(p.detach().double().square().sum())
                                                for chunk in self.model
                                                for p in chunk.parameters())),
                          sum(int((p.main_grad if hasattr(p, "main_grad") else p.grad)
                                  .eq(0).sum()) for chunk in self.model
                              for p in chunk.parameters()))
        return metrics

    monkeypatch.setattr(loop.Trainer, "train_step", recording)
    run = tmp_path / "run"
    assert pretrain_in_process([*TINY, "--train-iters", "3", "--eval-interval", "3",
                                "--log-params-norm", "--log-num-zeros-in-grad",
                                "--save", str(run)]) == 0
    for step, (metrics, norm, zeros) in seen.items():
        assert metrics["train/params_norm"] == pytest.approx(norm, rel=1e-6)
        assert metrics["train/num_zeros_in_grad"] == zeros
    assert torch.tensor([m["train/params_norm"] for m, _, _ in seen.values()]).unique().numel() \
        == 3  # it moves with the weights
    assert all(zeros > 1000 for _, _, zeros in seen.values())
