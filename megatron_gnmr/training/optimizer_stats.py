"""Megatron-LM's optional step statistics, `--log-params-norm` and `--log-num-zeros-in-grad`,
from megatron-core's optimizer as Megatron-LM computes them: the L2 norm of the parameters the
optimizer updates (its fp32 main copies; shards with the distributed optimizer), each counted
once over the model-parallel ranks (shared and tensor-parallel duplicates left out), reduced
over the optimizer's own grad-stats group; and the number of zero gradient elements
(megatron-core's `count_zeros`). One small all-reduce each, only when asked for."""

from __future__ import annotations

import math


def params_norm(optimizer) -> float:
    """Collective: the L2 norm of the parameters (megatron's `calc_params_l2_norm`'s count)."""
    from megatron.core.optimizer.clip_grads import get_grad_norm_fp32
    from megatron.core.transformer.module import param_is_not_shared
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

    squared = 0.0
    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        kept = [p.detach() for p in part.get_parameters()
                if param_is_not_shared(p) and param_is_not_tensor_parallel_duplicate(p)]
        squared += float(get_grad_norm_fp32(
            kept, grad_stats_parallel_group=part.get_grad_stats_parallel_group())) ** 2
    return math.sqrt(squared)


def zeros_in_grad(optimizer) -> float:
    """Collective: the gradient elements that are exactly zero (megatron-core's count)."""
    return float(optimizer.count_zeros())
