"""The core attention as a unit (SPEC 8.4): megatron's core attention interface computed by
the emulated flash-attention kernel (`flash_attention.py`), low-precision attention on the
low-cost path and exact attention on the recovery path, asked of the run's `AttentionRuntime`
every forward.

`EmulatedFlashAttention` replaces megatron's core attention through the layer spec. Each
layer's core attention is then a unit (`layers.N.self_attention.core_attention`):
- low-cost path: FP8 attention (`--attention-precision fp8`), plus the fault
  (`attention_fault.py`) from `--attention-fault-start` when `--attention-fault-bits` > 0;
- recovery path: exact attention, bitwise the unswitched module.

The unit has no weights. What stands for its gradient norm is the norm of the gradients it
hands back to Q, K and V (the qkv projection's output gradient, where the fault's bias
enters), summed over the step's micro-batches on the device (`AttentionGradSums`) and
all-reduced with the parameter norms (`controller/grad_stats.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from megatron.core.transformer.dot_product_attention import DotProductAttention

from megatron_gnmr.precision.attention_fault import FaultSchedule, layer_of
from megatron_gnmr.precision.flash_attention import (
    EXACT_ATTENTION,
    AttentionPath,
    FlashAttentionFunction,
)


def switchable_attention(config) -> bool:
    """Whether a run's core attention has a low-cost path (and so is a unit of each layer)."""
    return config.precision.attention_precision != "exact" or \
        config.training.attention_fault_bits > 0


class AttentionGradSums:
    """Per core-attention unit, the squared norm of the gradients it hands back to Q, K and V,
    summed over the step's micro-batches on the device (no host sync in the backward);
    `take` reads and clears them once per step."""

    def __init__(self, unit_names: list[str], eligible: list[str], device=None):
        """`unit_names`: every unit of the controller (the sums' slots); `eligible`: the core
        attentions among them."""
        self.index = {name: i for i, name in enumerate(unit_names) if name in eligible}
        self.sums = torch.zeros(len(unit_names), dtype=torch.float64, device=device)

    def hook(self, unit_name: str):
        """A tensor hook adding its gradient's squared norm to the unit's sum, or None when
        the unit is not eligible."""
        index = self.index.get(unit_name)
        if index is None:
            return None

        def add(grad: torch.Tensor) -> None:
            self.sums[index] += grad.double().square().sum()

        return add

    def take(self) -> torch.Tensor:
        sums = self.sums.clone()
        self.sums.zero_()
        return sums


@dataclass
class AttentionRuntime:
    """Answers a core attention's question 'which path this step?' from the plan (the units
    the controller or a static rule keeps exact) and the low path's settings."""

    plan: object  # precision.plan.PrecisionPlan
    fp8: bool = False
    fp8_output: bool = False
    fault: FaultSchedule = field(default_factory=FaultSchedule)
    grad_sums: AttentionGradSums | None = None

    probes: object = None  # a probes.ProbeBank when the controller measures the attention

    def low_path(self, unit_name: str | None) -> AttentionPath:
        """The unit's low-cost path as it runs in this step (the fault from its start step,
        on its layers)."""
        return AttentionPath(self.fp8, self.fault.rounding_for(unit_name),
                             self.fp8 and self.fp8_output)

    def sample_seed(self, unit_name: str | None) -> int:
        """What a kernel probe samples in this unit's call: the step and the layer (a
        controlled run samples what its twin did)."""
        layer = 0 if unit_name is None else layer_of(unit_name)
        return self.fault.step * 65_537 + layer

    def path_for(self, unit_name: str | None) -> AttentionPath:
        if unit_name is not None and self.plan.is_recovery(unit_name):
            return EXACT_ATTENTION
        return self.low_path(unit_name)

    def probe_for(self, unit_name: str | None):
        return self.probes.probe(unit_name) if self.probes is not None and \
            unit_name is not None else None


class EmulatedFlashAttention(DotProductAttention):
    """megatron's core attention interface, computed by `FlashAttentionFunction` on the path
    the run's `AttentionRuntime` gives its unit (exact without one)."""

    unit_name: str | None = None
    runtime: AttentionRuntime | None = None

    def __init__(self, *args, k_channels: int | None = None, v_channels: int | None = None,
                 **kwargs):
        """`k_channels`, `v_channels`: the query/key and value widths per head where they
        differ (multi-latent attention), as Transformer Engine's attention takes them;
        megatron's local attention does not. The widths are read off the tensors."""
        super().__init__(*args, **kwargs)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        if attention_mask is not None or packed_seq_params is not None:
            raise NotImplementedError("emulated flash attention is causal without a mask")
        # Evaluation runs the unit's path too (the fault lives in the backward only).
        path = self.runtime.path_for(self.unit_name) if self.runtime is not None \
            else EXACT_ATTENTION
        if self.training and query.requires_grad and self.runtime is not None and \
                self.runtime.grad_sums is not None:
            add = self.runtime.grad_sums.hook(self.unit_name)
            if add is not None:  # what the unit hands back to the qkv projection
                for tensor in (query, key, value):
                    tensor.register_hook(add)
        groups = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
        if groups > 1:  # GQA: each query head reads its group's key/value head
            key = key.repeat_interleave(groups, dim=2)
            value = value.repeat_interleave(groups, dim=2)
        # [seq, batch, heads, d_head] -> [batch, heads, seq, d_head]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        group = None
        if (path.fp8 or path.fp8_output) and self.config.tensor_model_parallel_size > 1:
            from megatron.core import parallel_state

            group = parallel_state.get_tensor_model_parallel_group()  # heads are split
        probe = self.runtime.probe_for(self.unit_name) if self.runtime is not None and \
            self.training else None
        if probe is not None and group is None and self.config.tensor_model_parallel_size > 1:
            from megatron.core import parallel_state

            group = parallel_state.get_tensor_model_parallel_group()  # the shadow's amaxes
        out = FlashAttentionFunction.apply(
            q, k, v, self.softmax_scale, path, group, probe,
            self.runtime.low_path(self.unit_name) if probe is not None else None,
            self.runtime.sample_seed(self.unit_name) if probe is not None else 0)
        seq, batch = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(seq, batch, -1)  # heads x value width


def bind_attention(model_chunks, unit_modules: dict, plan, config, fault: FaultSchedule,
                   registry=None, probes=None) -> AttentionGradSums | None:
    """Give every emulated core attention the run's `AttentionRuntime` and its unit name; with
    the controller on, the gradient sums of the eligible ones (None if none is eligible), and
    the probe bank when the controller measures something of the attention."""
    from megatron_gnmr.platform.device import run_device

    names = [] if registry is None else registry.names
    eligible = [name for name in names if name.endswith(".core_attention")]
    sums = AttentionGradSums(names, eligible, run_device()) if eligible else None
    runtime = AttentionRuntime(plan, config.precision.attention_precision == "fp8",
                               config.precision.attention_fp8_output, fault, sums,
                               probes if probes is not None and probes.watches("attention")
                               else None)
    for name, module in unit_modules.items():
        if isinstance(module, EmulatedFlashAttention):
            module.unit_name = name
    for chunk in model_chunks:
        for module in chunk.modules():
            if isinstance(module, EmulatedFlashAttention):
                module.runtime = runtime
    return sums
