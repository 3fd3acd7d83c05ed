"""--compile: torch.compile per transformer layer, with the controller's choice of path a
guarded choice of at most two compiled variants per unit.

Each decoder layer of this rank is a compiled region of its own. A unit linear's path is the
controller's choice for the step; traced into the layer, the choice would be guarded by the
whole plan (the set of recovered unit names), so that any decision anywhere recompiles every
layer. Instead, the layer's graph stops at each unit linear, and the unit's GEMMs are a
compiled region of their own (`_forward_impl`: the quantizers, the GEMM, its backward),
reading the path from a per-unit view of the runtime (`PinnedRuntime`) that is set, eagerly,
before each call. Dynamo guards on which of the runtime's two path objects the view holds:
a unit has at most two compiled variants, the low-cost and the recovery path, each compiled
the first time the unit runs it, and a controller switching for thousands of steps
compiles nothing more.

What stays eager, as without --compile: evaluation and any forward without gradients
(their graphs would be more variants), a unit whose low path the controller measures in this
step (its probes read tensors on the host), and the emulated core attention units (their
path, fault and probes are read inside). `CompileLog` counts what dynamo compiled, logged with
each step's metrics: `compile/graphs` in all, `compile/recompiles` after the first step.
"""

from __future__ import annotations

import functools

import torch

from megatron_gnmr.platform.compilation import compile_options, compiled_graphs

UNIT_VARIANTS = 2
"""A unit's compiled variants: its low-cost path and its recovery path."""
LAYER_VARIANTS = 8
"""A layer region's: its graph pieces between unit linears (micro-batch shapes and the
first/last pipeline stage's inputs add variants; nothing the controller decides does)."""


class PinnedRuntime:
    """A unit linear's view of the run's PrecisionRuntime: the path set before the call
    (`path`; None: ask the runtime, as without --compile)."""

    def __init__(self, runtime):
        self.runtime = runtime
        self.path = None

    def path_for(self, unit_name):
        return self.runtime.path_for(unit_name) if self.path is None else self.path

    def probe_for(self, unit_name):
        return self.runtime.probe_for(unit_name) if self.path is None else None

    def __getattr__(self, name):  # recipe, plan, recovered: the runtime's
        if name == "runtime":  # not set yet (a copy under construction)
            raise AttributeError(name)
        return getattr(self.runtime, name)


def compile_layers(model_chunks: list[torch.nn.Module]) -> int:
    """Compile every decoder layer of this rank's chunks, its unit linears as regions of
    their own; the number of layers compiled."""
    from megatron_gnmr.model import unwrap
    from megatron_gnmr.precision.attention_unit import EmulatedFlashAttention

    layers = [layer for chunk in model_chunks for layer in unwrap(chunk).decoder.layers]
    for layer in layers:
        for module in layer.modules():
            if getattr(module, "precision_runtime", None) is not None and \
                    hasattr(module, "unit_name"):
                _compile_unit_linear(module)
            elif isinstance(module, EmulatedFlashAttention):
                module.forward = torch._dynamo.disable(module.forward)
        _compile_layer(layer)
    return len(layers)


def _trains(module: torch.nn.Module) -> bool:
    return module.training and torch.is_grad_enabled()


def _compile_layer(layer: torch.nn.Module) -> None:
    eager = layer.forward
    compiled = torch.compile(eager, dynamic=False, **compile_options(LAYER_VARIANTS))

    @functools.wraps(eager)
    def forward(*args, **kwargs):
        return compiled(*args, **kwargs) if _trains(layer) else eager(*args, **kwargs)

    layer.forward = forward


def _compile_unit_linear(linear: torch.nn.Module) -> None:
    runtime = linear.precision_runtime
    pinned = PinnedRuntime(runtime)
    linear.precision_runtime = pinned
    eager = linear._forward_impl
    compiled = torch.compile(eager, dynamic=False, **compile_options(UNIT_VARIANTS))

    @torch._dynamo.disable  # the layer's graph stops here: the choice is made eagerly
    def forward_impl(*args, **kwargs):
        if not _trains(linear) or runtime.probe_for(linear.unit_name) is not None:
            pinned.path = None
            return eager(*args, **kwargs)
        pinned.path = runtime.path_for(linear.unit_name)
        return compiled(*args, **kwargs)

    linear._forward_impl = forward_impl


class CompileLog:
    """The graphs dynamo compiled, as step metrics (none without --compile)."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.start = compiled_graphs()
        self.after_first: int | None = None

    def after_step(self, step: int) -> dict:
        if not self.enabled:
            return {}
        graphs = compiled_graphs() - self.start
        if self.after_first is None:
            self.after_first = graphs
        return {"compile/graphs": graphs, "compile/recompiles": graphs - self.after_first}
