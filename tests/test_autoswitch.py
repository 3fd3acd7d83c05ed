"""Transformer Engine's AutoswitchGemm rule as a risk signal, on hand-made sequences of the
FP8 operands' underflow shares and MSEs, and its two metrics against a hand count."""

import numpy as np
import pytest
import torch

from megatron_gnmr.controller.config import GNMRConfig
from megatron_gnmr.controller.policy import GNMRPolicy
from megatron_gnmr.controller.signals import Observations
from megatron_gnmr.controller.signals.autoswitch import AutoswitchSignal

UNITS = ["layers.0.self_attention.core_attention", "layers.1.self_attention.core_attention"]
NAN = float("nan")
# (underflow %, MSE) per unit and step; the thresholds are the pull request's, 5% and 1e-4
SEQUENCE = [
    ([1.0, 6.0], [1e-5, 1e-5]),    # unit 1: underflow 6% > 5%
    ([0.0, 0.0], [2e-4, 5e-5]),    # unit 0: MSE 2e-4 > 1e-4
    ([NAN, 5.0], [NAN, 1e-4]),     # exactly at both thresholds: not above; unit 0 unmeasured
    ([0.0, 0.0], [0.0, 0.0]),
    ([0.0, 0.0], [0.0, 0.0]),
]


def _settings(hold: int, scope: str = "unit") -> dict:
    return {"autoswitch_underflow_pct": 5.0, "autoswitch_mse": 1e-4, "autoswitch_hold": hold,
            "autoswitch_scope": scope}


def _risky(hold: int, scope: str = "unit") -> list[list[int]]:
    signal = AutoswitchSignal(UNITS, _settings(hold, scope))
    out = []
    for underflow, mse in SEQUENCE:
        scores = signal.scores(Observations(measured={
            "fp8_underflow": np.array(underflow), "fp8_mse": np.array(mse)}))
        out.append([i for i, score in enumerate(scores) if score > 1.0])
    return out


def test_the_rule_switches_on_a_breach_of_either_threshold_for_the_next_step_only():
    assert _risky(hold=0) == [[1], [0], [], [], []]


def test_the_global_scope_switches_every_unit_on_any_breach():
    """The pull request's default hold_window_scope: one breach, every unit (step 3 is at
    both thresholds, not above, and unit 0 is unmeasured: nothing)."""
    assert _risky(hold=0, scope="global") == [[0, 1], [0, 1], [], [], []]
    assert _risky(hold=1, scope="global") == [[0, 1], [0, 1], [0, 1], [], []]


def test_a_hold_keeps_the_unit_for_that_many_more_decisions():
    # unit 1 breached at step 1: held at steps 2 and 3; unit 0 breached at 2: held at 3, 4
    assert _risky(hold=2) == [[1], [0, 1], [0, 1], [0], []]


def test_its_decisions_through_the_policy_with_no_lock():
    """As the scenario runs it (--gnmr-t-lock 0, warm-up 2): the recovery set of each step is
    the units the metrics of the step before breached, at most max_o of them."""
    policy = GNMRPolicy(GNMRConfig(delta=1, warmup=2, t_lock=0, max_o=2), len(UNITS))
    signal = AutoswitchSignal(UNITS, _settings(0))
    decided = []
    for underflow, mse in [([0.0, 0.0], [0.0, 0.0])] * 2 + SEQUENCE:
        scores = signal.scores(Observations(measured={
            "fp8_underflow": np.array(underflow), "fp8_mse": np.array(mse)}))
        decided.append(policy.step(np.ones(len(UNITS)), scores, use_gnmr=False).recovery)
    assert decided == [(), (), (1,), (0,), (), (), ()]


def test_the_metrics_count_what_the_pull_request_counts():
    """underflow % = 100 x #(x != 0 and q == 0) / #x and MSE = mean((x - q)^2), the worst
    operand's; summed over calls before the ratio."""
    from megatron_gnmr.precision.flash_attention import AttentionPath
    from megatron_gnmr.precision.measurements import values
    from megatron_gnmr.precision.probes import ProbeBank

    names = ("fp8_underflow", "fp8_mse")
    bank = ProbeBank(UNITS, None, names)
    probe = bank.probe(UNITS[1])
    fp8 = AttentionPath(fp8=True)
    x = torch.tensor([1.0, 2.0, 1e-6, 0.0])
    held = torch.tensor([1.0, 2.5, 0.0, 0.0])  # one underflow, one error of 0.5
    probe.attention_operands(fp8, fp8, {"q": (x, held)}, None)
    probe.attention_operands(fp8, fp8, {"k": (x, x.clone())}, None)  # exact: no damage
    probe.attention_operands(fp8, fp8, {"q": (x, x.clone())}, None)  # q again, exact
    measured = values(names, bank.take().reshape(len(UNITS), -1).numpy())
    # q over its two calls: 1 underflow in 8 elements; squared error (0.5^2 + 1e-12) / 8
    assert measured["fp8_underflow"][1] == pytest.approx(100 * 1 / 8)
    assert measured["fp8_mse"][1] == pytest.approx((0.25 + 1e-12) / 8)
    assert np.isnan(measured["fp8_underflow"][0])  # never measured


def test_the_four_metrics_share_one_count_per_operand_and_call(monkeypatch):
    """On a recovered attention (its operands quantized in the shadow), the four FP8 quality
    metrics measured together read what each reads alone, from one quantization per operand
    per call (the call's shared memo), and a memo never carries over to the next call."""
    from megatron_gnmr.precision import scaling
    from megatron_gnmr.precision.flash_attention import AttentionPath
    from megatron_gnmr.precision.measurements import values
    from megatron_gnmr.precision.probes import ProbeBank

    names = ("fp8_underflow", "fp8_mse", "fp8_underflow_o", "fp8_mse_o")
    generator = torch.Generator().manual_seed(0)
    # magnitudes from 1 down to 1e-8: the smallest underflow E4M3 whatever the scale
    q, k = (torch.randn(64, generator=generator) * torch.logspace(0, -8, 64)
            for _ in range(2))
    o, o_held = torch.randn(64, generator=generator), torch.randn(64, generator=generator)
    recovered, low = AttentionPath(fp8=False), AttentionPath(fp8=True)

    def measure(which):
        bank = ProbeBank(UNITS, None, which)
        probe = bank.probe(UNITS[0])
        probe.attention_operands(low, recovered, {"q": (q, q), "k": (k, k)}, None)
        probe.attention_operands(low, recovered, {"o": (o, o_held)}, None)
        probe.attention_operands(low, recovered, {"q": (k, k)}, None)  # q again: k's values
        return values(which, bank.take().reshape(len(UNITS), -1).numpy())

    alone = {name: measure((name,))[name][0] for name in names}
    calls = []
    quantize = scaling.quantize
    monkeypatch.setattr(scaling, "quantize", lambda *args: calls.append(1) or quantize(*args))
    together = measure(names)
    assert {name: together[name][0] for name in names} == alone  # bit for bit
    assert alone["fp8_underflow"] > 0 and alone["fp8_mse_o"] > alone["fp8_mse"]
    assert len(calls) == 3  # q and k, then q again: O is held, never quantized aside
