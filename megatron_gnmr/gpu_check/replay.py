"""One unit's three GEMMs replayed on inputs captured inside a training step, and compared
bit for bit: gpu_check's tools for parts (a) and (d).

A `Capture` records a unit's input, weights, output and output gradient in the next training
step (its first micro-batch). `replay` runs the unit again on them and returns its forward
output, its input gradient (dgrad) and its parameters' gradients (wgrad). The gradients come
from `torch.autograd.grad`, which neither accumulates into `.grad` nor runs the
AccumulateGrad nodes on which megatron's DDP hooks its gradient reduction, so a replay leaves
the training state as it was. `bitwise_equal` compares bit patterns, not values: -0.0 is not
0.0, and a NaN equals only the same NaN.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

# Integer views of the same width, to compare bit patterns.
_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass
class GemmResults:
    output: torch.Tensor
    dgrad: torch.Tensor | None = None
    wgrads: dict[str, torch.Tensor | None] = field(default_factory=dict)


def first_output(output):
    """megatron's linears return (output, bias); TE's and torch's an output."""
    return output[0] if isinstance(output, (tuple, list)) else output


def trainable(module: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    return {name: p for name, p in module.named_parameters() if p.requires_grad}


def captured_parameters(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in trainable(module).items()}


def refuse_fused_wgrad(module: torch.nn.Module) -> None:
    """With the weight gradient accumulated into `main_grad` inside the GEMM (TE's
    `fuse_wgrad_accumulation`, megatron's `gradient_accumulation_fusion`) autograd returns a
    placeholder, which a replay must not compare."""
    if getattr(module, "fuse_wgrad_accumulation", False) or \
            getattr(module, "gradient_accumulation_fusion", False):
        raise RuntimeError(f"{type(module).__name__} accumulates its weight gradient into "
                           "main_grad inside the GEMM (--gradient-accumulation-fusion), where a "
                           "replay cannot read it; run gpu_check without that flag")


def replay(module: torch.nn.Module, x: torch.Tensor, dy: torch.Tensor | None = None,
           context=contextlib.nullcontext) -> GemmResults:
    """The unit's forward on `x` inside `context()` (an FP8 autocast: the forward's setting
    is what its backward inherits), and with `dy` its dgrad and wgrad."""
    x = x.detach().clone().requires_grad_(True)  # as in training, where inputs need grads
    with context():
        out = first_output(module(x))
    if dy is None:
        return GemmResults(out.detach())
    refuse_fused_wgrad(module)
    params = trainable(module)
    grads = torch.autograd.grad(out, [x, *params.values()], dy, allow_unused=True)
    return GemmResults(out.detach(), grads[0], dict(zip(params, grads[1:])))


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().contiguous().view(_BITS[tensor.element_size()])


def bitwise_equal(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


def difference(a: torch.Tensor | None, b: torch.Tensor | None) -> str:
    """How two tensors differ, in a few words."""
    if a is None or b is None:
        return f"{'missing' if a is None else 'present'} against " \
               f"{'missing' if b is None else 'present'}"
    if a.shape != b.shape or a.dtype != b.dtype:
        return f"{a.dtype} {tuple(a.shape)} against {b.dtype} {tuple(b.shape)}"
    unequal = _bits(a) != _bits(b)
    diff = (a.double() - b.double()).abs()
    return f"{int(unequal.sum())} of {a.numel()} elements differ, max |diff| " \
           f"{float(diff.nan_to_num(nan=float('inf')).max()):.2e}"


def mismatches(got: GemmResults, want: GemmResults) -> list[str]:
    """What differs bitwise between two replays: forward, dgrad, each parameter's wgrad."""
    pairs = [("forward", got.output, want.output)]
    if got.dgrad is not None or want.dgrad is not None:
        pairs.append(("dgrad", got.dgrad, want.dgrad))
    for name in sorted(set(got.wgrads) | set(want.wgrads)):
        pairs.append((f"wgrad {name}", got.wgrads.get(name), want.wgrads.get(name)))
    return [f"{what}: {difference(a, b)}" for what, a, b in pairs if not bitwise_equal(a, b)]


@contextlib.contextmanager
def parameters_set(module: torch.nn.Module, values: dict[str, torch.Tensor]):
    """The module's trainable parameters hold `values` inside, their own values after (copied
    in place: megatron's buffers keep pointing at the same storage)."""
    params = trainable(module)
    if set(params) != set(values):
        raise ValueError(f"{type(module).__name__} has parameters {sorted(params)}, the "
                         f"captured ones are {sorted(values)}")
    saved = {name: p.detach().clone() for name, p in params.items()}
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(values[name])
    try:
        yield module
    finally:
        with torch.no_grad():
            for name, p in params.items():
                p.copy_(saved[name])


@contextlib.contextmanager
def no_weight_cache(module: torch.nn.Module):
    """A forward that casts the weights anew and caches nothing: megatron's TE linears pass
    `is_first_microbatch=None` to TE when `disable_parameter_transpose_cache` is set (else
    True on a step's first micro-batch: cast and cache; False after: use the cache). Modules
    without a weight cache are left as they are."""
    if not hasattr(module, "disable_parameter_transpose_cache"):
        yield module
        return
    saved = module.disable_parameter_transpose_cache, getattr(module, "is_first_microbatch", None)
    module.disable_parameter_transpose_cache = True
    try:
        yield module
    finally:
        module.disable_parameter_transpose_cache, module.is_first_microbatch = saved


class Capture:
    """A unit's input, weights (as the forward read them), output and output gradient in the
    first forward after it is made (later micro-batches are not recorded)."""

    def __init__(self, module: torch.nn.Module):
        self.x = self.params = self.y = self.dy = None
        self._handles = [module.register_forward_pre_hook(self._before),
                         module.register_forward_hook(self._after)]

    def _before(self, module, args) -> None:
        if self.x is None:
            if not args or not torch.is_tensor(args[0]):
                raise RuntimeError(f"{type(module).__name__} was called without a positional "
                                   "input tensor; gpu_check captures args[0]")
            self.x = args[0].detach().clone()
            self.params = captured_parameters(module)

    def _after(self, module, args, output) -> None:
        if self.y is None:
            y = first_output(output)
            self.y = y.detach().clone()
            if y.requires_grad:
                y.register_hook(self._gradient)

    def _gradient(self, grad: torch.Tensor) -> None:
        if self.dy is None:
            self.dy = grad.detach().clone()

    def complete(self) -> bool:
        return self.x is not None and self.y is not None and self.dy is not None

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
