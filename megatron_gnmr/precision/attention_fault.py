"""A low-precision attention fault to study (SPEC 8.4; Qiu & Yao, arXiv 2510.04212).

Flash attention's backward computes delta = rowsum(dO * O) and dS = P * (dP - delta). When O
is held in low precision and rounded with a bias (rows with repeated maxima round the same
way), delta is biased, the error accumulates in coherent low-rank directions of the W_q/W_k
updates and training eventually diverges. Faithful BF16 rounding did nothing at the
calibration's size; the fault here rounds O to `bits` mantissa bits toward -inf (bias, not
error size, is what matters: the calibration's unbiased 1-bit rounding never diverged).

`EmulatedFlashAttention` replaces megatron's core attention through the layer spec: an
explicit FA-style backward (checked against autograd in float64), with the fault off by
default and switched on from `--attention-fault-start` when `--attention-fault-bits` > 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core.transformer.dot_product_attention import DotProductAttention


def round_toward_negative(x: torch.Tensor, mantissa_bits: int) -> torch.Tensor:
    mantissa, exponent = torch.frexp(x)  # |mantissa| in [0.5, 1)
    scale = 2.0 ** (mantissa_bits + 1)
    return torch.ldexp(torch.floor(mantissa * scale) / scale, exponent)


@dataclass
class FaultSchedule:
    bits: int = 0  # 0: no fault
    start_step: int = 1
    step: int = 0  # the training step running now (set by the trainer)

    @property
    def active(self) -> bool:
        return self.bits > 0 and self.step >= self.start_step


class FlashAttentionFunction(torch.autograd.Function):
    """Causal softmax attention on [batch, heads, seq, d_head] with flash attention's
    backward formulas; `fault_bits` > 0 biases the rounding of O inside delta."""

    @staticmethod
    def forward(ctx, q, k, v, scale: float, fault_bits: int):
        scores = torch.matmul(q, k.transpose(-1, -2)) * scale
        seq = q.shape[-2]
        causal = torch.ones(seq, seq, dtype=torch.bool, device=q.device).triu(1)
        softmax_dtype = torch.promote_types(q.dtype, torch.float32)  # bf16 -> fp32 softmax
        probabilities = torch.softmax(scores.masked_fill(causal, float("-inf")).to(softmax_dtype),
                                      dim=-1).to(q.dtype)
        out = torch.matmul(probabilities, v)
        ctx.save_for_backward(q, k, v, probabilities, out)
        ctx.scale, ctx.fault_bits = scale, fault_bits
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, probabilities, out = ctx.saved_tensors
        grad_v = torch.matmul(probabilities.transpose(-1, -2), grad_out)
        grad_p = torch.matmul(grad_out, v.transpose(-1, -2))
        held = round_toward_negative(out, ctx.fault_bits) if ctx.fault_bits else out
        delta = (grad_out * held).sum(dim=-1, keepdim=True)
        grad_s = probabilities * (grad_p - delta)
        grad_q = torch.matmul(grad_s, k) * ctx.scale
        grad_k = torch.matmul(grad_s.transpose(-1, -2), q) * ctx.scale
        return grad_q, grad_k, grad_v, None, None


class EmulatedFlashAttention(DotProductAttention):
    """megatron's core attention interface, computed by `FlashAttentionFunction`."""

    schedule: FaultSchedule = FaultSchedule()

    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        if attention_mask is not None or packed_seq_params is not None:
            raise NotImplementedError("emulated flash attention is causal without a mask")
        groups = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
        if groups > 1:  # GQA: each query head reads its group's key/value head
            key = key.repeat_interleave(groups, dim=2)
            value = value.repeat_interleave(groups, dim=2)
        # [seq, batch, heads, d_head] -> [batch, heads, seq, d_head]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        bits = self.schedule.bits if self.schedule.active and self.training else 0
        out = FlashAttentionFunction.apply(q, k, v, self.softmax_scale, bits)
        seq, batch = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(seq, batch, self.hidden_size_per_partition)
