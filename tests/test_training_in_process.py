"""The whole product in the fast tier: the entry point trains in this process (a world of
one) with the controller, an emulated recipe, the attention monitor and checkpoints; a run
stopped at step 3 and resumed equals the uninterrupted one bit for bit; the report renders
and replay reproduces the live decisions. The slow tier runs the same under torchrun."""

import sys

import pytest

from tests.helpers import REPO, TINY, read_jsonl, trace_records, train_losses

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
