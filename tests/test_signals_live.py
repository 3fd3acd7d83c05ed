"""Risk signals in real runs: a signal-driven live run is reproduced by replay from its
trace, and the qerr probe sums are the same with the batch split over 2 data-parallel ranks
(one all-reduce over the world) as in one process."""

import numpy as np

from megatron_gnmr.controller.config import GNMRConfig
from megatron_gnmr.controller.signals import Observations
from megatron_gnmr.controller.signals.monitor import MonitorSignal
from megatron_gnmr.controller.replay import replay
from megatron_gnmr.controller.trace import read_trace
from tests.helpers import TINY, read_jsonl, run_pretrain, trace_records

STEPS = 24
SIGNAL_RUN = [*TINY, "--train-iters", str(STEPS), "--eval-interval", "100",
              "--precision-recipe", "act-quant", "--act-quant-bits", "3", "--gnmr",
              "--gnmr-warmup", "5", "--gnmr-delta", "4", "--gnmr-max-o", "2",
              "--gnmr-budget-rate", "0.25", "--gnmr-measure", "oracle"]


def test_live_qerr_and_random_decisions_replay_exactly(tmp_path):
    run_pretrain([*SIGNAL_RUN, "--gnmr-signals", "qerr,random", "--gnmr-qerr-baseline",
                  "peers", "--save", str(tmp_path)])
    trace = read_trace(str(tmp_path / "gnmr_trace.jsonl"))
    assert set(trace.measured) == {"qerr", "oracle"}
    assert np.isfinite(trace.measured["qerr"]).all() and (trace.measured["qerr"] > 0).all()
    config = GNMRConfig(**{k: v for k, v in trace.config.items()})
    result = replay(trace, config)
    assert result.decisions == trace.recovery and any(trace.recovery)
    # 8 units x 0.25 = 2 tokens per step, capped at max_o 2: after warm-up every step
    # recovers 2 units (random makes every unit a candidate)
    assert all(len(d) == 2 for d in trace.recovery[5:])
    gnmr_only = replay(trace, config, signal_settings={"signals": "gnmr"})
    assert gnmr_only.decisions != trace.recovery


def test_qerr_sums_agree_between_one_and_two_data_parallel_ranks(tmp_path):
    flags = [*SIGNAL_RUN, "--train-iters", "6", "--gnmr-signals", "qerr",
             "--gnmr-agreement-interval", "1"]
    run_pretrain([*flags, "--save", str(tmp_path / "dp1")])
    run_pretrain([*flags, "--save", str(tmp_path / "dp2")], nproc=2)
    one, two = (read_trace(str(tmp_path / d / "gnmr_trace.jsonl")) for d in ("dp1", "dp2"))
    # the same micro-batches (4 sequences each) are quantized per tensor in both layouts
    np.testing.assert_allclose(two.measured["qerr"][:3], one.measured["qerr"][:3], rtol=1e-5)
    np.testing.assert_allclose(two.measured["oracle"][:3], one.measured["oracle"][:3],
                               rtol=1e-4)
    np.testing.assert_allclose(two.norms[:3], one.norms[:3], rtol=1e-5)
    assert [r["recovery"] for r in trace_records(tmp_path / "dp2")][:3] == \
        [list(d) for d in one.recovery[:3]]


def test_probes_are_silent_during_evaluation(tmp_path):
    """Two runs that differ only in how often they evaluate trace the same qerr: the
    evaluation's forward passes (and the initial validation before step 1) do not enter the
    probes' sums of the next training step."""
    flags = [*SIGNAL_RUN, "--train-iters", "6", "--gnmr-signals", "gnmr", "--gnmr-measure",
             "qerr"]
    run_pretrain([*flags, "--eval-interval", "1", "--save", str(tmp_path / "often")])
    run_pretrain([*flags, "--eval-interval", "100", "--save", str(tmp_path / "rarely")])
    often, rarely = (read_trace(str(tmp_path / d / "gnmr_trace.jsonl"))
                     for d in ("often", "rarely"))
    assert np.array_equal(often.norms, rarely.norms)  # the same training
    assert np.array_equal(often.measured["qerr"], rarely.measured["qerr"])


def test_monitor_alarms_make_their_layer_risky(tmp_path):
    """An attention alarm of layer l at step s makes layer l's attention units risky in the
    decision of step s itself (the plan of step s + 1: the monitors check before the
    controller decides)."""
    run_pretrain([*TINY, "--train-iters", "30", "--eval-interval", "100", "--monitors",
                  "attention", "--monitor-interval", "1", "--monitor-delta", "1",
                  "--monitor-patience", "2", "--monitor-band", "0.5", "--monitor-trend-window",
                  "4", "--monitor-trend-horizon", "2", "--gnmr", "--gnmr-signals", "monitor",
                  "--gnmr-delta", "1", "--gnmr-warmup", "2", "--save", str(tmp_path)])
    trace = read_trace(str(tmp_path / "gnmr_trace.jsonl"))
    alarms = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if r.get("event") == "alarm"]
    assert alarms
    first = alarms[0]
    row = trace.steps.index(first["step"])
    layer_units = [i for i, name in enumerate(trace.units)
                   if name.startswith(f"layers.{first['layer']}.self_attention.")]
    assert f"layers.{first['layer']}.self_attention." in trace.alarmed[row]
    scores = MonitorSignal(trace.units, trace.signal_settings).scores(
        Observations(alarmed=trace.alarmed[row]))
    assert all(scores[u] == 2.0 for u in layer_units)
    assert set(layer_units) <= set(trace.recovery[row])
    mlp_units = [i for i, name in enumerate(trace.units) if ".mlp." in name]
    assert all(scores[u] == 0.0 for u in mlp_units)
