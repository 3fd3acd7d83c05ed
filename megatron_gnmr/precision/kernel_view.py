"""What an attention kernel exposes to whoever watches it, and nothing else.

A production flash-attention kernel hands out its inputs Q, K and V (as it read them: in FP8
where it runs FP8), the output O as it stored it for the backward, the output gradient dO as
its backward read it, and the backward's own delta = rowsum(dO * O) (FlashAttention returns it
as `softmax_d`). A probe may recompute from these, in higher precision, on rows it samples;
it sees no knob of the kernel, no fault, no layer list. This module imports nothing of the
project so that what a probe can reach is exactly what is here (tests/test_kernel_probe.py
holds it so).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class KernelView:
    """One call of a causal attention kernel, as its caller can see it. Tensors are
    [batch, heads, seq, width]; `delta` is [batch, heads, seq, 1]."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    out: torch.Tensor
    """O as stored for the backward (the O delta was formed from)."""
    grad_out: torch.Tensor
    """dO as the backward read it."""
    delta: torch.Tensor
    """The backward's rowsum(dO * O), `softmax_d`."""
    scale: float
    sample_seed: int
    """Which rows a probe samples in this call (a function of the step and the layer, so a
    controlled run samples what its twin sampled)."""
    memo: dict = field(default_factory=dict)
    """What the probes of one call share (a recomputation made once, read by several)."""
