"""The core attention as a unit (issue 30): its recovery path is exact attention bitwise, its
low path is FP8 attention (with and without the fault) against a float64 reference built from
ml_dtypes' float8 types, its norm is the norm of the gradients it hands back to Q, K and V,
and an alarm raised at a monitor check puts the unit it names on the recovery path in the
very next step."""

import math

import ml_dtypes
import numpy as np
import pytest
import torch

from megatron_gnmr.precision.attention_fault import FaultRounding, FaultSchedule
from megatron_gnmr.precision.attention_unit import (
    AttentionGradSums,
    AttentionRuntime,
    EmulatedFlashAttention,
)
from megatron_gnmr.precision.flash_attention import AttentionPath, FlashAttentionFunction
from megatron_gnmr.precision.plan import PrecisionPlan
from tests.helpers import TINY, read_jsonl, run_pretrain, trace_records

SHAPE = (2, 3, 16, 8)  # batch, heads, seq, d_head
SCALE = 1 / math.sqrt(8)


def _operands(seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(SHAPE, generator=g, dtype=dtype) * 2 for _ in range(3))
    return q, k, v, torch.randn(SHAPE, generator=g, dtype=dtype) * 1e-3


def _fp8(x: np.ndarray, dtype, fmax: float) -> np.ndarray:
    """Per-tensor current scaling, as FP8 attention holds an operand: scale = max / amax in
    float32, round to nearest even in the format, unscale (ml_dtypes, not our quantizer)."""
    scale = np.float32(fmax) / np.float32(np.abs(x).max())
    return (x.astype(np.float32) * scale).astype(dtype).astype(np.float64) / np.float64(scale)


def _round_down(x: np.ndarray, bits: int) -> np.ndarray:
    mantissa, exponent = np.frexp(x)
    return np.ldexp(np.floor(mantissa * 2 ** (bits + 1)) / 2 ** (bits + 1), exponent)


def reference(q, k, v, grad, fp8: bool, fault_bits: int):
    """Float64 FP8 flash attention, forward and backward, from the formulas."""
    q, k, v, grad = (t.double().numpy() for t in (q, k, v, grad))
    e4m3 = (lambda x: _fp8(x, ml_dtypes.float8_e4m3fn, 448.0)) if fp8 else (lambda x: x)
    e5m2 = (lambda x: _fp8(x, ml_dtypes.float8_e5m2, 57344.0)) if fp8 else (lambda x: x)
    q, k, v = e4m3(q), e4m3(k), e4m3(v)
    scores = q @ k.swapaxes(-1, -2) * SCALE
    scores = np.where(np.triu(np.ones((16, 16), bool), 1), -np.inf, scores)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    p_held = e4m3(p)
    out = p_held @ v
    grad = e5m2(grad)
    grad_v = p_held.swapaxes(-1, -2) @ grad
    held = _round_down(out, fault_bits) if fault_bits else out
    grad_s = p * (grad @ v.swapaxes(-1, -2) - (grad * held).sum(-1, keepdims=True))
    return out, grad_s @ k * SCALE, grad_s.swapaxes(-1, -2) @ q * SCALE, grad_v


def ours(q, k, v, grad, fp8: bool, fault_bits: int):
    q, k, v = (t.clone().requires_grad_(True) for t in (q, k, v))
    out = FlashAttentionFunction.apply(q, k, v, SCALE, AttentionPath(fp8, FaultRounding(fault_bits) if fault_bits else None), None)
    return (out.detach(), *torch.autograd.grad(out, (q, k, v), grad))


@pytest.mark.parametrize("fault_bits", [0, 1])
def test_low_path_is_fp8_attention_against_float64(fault_bits):
    q, k, v, grad = _operands(1)
    got = ours(q, k, v, grad, fp8=True, fault_bits=fault_bits)
    want = reference(q, k, v, grad, fp8=True, fault_bits=fault_bits)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        # Same quantized operands; the float32 GEMMs and softmax round apart from float64.
        np.testing.assert_allclose(a.double().numpy(), b, rtol=2e-4,
                                   atol=2e-4 * np.abs(b).max(), err_msg=name)
    # FP8 really changed the result, and the fault really changed dQ/dK
    exact = reference(q, k, v, grad, fp8=False, fault_bits=0)
    assert np.abs(got[0].double().numpy() - exact[0]).max() > 1e-3 * np.abs(exact[0]).max()
    if fault_bits:
        clean = reference(q, k, v, grad, fp8=True, fault_bits=0)
        assert np.abs(want[1] - clean[1]).max() > 1e-2 * np.abs(clean[1]).max()


def _attention(runtime, unit="layers.0.self_attention.core_attention", heads=4, groups=2):
    """An EmulatedFlashAttention without megatron's constructor: the attributes its forward
    reads (a TP size of 1)."""
    module = EmulatedFlashAttention.__new__(EmulatedFlashAttention)
    torch.nn.Module.__init__(module)
    module.num_attention_heads_per_partition = heads
    module.num_query_groups_per_partition = groups
    module.softmax_scale = SCALE
    module.hidden_size_per_partition = heads * 8
    module.config = type("Config", (), {"tensor_model_parallel_size": 1})()
    module.unit_name, module.runtime = unit, runtime
    return module


def _megatron_inputs(seed=2, heads=4, groups=2):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(16, 2, heads, 8, generator=g, requires_grad=True)  # [seq, batch, h, d]
    k, v = (torch.randn(16, 2, groups, 8, generator=g, requires_grad=True) for _ in range(2))
    return q, k, v, torch.randn(16, 2, heads * 8, generator=g)


def _forward_backward(module, q, k, v, grad):
    out = module(q, k, v, None)
    grads = torch.autograd.grad(out, (q, k, v), grad)
    return out.detach(), grads


def test_recovery_path_is_exact_attention_bitwise():
    unit = "layers.0.self_attention.core_attention"
    q, k, v, grad = _megatron_inputs()
    exact = _forward_backward(_attention(None), q, k, v, grad)  # the unswitched module
    recovering = AttentionRuntime(PrecisionPlan(recovery=frozenset({unit})), fp8=True,
                                  fault=FaultSchedule(1, 1, step=5))
    recovered = _forward_backward(_attention(recovering), q, k, v, grad)
    assert torch.equal(recovered[0], exact[0])
    for a, b in zip(recovered[1], exact[1]):
        assert torch.equal(a, b)
    low = _forward_backward(_attention(AttentionRuntime(PrecisionPlan(), fp8=True,
                                                        fault=FaultSchedule(1, 1, step=5))),
                            q, k, v, grad)
    assert not torch.equal(low[0], exact[0])
    assert not torch.equal(low[1][0], exact[1][0])
    # before the fault's start step the low path is FP8 alone: dV is the same either way
    early = _forward_backward(_attention(AttentionRuntime(PrecisionPlan(), fp8=True,
                                                          fault=FaultSchedule(1, 10, step=5))),
                              q, k, v, grad)
    assert torch.equal(early[1][2], low[1][2]) and not torch.equal(early[1][0], low[1][0])


def test_the_unit_norm_is_the_norm_of_what_it_hands_back_to_q_k_v():
    """Summed over micro-batches, squared, in float64; under GQA the key/value gradients are
    those of the shared heads (not of their per-query-head copies)."""
    names = ["layers.0.self_attention.linear_qkv", "layers.0.self_attention.core_attention"]
    sums = AttentionGradSums(names, [names[1]])
    runtime = AttentionRuntime(PrecisionPlan(), fp8=True, grad_sums=sums)
    module = _attention(runtime, unit=names[1])
    expected = 0.0
    for seed in (3, 4):  # two micro-batches
        q, k, v, grad = _megatron_inputs(seed)
        _, grads = _forward_backward(module, q, k, v, grad)
        expected += sum(float(g.double().square().sum()) for g in grads)
    taken = sums.take()
    assert taken[0] == 0 and taken[1].item() == pytest.approx(expected, rel=1e-12)
    assert torch.all(sums.take() == 0)  # take() clears


def test_an_alarm_puts_its_core_attention_on_the_recovery_path_in_the_next_step(tmp_path):
    """The online band alarms early on this run (checks every 2 steps); at the check step s
    that raised it, the decision recorded at s (the plan of step s + 1) already recovers the
    layer's core attention. Before the fix the alarm reached the controller one step later."""
    save = tmp_path / "run"
    run_pretrain([*TINY, "--train-iters", "40", "--lr-warmup-iters", "2", "--eval-interval",
                  "40", "--attention-precision", "fp8", "--attention-fault-bits", "1",
                  "--monitors", "attention", "--monitor-interval", "2", "--monitor-delta", "2",
                  "--monitor-detector", "online", "--monitor-baseline-samples", "3",
                  "--monitor-patience", "1", "--monitor-band", "0.5", "--gnmr",
                  "--gnmr-units", "core_attention", "--gnmr-signals", "monitor",
                  "--gnmr-max-o", "2", "--gnmr-delta", "1", "--gnmr-warmup", "2",
                  "--save", str(save)])
    alarms = [r for r in read_jsonl(save / "metrics.jsonl") if r.get("event") == "alarm"
              and r.get("monitor") == "attention"]
    assert alarms, "the test needs an alarm"
    first = alarms[0]
    trace = {r["step"]: r for r in trace_records(save)}
    header = read_jsonl(save / "gnmr_trace.jsonl")[0]
    unit = f"layers.{first['layer']}.self_attention.core_attention"
    named = trace[first["step"]]["alarmed"]
    assert unit in named and all(n.endswith(".core_attention") for n in named)
    assert header["units"].index(unit) in trace[first["step"]]["recovery"]
    assert not trace[first["step"] - 1]["recovery"]  # nothing recovered before the alarm
