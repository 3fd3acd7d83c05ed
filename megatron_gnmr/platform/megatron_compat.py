"""Every difference between the megatron-core releases we support, absorbed in one place.

Supported: 0.16.1 (the newest for Python 3.11) and 0.19.x (what Python 3.12 clusters get).
Nothing outside this module may branch on megatron's version.

Layer specs. The unit linears (the attention linears a model family names, and each dense,
routed or shared expert's fc1/fc2) are swapped in a megatron layer spec for the project's
path-routed subclasses. Up to 0.17 every node of a spec is a
`ModuleSpec(module, submodules)`; from 0.18 the MLP and MoE nodes are builders,
`functools.partial(MLP.as_mlp_submodule, submodules=MLPSubmodules(...))` and
`partial(MoELayer, submodules=MoESubmodules(...))`, whose submodules live in the partial's
keywords. `submodules_of` reads both forms, so the
replacement below is written once.
"""

from __future__ import annotations

import contextlib
import copy
import functools
from typing import Any

# megatron's SwiGLU MLP linears, dense or per expert, in every model family: fc1 is the fused
# gate and up projection (column-parallel), fc2 the down projection (row-parallel).
MLP_LINEARS = ("linear_fc1", "linear_fc2")


def submodules_of(node: Any) -> Any:
    """The submodules object of a spec node: `ModuleSpec.submodules`, or the `submodules`
    keyword of a builder partial (megatron-core >= 0.18); None for a plain class."""
    if isinstance(node, functools.partial):
        return node.keywords.get("submodules")
    return getattr(node, "submodules", None)


def mlp_submodules(layer_spec: Any) -> Any:
    """The MLPSubmodules holding fc1/fc2 of a layer spec: the dense MLP's, or the routed
    experts' (shared experts are not units)."""
    mlp = submodules_of(submodules_of(layer_spec).mlp)
    experts = getattr(mlp, "experts", None)
    return submodules_of(experts) if experts is not None else mlp


def shared_expert_submodules(layer_spec: Any) -> Any:
    """The MLPSubmodules of an MoE layer spec's shared expert (None: a dense layer). The spec
    always has one; megatron builds it only if `moe_shared_expert_intermediate_size` is
    set."""
    mlp = submodules_of(submodules_of(layer_spec).mlp)
    shared = getattr(mlp, "shared_experts", None)
    return submodules_of(shared) if shared is not None else None


def attention_submodules(layer_spec: Any) -> Any:
    return submodules_of(submodules_of(layer_spec).self_attention)


def replace_attention_linears(layer_spec: Any, replacements: dict[str, type]) -> Any:
    """A copy of `layer_spec` whose attention submodules named in `replacements` are built
    from the given classes."""
    spec = copy.deepcopy(layer_spec)
    attention = attention_submodules(spec)
    for name, cls in replacements.items():
        setattr(attention, name, cls)
    return spec


def route_mlp_linears(layer_spec: Any, route) -> Any:
    """A copy of `layer_spec` whose MLP linears (`MLP_LINEARS` of the dense MLP or the routed
    experts, and of the shared expert) are built from `route(megatron's class)`."""
    spec = copy.deepcopy(layer_spec)
    mlps = [mlp_submodules(spec), shared_expert_submodules(spec)]
    for mlp in (mlp for mlp in mlps if mlp is not None):
        for name in MLP_LINEARS:
            setattr(mlp, name, route(getattr(mlp, name)))
    return spec


def mlp_linear_classes(layer_spec: Any) -> dict[str, type]:
    """The classes a layer spec builds its (dense or routed) MLP linears from."""
    mlp = mlp_submodules(layer_spec)
    return {name: getattr(mlp, name) for name in MLP_LINEARS}


def local_layer_spec(num_experts: int | None, **family_keywords):
    """megatron's local (no Transformer Engine) layer: RMSNorm, per-expert GEMMs, the
    attention a model family asks for (`family_keywords`, e.g. `multi_latent_attention`).
    Where megatron would use its torch-norm wrapper (no apex), the norms are `TorchRMSNorm`,
    which runs under sequence parallelism too; the routed experts start from the same weights
    in every expert-parallel layout (`expert_init.py`)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=False,
                                    normalization="RMSNorm", **family_keywords)
    layer = submodules_of(spec)
    if num_experts:
        from megatron_gnmr.platform.expert_init import LayoutInvariantSequentialMLP

        moe = submodules_of(layer.mlp)
        moe.experts = _built_from(moe.experts, LayoutInvariantSequentialMLP)
    for name in ("input_layernorm", "pre_mlp_layernorm"):
        if _is_torch_norm_wrapper(getattr(layer, name)):
            setattr(layer, name, TorchRMSNorm)
    attention = attention_submodules(spec)
    for name, node in vars(attention).items():  # the query / key / latent norms, if any
        if _is_torch_norm_wrapper(node):
            setattr(attention, name, TorchRMSNorm)
    return spec


def _built_from(node: Any, module: type) -> Any:
    """A spec node building `module` instead, with the same submodules (either form)."""
    if isinstance(node, functools.partial):
        return functools.partial(module, *node.args, **node.keywords)
    node = copy.copy(node)
    node.module = module
    return node


def decoder_block_spec(layer_specs: list, transformer_config: Any) -> Any:
    """The decoder block of this pipeline stage from one spec per (global) layer: its layers
    and a final norm of the layers' kind. (Given a bare layer spec, megatron picks the final
    norm by what is installed: its torch-norm wrapper without apex, which refuses sequence
    parallelism.)"""
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    norm = submodules_of(layer_specs[0]).input_layernorm
    uniform = all(spec is layer_specs[0] for spec in layer_specs)
    if norm is not TorchRMSNorm:
        if uniform:
            return layer_specs[0]  # megatron's own choice of final norm
        from megatron.core.extensions.transformer_engine import TENorm

        norm = TENorm
    offset = get_transformer_layer_offset(transformer_config)
    layers = get_num_layers_to_build(transformer_config)  # this stage's, as megatron counts
    return TransformerBlockSubmodules(layer_specs=layer_specs[offset:offset + layers],
                                      layer_norm=norm)


def _is_torch_norm_wrapper(node: Any) -> bool:
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    return node is WrappedTorchNorm or getattr(node, "module", None) is WrappedTorchNorm


class TorchRMSNorm:
    """`torch.nn.RMSNorm`, built as megatron builds its norms, that works with sequence
    parallelism. megatron's `WrappedTorchNorm` asserts `not config.sequence_parallel`; all
    sequence parallelism asks of a norm is that its weight be marked `sequence_parallel`,
    so that `finalize_model_grads` sums the weight's gradient over the TP ranks (each saw
    its own part of the sequence), as TE's and apex's norms do."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **unused):
        import torch

        kind = zero_centered_rms_norm() if config.layernorm_zero_centered_gamma \
            else torch.nn.RMSNorm
        norm = kind(normalized_shape=hidden_size, eps=eps)
        norm.weight.sequence_parallel = config.sequence_parallel
        return norm


@functools.lru_cache(maxsize=None)
def zero_centered_rms_norm() -> type:
    """The class (built on first use: this module imports no torch at import time)."""
    import torch

    class ZeroCenteredRMSNorm(torch.nn.RMSNorm):
        """RMSNorm whose weight holds gamma - 1 (Megatron's --apply-layernorm-1p, as TE's
        and apex's norms store it): initialised to 0, applied as weight + 1."""

        def reset_parameters(self) -> None:
            if self.elementwise_affine:
                torch.nn.init.zeros_(self.weight)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.rms_norm(x, self.normalized_shape, self.weight + 1,
                                                self.eps)

    return ZeroCenteredRMSNorm


def te_layer_spec(num_experts: int | None, **family_keywords):
    """megatron's Transformer Engine layer. Experts stay one TE GEMM each (`SequentialMLP`,
    `moe_grouped_gemm=False`): TE's grouped GEMM runs all local experts in one kernel, so
    one expert could not run BF16 while the others run FP8."""
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_with_transformer_engine_spec,
    )

    return get_gpt_layer_with_transformer_engine_spec(num_experts=num_experts,
                                                      moe_grouped_gemm=False, **family_keywords)


def distributed_optimizer_parts(optimizer: Any) -> list:
    """The distributed optimizers inside `optimizer` (megatron chains one per parameter
    kind: dense, expert), in a fixed order; empty without --use-distributed-optimizer."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return [part for part in getattr(optimizer, "chained_optimizers", [optimizer])
            if isinstance(part, DistributedOptimizer)]


def distributed_optimizer_shards(optimizer: Any) -> dict[int, tuple[int, int]]:
    """{id(model parameter): (start, end)}: the range of each parameter's flattened gradient
    that this rank's distributed optimizer owns (after DDP's reduce-scatter, the only range
    of `main_grad` that holds reduced values). Parameters owned elsewhere are absent.
    Read from megatron's own map (`_get_model_param_range_map`, 0.16 to 0.19)."""
    shards = {}
    for part in distributed_optimizer_parts(optimizer):
        for param in part.model_param_gbuf_map:
            owned = part._get_model_param_range_map(param)["param"]
            shards[id(param)] = (owned.start, owned.end)
    return shards


# 0.16.1 without Transformer Engine: `moe_utils` binds these only inside its TE import block,
# and the router reads `te_general_gemm` on every forward (NameError); 0.19.x binds them to
# None. Absent TE, not absent CUDA, is the condition: a CUDA machine without TE hits it too.
MOE_TE_HELPERS = ("te_general_gemm", "fused_compute_score_for_moe_aux_loss", "fused_moe_aux_loss",
                  "fused_permute", "fused_permute_with_probs", "fused_sort_chunks_by_index",
                  "fused_sort_chunks_by_index_with_probs", "fused_topk_with_score_function",
                  "fused_unpermute")


def bind_missing_moe_helpers() -> None:
    """Give every TE helper megatron's MoE code reads a name (None: megatron's own fallback)
    where this release left it unbound."""
    from megatron.core.transformer.moe import moe_utils

    for name in MOE_TE_HELPERS:
        if not hasattr(moe_utils, name):
            setattr(moe_utils, name, None)


def tell_mla_whether_te_is_there() -> None:
    """0.16.1 without Transformer Engine: megatron's TE extension module imports anyway (its
    `te` is a MagicMock), so `multi_latent_attention` sets HAVE_TE and binds `TELinear` to a
    mock, and MLA's constructor fails on `isinstance(self.linear_proj, TELinear)`. Give it
    the extension's own answer (0.19.x imports the extension's HAVE_TE: right already)."""
    from megatron.core.extensions import transformer_engine as te_extension
    from megatron.core.transformer import multi_latent_attention

    if multi_latent_attention.HAVE_TE and not te_extension.HAVE_TE:
        multi_latent_attention.HAVE_TE = False


@contextlib.contextmanager
def zero_adam_state(optimizer: Any):
    """Within: every inner torch Adam that has not stepped yet holds a (zero) state, as after
    its first step; after: none again. megatron's distributed optimizer builds the sharded
    state dict a checkpoint is loaded into from its own state, and with torch's Adam (no apex,
    no Transformer Engine: a CPU machine) reads the step count from each parameter's state
    (0.16 to 0.19 `DistributedOptimizer.state_dict`); its `load_state_dict` then allocates the
    state itself when there is none, and only then. Nothing a run computes reads these zeros.

    Only torch's Adam (AdamW is one) keeps a per-parameter `step`. Transformer Engine's
    FusedAdam (megatron's optimizer wherever TE imports) keeps it in the parameter groups and
    maps state names through a table without `step` (`get_unscaled_state`: a KeyError at every
    resume), apex's keeps it in the groups too: those are left empty, as megatron expects."""
    import torch

    filled = []
    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(part, "optimizer", None)
        if not isinstance(inner, torch.optim.Adam) or len(inner.state):
            continue
        filled.append(inner)
        for group in inner.param_groups:
            for param in group["params"]:
                inner.state[param] = {"step": torch.zeros((), dtype=torch.float32),
                                      "exp_avg": torch.zeros_like(param),
                                      "exp_avg_sq": torch.zeros_like(param)}
    try:
        yield
    finally:
        for inner in filled:
            inner.state.clear()


@functools.lru_cache(maxsize=None)
def fix_torch_adam_reshard() -> None:
    """megatron's fully reshardable distributed-optimizer load, with torch's own Adam (no
    apex, no Transformer Engine: a CPU machine): its `load_state_dict` gives every parameter's
    state a `step` (torch's Adam keeps one), then copies the checkpoint's per-parameter
    tensors over that state key by key, and the checkpoint holds no per-parameter `step` (it
    is saved once, in the parameter groups): a KeyError (0.16.1). The step is the one already
    set (the checkpoint's), so the copy keeps it, also where the tensors hold one (the
    DP-reshardable form hands back `zero_adam_state`'s zero step, which would reset it). And
    that step is ONE tensor shared by every parameter's state, which torch's Adam increments
    in place once per parameter per step (the bias correction then runs ahead: a resume that
    is not exact), so each parameter gets its own copy. With apex or TE, nothing is changed.

    Whatever the optimizer: the DP-reshardable load copies the checkpoint into the main
    parameters outside `torch.no_grad` (0.16.1 `load_parameter_state_from_dp_reshardable`),
    and where a main parameter is a view of the model's (float32 runs) autograd refuses the
    in-place copy; the load runs under no_grad, as its fully reshardable sibling does."""
    import torch
    from megatron.core.optimizer import distrib_optimizer

    cls = distrib_optimizer.DistributedOptimizer
    dp_load = getattr(cls, "load_parameter_state_from_dp_reshardable", None)
    if dp_load is not None:
        cls.load_parameter_state_from_dp_reshardable = torch.no_grad()(dp_load)
    if getattr(distrib_optimizer, "HAVE_APEX_OR_TE", True):
        return
    original = cls._set_main_param_and_optimizer_states

    def set_states(self, model_param, tensors):
        group_index, group_order = self.model_param_group_index_map[model_param]
        main_param = self.optimizer.param_groups[group_index]["params"][group_order]
        state = self.optimizer.state[main_param]
        if "step" in state:  # the checkpoint's step, set by load_state_dict before this
            tensors = {**tensors, "step": state["step"]}
        return original(self, model_param, tensors)

    cls._set_main_param_and_optimizer_states = set_states
    load = cls.load_state_dict

    def load_state_dict(self, state_dict):
        load(self, state_dict)
        for state in self.optimizer.state.values():
            if "step" in state:
                state["step"] = state["step"].clone()

    cls.load_state_dict = load_state_dict
