"""The detection study (issue 48): the sequential test against a hand computation, the onset of
harm by hand, the per-seed fault placement, and the first alarm computed from a twin's trace
against the first recovery of a live run with that detector (same step, same layer)."""

import math

import numpy as np
import pytest
import torch

from megatron_gnmr.controller.signals import Observations, build_signals
from megatron_gnmr.controller.signals.base import Hold
from megatron_gnmr.experiments import detection_traces
from megatron_gnmr.experiments.detection import harm_onset
from megatron_gnmr.experiments.detectors import Setting, first_alarm
from megatron_gnmr.precision.attention_fault import FaultRounding, FaultSchedule, fault_layers
from megatron_gnmr.precision.attention_unit import AttentionRuntime
from megatron_gnmr.precision.flash_attention import AttentionPath, FlashAttentionFunction
from megatron_gnmr.precision.measurements import values
from megatron_gnmr.precision.plan import PrecisionPlan
from megatron_gnmr.precision.probes import ProbeBank
from tests.helpers import TINY, read_jsonl, run_pretrain, trace_records

UNITS = ["layers.0.self_attention.core_attention", "layers.1.self_attention.core_attention"]


def test_cusum_against_a_hand_computation():
    """Drift k = 0.1, level h = 0.5 on a made-up sequence of sign agreements, by hand:
    unit 0: b = 0.3, 0.3, -0.2, 0.4, 0.05
      S+ = 0.2, 0.4, 0.1, 0.4, 0.35           S- = 0, 0, 0.1, 0, 0
      score = max / 0.5 = 0.4, 0.8, 0.2, 0.8, 0.7: never above 1
    unit 1: b = -0.4, -0.35, NaN, 0.1, 0.0
      S- = 0.3, 0.55 (alarm: 1.1), 0.55 (NaN leaves it), 0.35, 0.25
      score = 0.6, 1.1, 1.1, then held at its breach (hold -1): 1.1, 1.1."""
    signal = build_signals(("attention_bias",), UNITS, {
        "attention_bias_drift": 0.1, "attention_bias_threshold": 0.5,
        "attention_bias_hold": -1})[0]
    sequence = [(0.3, -0.4), (0.3, -0.35), (-0.2, math.nan), (0.4, 0.1), (0.05, 0.0)]
    got = [signal.scores(Observations({"attention_bias": np.array(b)})) for b in sequence]
    np.testing.assert_allclose([g[0] for g in got], [0.4, 0.8, 0.2, 0.8, 0.7], atol=1e-12)
    np.testing.assert_allclose([g[1] for g in got], [0.6, 1.1, 1.1, 1.1, 1.1], atol=1e-12)


def test_hold_keeps_a_unit_for_its_decisions_then_lets_it_go():
    hold = Hold(1, 2)
    scores = [hold(np.array([s]))[0] for s in (0.5, 3.0, 0.2, 0.1, 0.4, 0.9)]
    assert scores == [0.5, 3.0, 3.0, 3.0, 0.4, 0.9]  # two decisions after the breach


def test_the_bias_measurements_against_float64():
    """The delta error's sign agreement sum(e) / sum|e| (e = rowsum(dO * (O_held - O))) and
    O's rounding sign agreement, against a float64 computation of the same rounding; O's
    rounding toward -inf agrees in every element (-1)."""
    torch.manual_seed(3)
    q, k, v, grad_out = (torch.randn(2, 2, 12, 8) for _ in range(4))
    low = AttentionPath(fault=FaultRounding(1))
    bank = ProbeBank(UNITS, None, ("attention_bias", "rounding_bias"))
    FlashAttentionFunction.apply(q.clone().requires_grad_(), k, v, 0.3, low, None,
                                 bank.probe(UNITS[0]), low).backward(grad_out)
    measured = values(("attention_bias", "rounding_bias"), bank.take().reshape(2, -1).numpy())
    q64, k64, v64, g64 = (t.double() for t in (q, k, v, grad_out))
    scores = (q64 @ k64.transpose(-1, -2)) * 0.3
    causal = torch.ones(12, 12, dtype=torch.bool).triu(1)
    out = torch.softmax(scores.masked_fill(causal, float("-inf")), -1) @ v64
    mantissa, exponent = torch.frexp(out)
    held = torch.ldexp(torch.floor(mantissa * 4) / 4, exponent)
    error = (g64 * (held - out)).sum(-1)
    assert measured["attention_bias"][0] == pytest.approx(
        (error.sum() / error.abs().sum()).item(), abs=1e-5)
    assert measured["rounding_bias"][0] == pytest.approx(-1.0, abs=1e-12)
    assert np.isnan(measured["attention_bias"][1])  # the other unit never ran


def test_harm_onset_by_hand():
    """Differences 0 for 150 steps, then 0.1: the 100-step running mean ending at step t is
    0.1 x (t - 150) / 100, above 0.0525 first at t = 203. A dip of one step (step 251) keeps
    every window that holds it below, the last ending at step 350: the onset is then 351, the
    crossing that lasts."""
    healthy = np.full(500, 4.0)
    twin = healthy.copy()
    twin[150:] += 0.1
    assert harm_onset(twin, healthy, 0.0525) == 203
    twin[250] -= 20.0
    assert harm_onset(twin, healthy, 0.0525) == 351
    assert harm_onset(healthy, healthy, 0.0525) is None
    assert harm_onset(twin[:80], healthy[:80], 0.0525) is None  # shorter than a window


@pytest.mark.parametrize("seed", range(1, 6))
def test_a_drawn_fault_hits_its_layers_and_no_other(seed):
    layers = fault_layers("drawn:1", 4, seed)
    assert len(layers) == 1 and layers <= set(range(4))
    assert fault_layers("drawn:1", 4, seed) == layers  # the seed decides
    runtime = AttentionRuntime(PrecisionPlan(), fp8=True, fp8_output=True,
                               fault=FaultSchedule(1, 1, layers, step=3))
    for layer in range(4):
        path = runtime.low_path(f"layers.{layer}.self_attention.core_attention")
        assert (path.fault is not None) == (layer in layers) and path.fp8_output
        assert path.fault is None or path.fault.bits == 1


def test_the_draw_moves_with_the_seed():
    drawn = [next(iter(fault_layers("drawn:1", 4, seed))) for seed in range(1, 41)]
    assert set(drawn) == {0, 1, 2, 3}  # 40 seeds place it on every layer
    assert all(len(fault_layers("drawn:2", 6, seed)) == 2 for seed in range(1, 20))
    assert fault_layers("all", 3, 1) == {0, 1, 2} and fault_layers("0,2", 3, 1) == {0, 2}


@pytest.mark.parametrize("spec", ["drawn:0", "drawn:5", "drawn:x", "4", "1,b"])
def test_bad_fault_layers_are_refused(spec):
    with pytest.raises(ValueError):
        fault_layers(spec, 4, 1)


def test_the_first_alarm_from_a_twin_trace_is_the_live_run_first_recovery(tmp_path):
    """A twin (fault on the layer seed 5 draws, every quantity measured, no control) and the
    same run under delta-size at 0.3: replayed from the twin's detection trace, the first
    alarm is the live run's first recovery, step and layer (the live run follows its twin
    bit for bit until then)."""
    common = [*TINY, "--num-layers", "4", "--train-iters", "30", "--eval-interval", "30",
              "--attention-precision", "fp8", "--attention-fp8-output",
              "--attention-fault-bits", "1", "--attention-fault-layers", "drawn:1",
              "--seed", "5", "--gnmr", "--gnmr-units", "core_attention", "--gnmr-measure",
              "attention_error,attention_bias,rounding_bias,fp8_underflow,fp8_mse"]
    twin, live = tmp_path / "twin", tmp_path / "live"
    run_pretrain([*common, "--gnmr-max-o", "0", "--save", str(twin)])
    setting = Setting("delta-size", 0.3)
    config, signal = setting.controller(4)
    run_pretrain([*common, "--gnmr-signals", signal["signals"],
                  "--gnmr-attention-error-threshold", str(signal["attention_error_threshold"]),
                  "--gnmr-attention-error-window", "1", "--gnmr-attention-error-hold", "-1",
                  "--gnmr-max-o", str(config.max_o), "--gnmr-t-lock", str(config.t_lock),
                  "--gnmr-delta", str(config.delta), "--gnmr-warmup", str(config.warmup),
                  "--save", str(live)])
    first = next(r for r in trace_records(live) if r["recovery"])
    detection_traces.write(twin, tmp_path / "twin.npz")
    replayed = first_alarm(detection_traces.read(tmp_path / "twin.npz").trace, setting)
    assert replayed is not None and (replayed.step, list(replayed.units)) == \
        (first["step"], first["recovery"])
    # the trace knows where the fault is: the sign test of O's rounding (the chosen rule)
    # names the seed's faulted layer and no other (delta-size's first alarm above may name a
    # healthy layer: it fires on healthy runs, and which layer first depends on the CPU)
    faulted = next(r for r in read_jsonl(twin / "metrics.jsonl")
                   if r.get("event") == "start")["attention_fault_layers"]
    units = read_jsonl(live / "gnmr_trace.jsonl")[0]["units"]
    sign = first_alarm(detection_traces.read(tmp_path / "twin.npz").trace,
                       Setting("rounding-sign", 2.0))
    assert sign is not None and [int(units[i].split(".")[1]) for i in sign.units] == faulted


def test_the_kernel_probes_first_alarm_from_a_twin_trace_is_the_live_first_recovery(tmp_path):
    """The same for the kernel probe's sign test under the ladder's fair rule (at most 2 units,
    the policy's latch) on a weaker rung (a quarter of O's elements): the probe samples rows
    by step and layer, so the live run's probe reads what its twin's did until its first
    action, and the flags written for the held-out scenario decide as the replay does."""
    from megatron_gnmr.experiments.ladder_held_out import setting_flags

    common = [*TINY, "--num-layers", "4", "--train-iters", "24", "--eval-interval", "24",
              "--attention-precision", "fp8", "--attention-fp8-output",
              "--attention-fault-bits", "1", "--attention-fault-share", "0.25",
              "--attention-fault-layers", "drawn:1", "--seed", "5", "--gnmr", "--gnmr-units",
              "core_attention", "--gnmr-measure", "kernel_output_bias,kernel_probe_cost"]
    twin, live = tmp_path / "twin", tmp_path / "live"
    run_pretrain([*common, "--gnmr-max-o", "0", "--save", str(twin)])
    setting = Setting("probe-output-sign", 1.0)
    run_pretrain([*common, *setting_flags(setting), "--save", str(live)])
    first = next(r for r in trace_records(live) if r["recovery"])
    detection_traces.write(twin, tmp_path / "twin.npz")
    replayed = first_alarm(detection_traces.read(tmp_path / "twin.npz").trace, setting)
    assert replayed is not None and (replayed.step, list(replayed.units)) == \
        (first["step"], first["recovery"])
    later = [r["recovery"] for r in trace_records(live) if r["step"] > first["step"]]
    assert all(set(first["recovery"]) <= set(recovery) for recovery in later)  # latched


def test_the_held_out_verdicts_by_hand(monkeypatch):
    """compare-held-out's judge on hand-made runs: exact attention ends at 3.0, 3.1 (seeds 1,
    2), so the harm margin is 2 x stdev = 2 x 0.0707 = 0.1414. Seed 1: the rule's run ends
    0.1 above exact (saved), spending 40%. Seed 2: 0.2 above (harmed). Seed 3 has no exact
    run: its twin and healthy traces still count for detection (the healthy replay fires at
    step 7 and the live healthy run spent 10%), its rule run is not judged. The replay of a
    healthy trace is tested against the live policy elsewhere; here it is given."""
    from types import SimpleNamespace

    from megatron_gnmr.experiments import held_out

    def run(final=3.0, died=None, spent=0.0, first=None):
        return {"final_train_loss": final, "diverged_at": died,
                "recovered_share_of_executed_steps": spent, "first_recovery": first}

    table = {"exact-attention": {1: run(3.0), 2: run(3.1)},
             "twin": {s: run(9.0, died=100) for s in (1, 2, 3)},
             "rule": {1: run(3.1, spent=0.4, first=10), 2: run(3.3, spent=0.5, first=20),
                      3: run(3.0, spent=0.3, first=30)},
             "healthy-rule": {3: run(3.0, spent=0.1, first=7)}}
    # healthy runs end at 3.0, 3.1, 3.2 (the onset's margin: 2 x 0.1); each twin is its
    # healthy run until step 200, then 1.05 above (no tie at the margin)
    healthy = {s: np.full(300, 2.9 + 0.1 * s) for s in (1, 2, 3)}
    traces = {**{("healthy", s): SimpleNamespace(loss=loss, trace=None)
                 for s, loss in healthy.items()},
              **{("twin", s): SimpleNamespace(loss=loss + 1.05 * (np.arange(300) >= 200),
                                            trace=None)
                 for s, loss in healthy.items()}}
    scenario = SimpleNamespace(variants={"twin": [], "healthy": [], "exact-attention": [],
                                         "rule": [], "healthy-rule": []})
    monkeypatch.setattr(held_out, "fires_on",
                        lambda trace, scenario, rule, seed: 7 if seed == 3 else None)
    result = held_out.judge(scenario, table, traces)
    assert result["seeds"] == [1, 2, 3]
    assert result["harm_margin"] == pytest.approx(2 * math.sqrt(0.005))
    verdicts = result["rules"]["rule"]
    assert [verdicts[s]["failed"] for s in (1, 2)] == [False, True]
    assert verdicts[3]["judged"] is False and verdicts[3]["gap"] is None
    assert verdicts[1]["gap"] == pytest.approx(0.1)
    # the 100-step mean of twin - healthy first exceeds 0.2 in the window ending at step 220
    # (20 steps at +1.05: 0.21; 19 give 0.1995) and stays above
    assert [verdicts[s]["onset"] for s in (1, 2, 3)] == [220] * 3
    assert [verdicts[s]["healthy_spent"] for s in (1, 2, 3)] == [0.0, 0.0, 0.1]
    row = held_out.table_lines(result)[2].split(" | ")
    assert row[1:3] == ["1 / 2", "1 / 2"]  # saved, failed: seeds 1 and 2 only
    assert row[7] == "1 / 3"  # healthy runs it acts on
