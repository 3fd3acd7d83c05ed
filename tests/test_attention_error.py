"""The closed loop's early detector: `attention_error` (the low path's delta error as a share
of the score gradient) against an independent float64 computation on a crafted attention, on
the low path and in the shadow of the exact path; its signal on a hand-made sequence."""

import math

import numpy as np
import pytest
import torch

from megatron_gnmr.controller.signals import Observations
from megatron_gnmr.controller.signals.attention_error import AttentionErrorSignal
from megatron_gnmr.precision.attention_fault import FaultRounding
from megatron_gnmr.precision.flash_attention import AttentionPath, FlashAttentionFunction
from megatron_gnmr.precision.measurements import values
from megatron_gnmr.precision.probes import ProbeBank

UNITS = ["layers.0.self_attention.core_attention", "layers.1.self_attention.core_attention"]


def _round_down_float64(x: np.ndarray, bits: int) -> np.ndarray:
    """Toward -inf to `bits` mantissa bits after the leading one, by hand (numpy frexp)."""
    mantissa, exponent = np.frexp(x)
    scale = 2.0 ** (bits + 1)
    return np.ldexp(np.floor(mantissa * scale) / scale, exponent)


def _reference(q, k, v, grad_out, scale, bits) -> float:
    q, k, v, g = (t.double().numpy() for t in (q, k, v, grad_out))
    scores = q @ np.swapaxes(k, -1, -2) * scale
    seq = scores.shape[-1]
    scores = np.where(np.triu(np.ones((seq, seq), dtype=bool), 1), -np.inf, scores)
    p = np.exp(scores - scores.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    out = p @ v
    grad_p = g @ np.swapaxes(v, -1, -2)
    delta = (g * out).sum(axis=-1, keepdims=True)
    delta_low = (g * _round_down_float64(out, bits)).sum(axis=-1, keepdims=True)
    return float(np.linalg.norm(p * (delta_low - delta)) / np.linalg.norm(p * (grad_p - delta)))


@pytest.mark.parametrize("runs_low_path", [True, False])
def test_attention_error_against_float64(runs_low_path):
    """A crafted attention (2 x 3 heads x 16 positions x 8 dims) whose outputs are mostly
    positive and of one size, so the 1-bit rounding toward -inf is a bias in every row. The
    bound: float32 against float64 on sums of 16 x 8 products (~1e-6 relative), far below the
    value itself (~0.3 here)."""
    torch.manual_seed(0)
    q, k = torch.randn(2, 3, 16, 8), torch.randn(2, 3, 16, 8)
    v = 1.0 + 0.3 * torch.rand(2, 3, 16, 8)
    grad_out = torch.randn(2, 3, 16, 8)
    scale, bits = 1 / math.sqrt(8), 1
    low = AttentionPath(fault=FaultRounding(bits))
    run = low if runs_low_path else AttentionPath()
    bank = ProbeBank(UNITS, None, ("attention_error",))
    q_, k_, v_ = (t.clone().requires_grad_() for t in (q, k, v))
    out = FlashAttentionFunction.apply(q_, k_, v_, scale, run, None,
                                       bank.probe(UNITS[0]), low)
    out.backward(grad_out)
    measured = values(("attention_error",), bank.take().reshape(len(UNITS), -1).numpy())
    expected = _reference(q, k, v, grad_out, scale, bits)
    assert expected > 0.05  # the crafted case has a real error to measure
    assert measured["attention_error"][0] == pytest.approx(expected, rel=1e-4)
    assert np.isnan(measured["attention_error"][1])  # the other unit never ran


def test_without_the_fault_the_low_path_delta_is_exact():
    torch.manual_seed(1)
    q, k, v, grad_out = (torch.randn(1, 2, 8, 4) for _ in range(4))
    bank = ProbeBank(UNITS, None, ("attention_error",))
    fp8 = AttentionPath(fp8=True)
    q_ = q.clone().requires_grad_()
    FlashAttentionFunction.apply(q_, k, v, 0.5, fp8, None, bank.probe(UNITS[1]),
                                 fp8).backward(grad_out)
    assert values(("attention_error",),
                  bank.take().reshape(2, -1).numpy())["attention_error"][1] == 0.0


def _risky(threshold: float, hold: int, sequence, window: int = 1) -> list[list[int]]:
    signal = AttentionErrorSignal(UNITS, {"attention_error_threshold": threshold,
                                          "attention_error_hold": hold,
                                          "attention_error_window": window})
    return [[i for i, s in enumerate(signal.scores(Observations(
        measured={"attention_error": np.array(errors)}))) if s > 1.0] for errors in sequence]


SEQUENCE = [[0.2, 0.4], [0.6, 0.4], [0.3, float("nan")], [0.3, 0.51], [0.1, 0.1], [0.1, 0.1]]


def test_the_signal_by_hand():
    assert _risky(0.5, 0, SEQUENCE) == [[], [0], [], [1], [], []]
    assert _risky(0.5, 1, SEQUENCE) == [[], [0], [0], [1], [1], []]
    assert _risky(0.5, -1, SEQUENCE) == [[], [0], [0], [0, 1], [0, 1], [0, 1]]
    # medians of the last 3 steps, unit 0: 0.2, 0.4, 0.3, 0.3, 0.3, 0.1; unit 1 (a NaN
    # skipped): 0.4, 0.4, 0.4, 0.455, 0.305, 0.1
    assert _risky(0.35, 0, SEQUENCE, window=3) == [[1], [0, 1], [1], [1], [], []]
