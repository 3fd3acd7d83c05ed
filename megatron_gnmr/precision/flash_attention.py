"""The emulated flash-attention kernel: causal softmax attention on [batch, heads, seq, d_head]
with flash attention's backward formulas (checked against autograd in float64), on the path
its unit runs this step (`AttentionPath`):
- FP8 attention as Transformer Engine's FP8 DPA holds its operands (Q, K, V, P in E4M3, dO in
  E5M2, per-tensor current scaling, amax reduced over the TP group), O held in E4M3 inside
  delta where `fp8_output`;
- the fault's rounding of O inside delta where the path carries one (`attention_fault.py`);
- exact attention (no quantization, no fault) on the recovery path.

A unit probe (`probes.UnitProbe`) is shown the operands and the delta stage with the unit's
low path (the measurements that audit the low path in the shadow), and the call as a
production kernel would expose it (`kernel_view.KernelView`): nothing it computes is read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_gnmr.precision.attention_fault import FaultRounding
from megatron_gnmr.precision.kernel_view import KernelView
from megatron_gnmr.precision.scaling import QuantSpec, quantize

FP8_FORWARD = QuantSpec("e4m3")  # Q, K, V, P
FP8_GRADIENT = QuantSpec("e5m2")  # dO


def fp8_spec_of(operand: str) -> QuantSpec:
    """How FP8 attention holds an operand (`q`, `k`, `v`, `p`, `o` or `do`)."""
    return FP8_GRADIENT if operand == "do" else FP8_FORWARD


@dataclass(frozen=True)
class AttentionPath:
    """How one core attention runs: its operands' quantization, whether its backward holds O
    in FP8, and the fault's rounding of O (None: none)."""

    fp8: bool = False
    fault: FaultRounding | None = None
    fp8_output: bool = False

    @property
    def is_exact(self) -> bool:
        return not self.fp8 and self.fault is None


EXACT_ATTENTION = AttentionPath()


def held_output(out: torch.Tensor, path: AttentionPath, group=None,
                probabilities: torch.Tensor | None = None) -> torch.Tensor:
    """O as the path's backward holds it inside delta = rowsum(dO * O): in E4M3 where the path
    saves O in FP8, else as computed; where the fault acts, its rounding instead (`P`: for a
    fault conditioned on the rows' peak)."""
    def healthy() -> torch.Tensor:  # made only where read: its amax is a collective
        return quantize(out, FP8_FORWARD, group) if path.fp8_output else out

    if path.fault is not None:
        return path.fault.hold(out, probabilities, healthy)
    return healthy()


def _maybe_quantize(x: torch.Tensor, spec: QuantSpec | None, group) -> torch.Tensor:
    return quantize(x, spec, group) if spec is not None else x


class FlashAttentionFunction(torch.autograd.Function):
    """Causal attention on `path`. `probe` (a `probes.UnitProbe`, or None) measures; `low` is
    the unit's low-cost path (for the shadow measurements), `sample_seed` what the kernel
    view's probes sample."""

    @staticmethod
    def forward(ctx, q, k, v, scale: float, path: AttentionPath, group=None, probe=None,
                low=None, sample_seed: int = 0):
        fp8 = path.fp8
        forward_spec = FP8_FORWARD if fp8 else None
        exact = {"q": q, "k": k, "v": v}
        q, k, v = (_maybe_quantize(t, forward_spec, group) for t in (q, k, v))
        scores = torch.matmul(q, k.transpose(-1, -2)) * scale
        seq = q.shape[-2]
        causal = torch.ones(seq, seq, dtype=torch.bool, device=q.device).triu(1)
        softmax_dtype = torch.promote_types(q.dtype, torch.float32)  # bf16 -> fp32 softmax
        probabilities = torch.softmax(scores.masked_fill(causal, float("-inf")).to(softmax_dtype),
                                      dim=-1).to(q.dtype)
        held_p = _maybe_quantize(probabilities, forward_spec, group)  # P as the PV GEMM reads it
        out = torch.matmul(held_p, v)
        ctx.save_for_backward(q, k, v, probabilities, held_p, out)
        ctx.scale, ctx.path, ctx.group = scale, path, group
        ctx.probe, ctx.low, ctx.sample_seed = probe, low, sample_seed
        if probe is not None:
            held = {"q": q, "k": k, "v": v}
            probe.attention_operands(low, path,
                                     {name: (exact[name], held[name]) for name in exact}, group)
            probe.attention_operands(low, path, {"p": (probabilities, held_p)}, group)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, probabilities, held_p, out = ctx.saved_tensors
        path, group = ctx.path, ctx.group
        exact_grad_out = grad_out
        grad_out = _maybe_quantize(grad_out, FP8_GRADIENT if path.fp8 else None, group)
        grad_v = torch.matmul(held_p.transpose(-1, -2), grad_out)
        grad_p = torch.matmul(grad_out, v.transpose(-1, -2))
        held_o = held_output(out, path, group, probabilities)
        delta = (grad_out * held_o).sum(dim=-1, keepdim=True)
        grad_s = probabilities * (grad_p - delta)
        grad_q = torch.matmul(grad_s, k) * ctx.scale
        grad_k = torch.matmul(grad_s.transpose(-1, -2), q) * ctx.scale
        probe = ctx.probe
        if probe is not None:
            probe.attention_operands(ctx.low, path, {"do": (exact_grad_out, grad_out)}, group)
            if probe.watches_output:  # O as the low path holds it (the shadow's own rounding)
                low_o = held_o if path == ctx.low else \
                    held_output(out, ctx.low, group, probabilities)
                probe.attention_operands(ctx.low, path, {"o": (out, low_o)}, group)
            probe.attention_delta(ctx.low, path, probabilities, grad_p, grad_out, out, group)
            if not path.is_exact:  # the probe watches the low-cost kernel
                probe.attention_kernel(KernelView(q, k, v, held_o, grad_out, delta, ctx.scale,
                                                  ctx.sample_seed))
        return grad_q, grad_k, grad_v, None, None, None, None, None, None
