"""Tokens quantized before the MoE dispatch (DeepSeek-V3, section 3.3).

DeepSeek-V3 sends tokens to the experts in FP8: they are quantized (E4M3, 1x128 tiles) once,
before the all-to-all, which halves its bytes; the expert's fc1 then consumes them as they
are. The backward (the gradients' way back) and the combine stay in BF16. Here the quantizer
wraps each MoE layer's `dispatch` step (megatron-core 0.16 and 0.19 both have it): its
forward rounds the permuted tokens, its backward passes the gradient through unchanged.

The tiles run along the hidden dimension of each token, like the expert fc1's input tiles,
so with the same format and power-of-two scales the fc1 rounding of a dispatched token is
the identity (quantization is idempotent); a routed expert on the recovery path still gets
the dispatched (rounded) tokens: the dispatch is shared by all of a token's experts and
happens before any of them runs. The router and the shared expert read the unquantized
hidden states (they run before the dispatch).
"""

from __future__ import annotations

import torch

from megatron_gnmr.precision.scaling import QuantSpec, quantize

DISPATCH_SPEC = QuantSpec("e4m3", "tile", pow2_scale=True)


class _QuantizeStraightThrough(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tokens: torch.Tensor, spec: QuantSpec):
        return quantize(tokens, spec)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def quantize_for_dispatch(tokens: torch.Tensor, spec: QuantSpec = DISPATCH_SPEC) -> torch.Tensor:
    return _QuantizeStraightThrough.apply(tokens, spec)


def moe_layers(model_chunks) -> list[torch.nn.Module]:
    return [module for chunk in model_chunks for module in chunk.modules()
            if hasattr(module, "token_dispatcher") and hasattr(module, "dispatch")]


def install_dispatch_quantization(model_chunks) -> int:
    """Wrap every MoE layer's dispatch; returns how many were wrapped."""
    layers = moe_layers(model_chunks)
    for layer in layers:
        original = layer.dispatch

        def dispatch(hidden_states, probs, _original=original):
            return _original(quantize_for_dispatch(hidden_states), probs)

        layer.dispatch = dispatch  # an instance attribute over megatron's method
    return len(layers)
