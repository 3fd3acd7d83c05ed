"""The emulated flash-attention backward equals autograd; the fault really changes dQ/dK."""

import math

import pytest
import torch

from megatron_gnmr.precision.attention_fault import FaultRounding, round_toward_negative
from megatron_gnmr.precision.flash_attention import AttentionPath, FlashAttentionFunction


def _inputs():
    generator = torch.Generator().manual_seed(0)
    shape = (2, 3, 16, 8)
    return [torch.randn(shape, generator=generator, dtype=torch.float64, requires_grad=True)
            for _ in range(3)], torch.randn(shape, generator=generator, dtype=torch.float64)


def _reference(q, k, v, scale):
    scores = q @ k.transpose(-1, -2) * scale
    causal = torch.ones(16, 16, dtype=torch.bool).triu(1)
    return torch.softmax(scores.masked_fill(causal, float("-inf")), dim=-1) @ v


def test_backward_matches_autograd_in_float64():
    (q, k, v), grad = _inputs()
    scale = 1 / math.sqrt(8)
    out = FlashAttentionFunction.apply(q, k, v, scale, AttentionPath())
    ours = torch.autograd.grad(out, (q, k, v), grad)
    reference = _reference(q, k, v, scale)
    assert torch.allclose(out, reference, rtol=1e-12, atol=1e-12)
    expected = torch.autograd.grad(reference, (q, k, v), grad)
    for a, b in zip(ours, expected):
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-12)


def test_fault_changes_query_and_key_gradients_only():
    (q, k, v), grad = _inputs()
    scale = 1 / math.sqrt(8)
    clean = torch.autograd.grad(FlashAttentionFunction.apply(q, k, v, scale, AttentionPath()),
                                (q, k, v), grad)
    faulty = torch.autograd.grad(
        FlashAttentionFunction.apply(q, k, v, scale, AttentionPath(fault=FaultRounding(1))), (q, k, v),
        grad)
    assert not torch.allclose(clean[0], faulty[0]) and not torch.allclose(clean[1], faulty[1])
    assert torch.equal(clean[2], faulty[2])  # dV does not use delta


@pytest.mark.parametrize("bits", [1, 2, 3])
def test_rounding_is_toward_negative_infinity(bits):
    x = torch.randn(10000, dtype=torch.float64)
    rounded = round_toward_negative(x, bits)
    assert torch.all(rounded <= x)
    mantissa, _ = torch.frexp(rounded)
    steps = mantissa * 2 ** (bits + 1)
    assert torch.equal(steps, steps.round())  # bits + 1 significant bits remain
