"""How many parameters a family's model has, counted from the config before anything is built:
on one rank of a layout (the device memory estimate, a checkpoint's host memory) or in the
whole model (what a checkpoint writes)."""

from __future__ import annotations

import dataclasses

from megatron_gnmr.model_families import family_of

GIB = 1024 ** 3


def parameters_per_rank(config) -> tuple[int, int]:
    """(dense, expert) parameters on the busiest pipeline stage of one rank."""
    m, p = config.model, config.parallel
    tp, pp, ep = (p.tensor_model_parallel_size, p.pipeline_model_parallel_size,
                  p.expert_model_parallel_size)
    h, f = m.hidden_size, m.ffn_hidden_size
    attention = sum(linear.in_features * linear.out_features
                    for linear in family_of(config).attention_linears(config)) // tp
    norms = 2 * h
    layers = m.num_layers // pp
    dense_mlp = 3 * h * f // tp
    if m.num_experts:
        shared = m.moe_shared_expert_intermediate_size or 0
        moe_mlp = h * m.num_experts + 3 * h * shared // tp  # the router and the shared expert
        experts = (m.num_experts // ep) * 3 * h * (m.moe_ffn_hidden_size or f) // tp
    else:
        moe_mlp, experts = dense_mlp, 0

    def stage(first_layer: int) -> tuple[int, int]:
        dense_layers = max(0, min(m.moe_first_dense_layers if m.num_experts else m.num_layers,
                                  first_layer + layers) - first_layer)
        moe_layers = layers - dense_layers
        return (layers * (attention + norms) + dense_layers * dense_mlp
                + moe_layers * (moe_mlp if m.num_experts else dense_mlp)), moe_layers * experts

    vocab = config.data.vocab_size * h // tp
    (first, first_experts), (last, last_experts) = stage(0), stage(m.num_layers - layers)
    first += vocab + (vocab + h if pp == 1 else 0)
    last += vocab + h
    return (first, first_experts) if first + first_experts >= last + last_experts \
        else (last, last_experts)


def whole_model_parameters(config) -> int:
    """Every parameter of the model, counted once (the layout's sharding undone)."""
    single = dataclasses.replace(config.parallel, tensor_model_parallel_size=1,
                                 pipeline_model_parallel_size=1, expert_model_parallel_size=1)
    dense, experts = parameters_per_rank(dataclasses.replace(config, parallel=single))
    return dense + experts
