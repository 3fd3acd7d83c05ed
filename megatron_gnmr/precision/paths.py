"""Paths: how one unit runs its GEMMs, and the autograd function that emulates them.

A `GemmPath` names the quantization of each operand:

    forward   y  = Q_in(x) @ Q_w(W)^T
    backward  dx = Q_g(dy) @ Q_w(W)               (dgrad)
              dW = Q_g(dy)^T @ S(x)               (wgrad; S = Q_saved, or the forward operand)

`saved_input` is what the unit keeps for the weight-gradient GEMM (e.g. a 4-bit copy of x
for activation-quantization stress); None keeps the forward operand. NVFP4 quantizes the
weight-gradient GEMM's operands separately, along its reduction dimension (tokens), after a
random Hadamard transform (`wgrad_input`, `wgrad_grad`, `hadamard_signs`):

              dW = Q_wg(H dy)^T @ Q_wx(H x)       (H: 16 tokens at a time; H^T H = I)

A path with every operand None is not emulated at all: such a unit runs megatron's own
linear, so the recovery path of a BF16-recovery recipe is exactly the high-precision module.
The backward always uses what its forward saved, so a unit's backward runs its forward's path.

`RolePaths` runs each of a unit's three GEMMs (fprop, dgrad, wgrad) on a path of its own, as
Transformer Engine's per-operand quantizers can: each GEMM quantizes its operands by its own
path's specs, and an operand two GEMMs share (W_q between fprop and dgrad, dy_q between dgrad
and wgrad, x_q between fprop and wgrad) is quantized once when their specs agree and twice
when they differ. With the same path for all three it is the plain path, bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_gnmr.precision.scaling import QuantSpec, quantize


@dataclass(frozen=True)
class GemmPath:
    name: str
    input: QuantSpec | None = None
    weight: QuantSpec | None = None
    grad: QuantSpec | None = None
    saved_input: QuantSpec | None = None
    wgrad_input: QuantSpec | None = None
    """x for the weight-gradient GEMM, quantized along tokens (None: `saved_input`'s rule)."""
    wgrad_grad: QuantSpec | None = None
    """dy for the weight-gradient GEMM, quantized along tokens (None: the `grad` operand)."""
    hadamard_signs: tuple[float, ...] | None = None
    """The random Hadamard transform's signs, applied along tokens to both wgrad operands."""
    kernel: str = "emulated"
    """How the quantized GEMMs run, a name in `kernels.KERNELS`: `emulated` (fake-quantized
    operands, float GEMMs) or `torchao` (real FP8 GEMMs, `precision/torchao_linear.py`)."""

    def __post_init__(self):
        if (self.wgrad_input is None) != (self.wgrad_grad is None):
            raise ValueError("wgrad_input and wgrad_grad go together (both GEMM operands "
                             "are quantized along tokens, or neither)")
        if self.hadamard_signs is not None and self.wgrad_input is None:
            raise ValueError("the Hadamard transform needs the wgrad operands")

    @property
    def is_exact(self) -> bool:
        return not (self.input or self.weight or self.grad or self.saved_input
                    or self.wgrad_input or self.wgrad_grad)


GEMM_ROLES = ("fprop", "dgrad", "wgrad")


@dataclass(frozen=True)
class RolePaths:
    """A unit's fprop, dgrad and wgrad GEMMs, each on its own path (emulated kernels only).

    The operand attributes are those of the GEMM that computes the operand, so a probe reads
    it like a `GemmPath`'s."""

    fprop: GemmPath
    dgrad: GemmPath
    wgrad: GemmPath
    kernel: str = "emulated"

    @property
    def name(self) -> str:
        return "+".join(f"{role}:{getattr(self, role).name}" for role in GEMM_ROLES)

    @property
    def is_exact(self) -> bool:
        return all(getattr(self, role).is_exact for role in GEMM_ROLES)

    input = property(lambda self: self.fprop.input)
    weight = property(lambda self: self.fprop.weight)
    grad = property(lambda self: self.dgrad.grad)
    saved_input = property(lambda self: self.wgrad.saved_input)
    wgrad_input = property(lambda self: self.wgrad.wgrad_input)
    wgrad_grad = property(lambda self: self.wgrad.wgrad_grad)
    hadamard_signs = property(lambda self: self.wgrad.hadamard_signs)


def mixed_path(low: GemmPath, recovery: GemmPath, recovered_roles) -> GemmPath | RolePaths:
    """The path of a unit whose `recovered_roles` GEMMs run `recovery` and the rest `low`
    (all three recovered: `recovery` itself)."""
    roles = [recovery if role in recovered_roles else low for role in GEMM_ROLES]
    if all(path is roles[0] for path in roles):
        return roles[0]
    if low.kernel != "emulated" or recovery.kernel != "emulated":
        raise ValueError("per-GEMM recovery needs emulated kernels on both paths")
    return RolePaths(*roles)


def _roles(path) -> tuple[GemmPath, GemmPath, GemmPath]:
    return (path.fprop, path.dgrad, path.wgrad) if isinstance(path, RolePaths) \
        else (path, path, path)


def _maybe(x: torch.Tensor, spec: QuantSpec | None, group, rows_split: bool = False):
    """x quantized by `spec`. A per-tensor amax is reduced over the TP `group` (a sharded
    tensor scales like the whole one); a per-row amax only when TP splits the rows
    (`rows_split`: the row is the GEMM's K for x and W of a row-parallel linear, N for dy of
    a column-parallel one), since otherwise each rank holds whole, different rows."""
    if spec is None:
        return x
    if spec.granularity == "row" and not rows_split:
        group = None
    return quantize(x, spec, amax_group=group)


def _along_tokens(x: torch.Tensor, spec: QuantSpec, path: GemmPath, group) -> torch.Tensor:
    """[tokens, features] -> H x (if the path transforms), quantized in blocks along tokens."""
    matrix = x.reshape(-1, x.shape[-1])
    if path.hadamard_signs is not None:
        from megatron_gnmr.precision.nvfp4 import cached_hadamard, transform_tokens

        hadamard = cached_hadamard(path.hadamard_signs, x.device)
        matrix = transform_tokens(matrix, hadamard).to(x.dtype)
    return quantize(matrix.t(), spec, amax_group=group).t()


def saved_for_weight_gradient(x, x_q, path: GemmPath, group, k_split: bool = False):
    """What the forward keeps of x for dW (`x_q`: the forward's quantized input)."""
    if path.wgrad_input is not None:
        return _along_tokens(x, path.wgrad_input, path, group)
    return x_q if path.saved_input is None else _maybe(x, path.saved_input, group, k_split)


def weight_gradient(grad_output, g_q, saved, path: GemmPath, group) -> torch.Tensor:
    """dW from dy (`g_q`: the dgrad's quantized dy) and what the forward saved."""
    if path.wgrad_grad is not None:
        g = _along_tokens(grad_output, path.wgrad_grad, path, group)
    else:
        g = g_q.reshape(-1, g_q.shape[-1])
    return torch.matmul(g.t(), saved.reshape(-1, saved.shape[-1]))


class EmulatedLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, path: GemmPath, allreduce_dgrad: bool, tp_group,
                probe=None, parallel: str | None = None):
        k_split = parallel == "row"  # x and W split along K (N is split for "column")
        fprop, dgrad, wgrad = _roles(path)
        x_q = _maybe(x, fprop.input, tp_group, k_split)
        w_q = _maybe(weight, fprop.weight, tp_group, k_split)
        # The dgrad and wgrad GEMMs' own operands, shared with the fprop's where they agree.
        w_d = w_q if dgrad.weight == fprop.weight else _maybe(weight, dgrad.weight, tp_group,
                                                               k_split)
        x_w = x_q if wgrad.input == fprop.input else _maybe(x, wgrad.input, tp_group, k_split)
        saved = saved_for_weight_gradient(x, x_w, wgrad, tp_group, k_split)
        if probe is not None:  # measures only: nothing below reads what it computes
            probe.forward_operands(x, weight, path, x_q, w_q, saved, tp_group)
        keep_exact = probe is not None and probe.keeps_exact_input
        ctx.save_for_backward(saved, w_d, x if keep_exact else None)
        ctx.path, ctx.allreduce_dgrad, ctx.tp_group = path, allreduce_dgrad, tp_group
        ctx.has_bias, ctx.probe, ctx.n_split = bias is not None, probe, parallel == "column"
        out = torch.matmul(x_q, w_q.t())
        return out + bias if bias is not None else out

    @staticmethod
    def backward(ctx, grad_output):
        saved, w_d, x_exact = ctx.saved_tensors
        _, dgrad, wgrad = _roles(ctx.path)
        g_q = _maybe(grad_output, dgrad.grad, ctx.tp_group, ctx.n_split)
        grad_input = torch.matmul(g_q, w_d)
        if ctx.allreduce_dgrad:  # column-parallel: the input was replicated across TP
            torch.distributed.all_reduce(grad_input, group=ctx.tp_group)
        # A frozen weight (the base of a LoRA fine-tune) gets no weight-gradient GEMM.
        g_w = g_q if wgrad.grad == dgrad.grad else _maybe(grad_output, wgrad.grad,
                                                          ctx.tp_group, ctx.n_split)
        grad_weight = weight_gradient(grad_output, g_w, saved, wgrad, ctx.tp_group) \
            if ctx.needs_input_grad[1] else None
        grad_bias = g_q.reshape(-1, g_q.shape[-1]).sum(dim=0) if ctx.has_bias else None
        if ctx.probe is not None:
            ctx.probe.grad_operand(grad_output, ctx.path, g_q, ctx.tp_group)
            if x_exact is not None and grad_weight is not None:
                ctx.probe.weight_gradient(grad_output, x_exact, ctx.path, grad_weight,
                                          ctx.tp_group)
        return grad_input, grad_weight, grad_bias, None, None, None, None, None


def emulated_linear(x, weight, bias, path: GemmPath, allreduce_dgrad: bool, tp_group,
                    probe=None, parallel: str | None = None):
    """`parallel`: the linear's TP split, `column` (N) or `row` (K); None: not split."""
    return EmulatedLinearFunction.apply(x, weight, bias, path, allreduce_dgrad, tp_group, probe,
                                        parallel)
