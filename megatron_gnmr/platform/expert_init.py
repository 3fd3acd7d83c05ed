"""Routed experts that start from the same weights in every expert-parallel layout.

Under CPU initialisation megatron draws each linear's full weight from the default torch
generator and keeps this TP rank's slice, so every tensor-parallel layout starts from the
same model. Expert parallelism breaks that: an EP rank builds only its local experts, so at
EP=2 rank 1 draws experts 2-3 where EP=1 draws experts 0-1, and every parameter built after
them (the shared expert, the next layers) lands elsewhere in the stream too. This
`SequentialMLP` first consumes exactly the draws of the experts held by lower EP ranks and
afterwards those of the higher ranks' (megatron's expert linears draw one full
`init_method(torch.empty(out, in))` each: fc1 with the init method, fc2 with the output-layer
one), so each expert, and everything after, gets the numbers EP=1 gives it. Without CPU
initialisation (a GPU run's default) no layout reproduces another and nothing is skipped.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.moe.experts import SequentialMLP


class LayoutInvariantSequentialMLP(SequentialMLP):
    def __init__(self, num_local_experts, config, *args, **kwargs):
        skip = config.use_cpu_initialization and config.perform_initialization
        before, after = _experts_around(num_local_experts, config, kwargs.get("pg_collection"))
        if skip:
            _consume_expert_draws(config, before)
        super().__init__(num_local_experts, config, *args, **kwargs)
        if skip:
            _consume_expert_draws(config, after)


def _experts_around(num_local_experts: int, config, pg_collection) -> tuple[int, int]:
    """(experts on lower EP ranks, experts on higher EP ranks)."""
    if pg_collection is not None and getattr(pg_collection, "ep", None) is not None:
        rank = pg_collection.ep.rank()
    else:
        from megatron.core import parallel_state

        rank = parallel_state.get_expert_model_parallel_rank()
    before = rank * num_local_experts
    return before, config.num_moe_experts - before - num_local_experts


def _consume_expert_draws(config, experts: int) -> None:
    hidden, inner = config.hidden_size, config.moe_ffn_hidden_size
    fc1_out = 2 * inner if config.gated_linear_unit else inner
    for _ in range(experts):
        config.init_method(torch.empty(fc1_out, hidden))
        config.output_layer_init_method(torch.empty(hidden, inner))
