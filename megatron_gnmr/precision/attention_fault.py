"""The core attention as a unit: low-precision attention on the low-cost path, exact attention
on the recovery path, and a low-precision attention fault to study (SPEC 8.4; Qiu & Yao,
arXiv 2510.04212).

Flash attention's backward computes delta = rowsum(dO * O) and dS = P * (dP - delta). When O
is held in low precision and rounded with a bias (rows with repeated maxima round the same
way), delta is biased, the error accumulates in coherent low-rank directions of the W_q/W_k
updates and training eventually diverges. Faithful BF16 rounding did nothing at the
calibration's size; the fault here rounds O to `bits` mantissa bits toward -inf (bias, not
error size, is what matters: the calibration's unbiased 1-bit rounding never diverged).

`EmulatedFlashAttention` replaces megatron's core attention through the layer spec: an
explicit FA-style backward (checked against autograd in float64). Each layer's core attention
is then a unit (`layers.N.self_attention.core_attention`) whose path is asked of the run's
`AttentionRuntime` every forward:
- low-cost path: FP8 attention as Transformer Engine's FP8 DPA holds its operands
  (`--attention-precision fp8`: Q, K, V and P in E4M3, dO in E5M2, per-tensor current
  scaling, amax reduced over the TP group), plus the fault from `--attention-fault-start`
  when `--attention-fault-bits` > 0;
- recovery path: exact attention (no quantization, no fault), bitwise the unswitched module.

The unit has no weights. What stands for its gradient norm is the norm of the gradients it
hands back to Q, K and V (the qkv projection's output gradient, where the fault's bias
enters), summed over the step's micro-batches on the device (`AttentionGradSums`) and
all-reduced with the parameter norms (`controller/grad_stats.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from megatron.core.transformer.dot_product_attention import DotProductAttention

from megatron_gnmr.precision.scaling import QuantSpec, quantize

FP8_FORWARD = QuantSpec("e4m3")  # Q, K, V, P
FP8_GRADIENT = QuantSpec("e5m2")  # dO


def fp8_spec_of(operand: str) -> QuantSpec:
    """How FP8 attention holds an operand (`q`, `k`, `v`, `p` or `do`)."""
    return FP8_GRADIENT if operand == "do" else FP8_FORWARD


def switchable_attention(config) -> bool:
    """Whether a run's core attention has a low-cost path (and so is a unit of each layer)."""
    return config.precision.attention_precision != "exact" or \
        config.training.attention_fault_bits > 0


def round_toward_negative(x: torch.Tensor, mantissa_bits: int) -> torch.Tensor:
    mantissa, exponent = torch.frexp(x)  # |mantissa| in [0.5, 1)
    scale = 2.0 ** (mantissa_bits + 1)
    return torch.ldexp(torch.floor(mantissa * scale) / scale, exponent)


DRAWN = "drawn:"  # --attention-fault-layers drawn:K


def fault_layers(spec: str, num_layers: int, seed: int) -> frozenset[int]:
    """The layers `--attention-fault-layers` names: `all`, a comma list of 0-based layer
    numbers, or `drawn:K`, K distinct layers drawn from the run's seed (a generator of its
    own, so the draw depends on the seed and the layer count only). ValueError says what is
    wrong with the value."""
    text = spec.strip()
    if text == "all":
        return frozenset(range(num_layers))
    if text.startswith(DRAWN):
        try:
            count = int(text[len(DRAWN):])
        except ValueError:
            raise ValueError(f"{spec!r}: drawn:K takes a whole number of layers") from None
        if not 1 <= count <= num_layers:
            raise ValueError(f"{spec!r}: draws {count} of {num_layers} layers")
        import numpy as np

        rng = np.random.default_rng([seed, 0xFA017])
        return frozenset(int(layer) for layer in rng.choice(num_layers, count, replace=False))
    try:
        layers = frozenset(int(part) for part in text.split(","))
    except ValueError:
        raise ValueError(f"{spec!r}: use all, a comma list of layer numbers or drawn:K") \
            from None
    outside = sorted(layer for layer in layers if not 0 <= layer < num_layers)
    if outside:
        raise ValueError(f"{spec!r}: no layer {', '.join(map(str, outside))} in a model of "
                         f"{num_layers} layers")
    return layers


def layer_of(unit_name: str) -> int:
    """`layers.N.self_attention.core_attention` -> N (the global layer number)."""
    return int(unit_name.split(".")[1])


@dataclass
class FaultSchedule:
    bits: int = 0  # 0: no fault
    start_step: int = 1
    layers: frozenset[int] | None = None  # the faulted layers (None: every layer)
    step: int = 0  # the training step running now (set by the trainer)

    @property
    def active(self) -> bool:
        return self.bits > 0 and self.step >= self.start_step

    def hits(self, unit_name: str | None) -> bool:
        """Whether the fault acts on this core attention now."""
        return self.active and (self.layers is None or unit_name is None or
                                layer_of(unit_name) in self.layers)


@dataclass(frozen=True)
class AttentionPath:
    """How one core attention runs: its operands' quantization, whether its backward holds O
    in FP8, and the fault's bits."""

    fp8: bool = False
    fault_bits: int = 0
    fp8_output: bool = False

    @property
    def is_exact(self) -> bool:
        return not self.fp8 and not self.fault_bits


def held_output(out: torch.Tensor, path: AttentionPath, group=None) -> torch.Tensor:
    """O as the path's backward holds it inside delta = rowsum(dO * O): rounded toward -inf
    by the fault, else in E4M3 where the path saves O in FP8, else as computed."""
    if path.fault_bits:
        return round_toward_negative(out, path.fault_bits)
    if path.fp8_output:
        return quantize(out, FP8_FORWARD, group)
    return out


EXACT_ATTENTION = AttentionPath()


def _maybe_quantize(x: torch.Tensor, spec: QuantSpec | None, group) -> torch.Tensor:
    return quantize(x, spec, group) if spec is not None else x


class FlashAttentionFunction(torch.autograd.Function):
    """Causal softmax attention on [batch, heads, seq, d_head] with flash attention's
    backward formulas. `fp8`: Q, K, V, P in E4M3 and dO in E5M2 (per-tensor current scaling,
    amaxes reduced over `group`), the GEMMs on those operands as an FP8 kernel runs them;
    `fault_bits` > 0 biases the rounding of O inside delta. `probe` (a
    `probes.UnitProbe`, or None) is shown the operands and the delta stage, with `low`, the
    unit's low-cost `AttentionPath` (it only measures: nothing here reads what it computes)."""

    @staticmethod
    def forward(ctx, q, k, v, scale: float, path: AttentionPath, group=None, probe=None,
                low=None):
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
        ctx.probe, ctx.low = probe, low
        if probe is not None:
            held = {"q": q, "k": k, "v": v}
            probe.attention_operands(low, path,
                                     {name: (exact[name], held[name]) for name in exact}, group)
            probe.attention_operands(low, path, {"p": (probabilities, held_p)}, group)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, probabilities, held_p, out = ctx.saved_tensors
        exact_grad_out = grad_out
        grad_out = _maybe_quantize(grad_out, FP8_GRADIENT if ctx.path.fp8 else None, ctx.group)
        grad_v = torch.matmul(held_p.transpose(-1, -2), grad_out)
        grad_p = torch.matmul(grad_out, v.transpose(-1, -2))
        delta = (grad_out * held_output(out, ctx.path, ctx.group)).sum(dim=-1, keepdim=True)
        grad_s = probabilities * (grad_p - delta)
        grad_q = torch.matmul(grad_s, k) * ctx.scale
        grad_k = torch.matmul(grad_s.transpose(-1, -2), q) * ctx.scale
        if ctx.probe is not None:
            ctx.probe.attention_operands(ctx.low, ctx.path, {"do": (exact_grad_out, grad_out)},
                                         ctx.group)
            ctx.probe.attention_delta(ctx.low, ctx.path, probabilities, grad_p, grad_out, out,
                                      ctx.group)
        return grad_q, grad_k, grad_v, None, None, None, None, None


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
        return AttentionPath(self.fp8, self.fault.bits if self.fault.hits(unit_name) else 0,
                             self.fp8 and self.fp8_output)

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
        out = FlashAttentionFunction.apply(q, k, v, self.softmax_scale, path, group, probe,
                                           self.runtime.low_path(self.unit_name)
                                           if probe is not None else None)
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
