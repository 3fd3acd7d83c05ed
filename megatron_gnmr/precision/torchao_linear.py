"""The fp8-torchao low-cost path: a unit's three GEMMs as real FP8 GEMMs (`torch._scaled_mm`
through torchao's Float8TrainingTensor), with megatron's tensor parallelism intact.

    forward  y  = Qx(x) @ Qw(W)^T
    dgrad    dx = Qg(dy) @ Qw'(W)
    wgrad    dW = Qg'(dy)^T @ Qx'(x)

As in torchao's own `matmul_with_hp_or_float8_args`, the high-precision x and W are saved
and cast again in backward, each operand scaled along the axis its GEMM contracts (for
tensorwise scaling the backward casts equal the forward's). Rowwise scales are powers of two
(torchao's `rowwise` recipe).

Tensor parallelism: a tensorwise scale must come from the whole tensor, and a rowwise scale
from the whole row, so an amax is reduced (MAX) over the TP group whenever the tensor is
split along the axis the amax is taken over:

| linear | split operands | reduced casts |
|---|---|---|
| column-parallel (qkv, fc1) | W and dy along N | tensorwise: W, dy; rowwise: dy and W in dgrad (amax over N) |
| row-parallel (proj, fc2) | x and W along K | tensorwise: x, W; rowwise: x and W in forward (amax over K) |

so TP=2 computes what TP=1 computes, up to the GEMMs' accumulation order.
"""

from __future__ import annotations

import torch

from megatron_gnmr.precision import torchao_compat

# The dimension (of the 2-D operand as cast) along which TP splits it, per linear kind;
# operands not listed are whole on every rank.
SPLIT_DIM = {"column": {"weight_t": 1, "grad": 1}, "row": {"input": 1, "weight_t": 0}}


class TorchaoFloat8LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, path, allreduce_dgrad: bool, tp_group, parallel: str,
                probe=None):
        ctx.save_for_backward(x, weight)
        ctx.path, ctx.allreduce_dgrad, ctx.tp_group = path, allreduce_dgrad, tp_group
        ctx.parallel, ctx.has_bias, ctx.probe = parallel, bias is not None, probe
        x2 = x.reshape(-1, x.shape[-1])
        x_fp8 = _cast(x2, path.input, -1, "INPUT", "input", ctx)
        w_t_fp8 = _cast(weight.t(), path.weight, 0, "WEIGHT", "weight_t", ctx)
        out = torch.mm(x_fp8, w_t_fp8).reshape(*x.shape[:-1], weight.shape[0])
        if probe is not None:  # measures only: nothing below reads what it computes
            x_q = torchao_compat.dequantized(x_fp8).reshape(x.shape)
            w_q = torchao_compat.dequantized(w_t_fp8).t()
            probe.forward_operands(x, weight, path, x_q, w_q, x_q, tp_group)
        return out + bias if bias is not None else out

    @staticmethod
    def backward(ctx, grad_output):
        x, weight = ctx.saved_tensors
        path = ctx.path
        g2 = grad_output.reshape(-1, grad_output.shape[-1])
        g_fp8 = _cast(g2, path.grad, -1, "GRAD_OUTPUT", "grad", ctx)
        w_t_fp8 = _cast(weight.t(), path.weight, -1, "WEIGHT", "weight_t", ctx)
        grad_input = torch.mm(g_fp8, w_t_fp8.t()).reshape(*grad_output.shape[:-1],
                                                           weight.shape[1])
        if ctx.allreduce_dgrad:  # column-parallel: the input was replicated across TP
            torch.distributed.all_reduce(grad_input, group=ctx.tp_group)
        x2 = x.reshape(-1, x.shape[-1])
        g_fp8_tokens = _cast(g2, path.grad, 0, "GRAD_OUTPUT", "grad", ctx)
        x_fp8_tokens = _cast(x2, path.input, 0, "INPUT", "input", ctx)
        grad_weight = torch.mm(g_fp8_tokens.t(), x_fp8_tokens)
        grad_bias = g2.sum(dim=0) if ctx.has_bias else None
        if ctx.probe is not None:
            g_q = torchao_compat.dequantized(g_fp8).reshape(grad_output.shape)
            ctx.probe.grad_operand(grad_output, path, g_q, ctx.tp_group)
            if ctx.probe.keeps_exact_input:
                ctx.probe.weight_gradient(grad_output, x, path, grad_weight, ctx.tp_group)
        return grad_input, grad_weight, grad_bias, None, None, None, None, None


def _cast(tensor, spec, amax_dim: int, role: str, operand: str, ctx):
    """Cast one GEMM operand, reducing its amax over TP when the amax axis is split."""
    split = SPLIT_DIM[ctx.parallel].get(operand)
    tensorwise = spec.granularity == "tensor"
    reduce = split is not None and (tensorwise or split == amax_dim % 2)
    return torchao_compat.cast(tensor, spec.format, spec.granularity, amax_dim, role,
                               spec.pow2_scale, ctx.tp_group if reduce else None)


def torchao_linear(x, weight, bias, path, allreduce_dgrad: bool, tp_group, parallel: str,
                   probe=None):
    return TorchaoFloat8LinearFunction.apply(x, weight, bias, path, allreduce_dgrad, tp_group,
                                             parallel, probe)
