"""Run under torchrun: per-unit norms against a float64 reference built from the full
gradients, and the collectives of one controlled optimizer step, counted.

The reference uses neither the controller's slots and groups nor DDP's reduction: the
backward runs with megatron's gradient finalisation held back, so every rank still holds its
own, unreduced gradients; the reference averages them over the data-parallel replicas in
float64 (megatron's convention: the sum over the parameter's reduction group divided by the
data-parallel size), gathers TP shards, and exchanges each rank's per-unit values as Python
objects; a unit held by several ranks must agree across them. Only then is the real
finalisation run (all-reduce, or reduce-scatter with the distributed optimizer) and the
controller asked.
"""

import json
import sys

import torch

from megatron_gnmr.arguments import parse_config
from megatron_gnmr.platform import quiet_known_warnings
from megatron_gnmr.training import distributed
from megatron_gnmr.training.loop import Trainer

COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
               "broadcast", "all_to_all_single", "barrier", "all_gather_object")


def full_gradient_float64(param):
    from megatron.core import parallel_state

    expert = getattr(param, "allreduce", True) is False
    replicas = parallel_state.get_expert_data_parallel_group() if expert else \
        parallel_state.get_data_parallel_group()
    grad = param.main_grad.double()
    torch.distributed.all_reduce(grad, group=replicas)
    grad /= parallel_state.get_data_parallel_world_size()
    tp_group = parallel_state.get_expert_tensor_parallel_group() if expert else \
        parallel_state.get_tensor_model_parallel_group()
    size = torch.distributed.get_world_size(tp_group)
    if getattr(param, "tensor_model_parallel", False) and size > 1:
        parts = [torch.empty_like(grad) for _ in range(size)]
        torch.distributed.all_gather(parts, grad, group=tp_group)
        grad = torch.cat(parts, dim=param.partition_dim)
    return grad


def reference_norms(registry) -> list[float]:
    local = {}
    for unit in range(registry.num_units):
        if registry.modules.get(unit) is not None:
            local[unit] = sum(float(full_gradient_float64(p).square().sum())
                              for p in registry.local_parameters(unit)) ** 0.5
    everyone = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everyone, local)
    norms = []
    for unit in range(registry.num_units):
        values = [held[unit] for held in everyone if unit in held]
        assert values and max(values) - min(values) <= 1e-12 * max(values), (unit, values)
        norms.append(values[0])
    return norms


def counted(calls: list, function):
    originals = {name: getattr(torch.distributed, name) for name in COLLECTIVES}

    def counting(name):
        def wrapper(*args, **kwargs):
            calls.append(name)
            return originals[name](*args, **kwargs)
        return wrapper

    for name in COLLECTIVES:
        setattr(torch.distributed, name, counting(name))
    try:
        return function()
    finally:
        for name, original in originals.items():
            setattr(torch.distributed, name, original)


def main(argv):
    from megatron.core.distributed import finalize_model_grads

    from megatron_gnmr.model import unwrap

    quiet_known_warnings()
    config = parse_config(argv)
    distributed.initialize(config)
    trainer = Trainer(config)
    for chunk in trainer.model:
        chunk.zero_grad_buffer()
    tconfig = unwrap(trainer.model[0]).config
    tconfig.finalize_model_grads_func = None  # held back: the reference reads local grads
    trainer._forward_backward(trainer.train_reader.step_batches(0), False)
    registry = trainer.controller.registry
    reference = reference_norms(registry)
    finalize_model_grads(trainer.model)

    controller_calls, step_calls = [], []
    outcome = counted(controller_calls, lambda: trainer.controller.after_backward(
        1, trainer.optimizer, loss=1.0))
    applied = counted(step_calls,
                      lambda: outcome.apply and trainer.optimizer.step_with_ready_grads())
    counted(controller_calls, lambda: trainer.controller.decide(1, frozenset()))

    if torch.distributed.get_rank() == 0:
        # After the first decision the policy's running sums are exactly this step's norms.
        norms = trainer.controller.policy.norm_sum.tolist()
        print(json.dumps({"controller_collectives": controller_calls,
                          "step_collectives": step_calls, "norms": norms,
                          "reference": reference, "total": outcome.grad_norm,
                          "skipped": int(not applied)}))
    distributed.shutdown()


if __name__ == "__main__":
    main(sys.argv[1:])
