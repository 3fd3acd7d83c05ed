"""Run under torchrun: per-unit norms against a float64 reference built from the gathered
full gradients, and the collectives of one controlled optimizer step, counted.

The reference does not use the controller's slots or groups: each rank measures the units
whose modules it holds (gathering TP shards), and the per-unit values of all ranks are
exchanged as Python objects; a unit held by several ranks (data-parallel replicas) must
agree across them.
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


def full_norm_float64(params) -> float:
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    size = torch.distributed.get_world_size(group)
    total = 0.0
    for param in params:
        grad = param.main_grad.double()
        if getattr(param, "tensor_model_parallel", False) and size > 1:
            parts = [torch.empty_like(grad) for _ in range(size)]
            torch.distributed.all_gather(parts, grad, group=group)
            grad = torch.cat(parts, dim=param.partition_dim)
        total += float(grad.square().sum())
    return total ** 0.5


def reference_norms(registry) -> list[float]:
    local = {u: full_norm_float64(registry.local_parameters(u))
             for u in range(registry.num_units) if registry.modules.get(u) is not None}
    everyone = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everyone, local)
    norms = []
    for unit in range(registry.num_units):
        values = [held[unit] for held in everyone if unit in held]
        assert values and max(values) - min(values) <= 1e-12 * max(values), (unit, values)
        norms.append(values[0])
    return norms


def main(argv):
    quiet_known_warnings()
    config = parse_config(argv)
    distributed.initialize(config)
    trainer = Trainer(config)
    for chunk in trainer.model:
        chunk.zero_grad_buffer()
    trainer._forward_backward(trainer.train_reader.step_batches(0), False)
    registry = trainer.controller.registry
    reference = reference_norms(registry)

    calls = []
    originals = {name: getattr(torch.distributed, name) for name in COLLECTIVES}

    def counting(name):
        def wrapper(*args, **kwargs):
            calls.append(name)
            return originals[name](*args, **kwargs)
        return wrapper

    for name in COLLECTIVES:
        setattr(torch.distributed, name, counting(name))
    outcome = trainer.controller.after_backward(1, trainer.optimizer, loss=1.0, alarmed=frozenset())
    applied = outcome.apply and trainer.optimizer.step_with_ready_grads()
    for name, original in originals.items():
        setattr(torch.distributed, name, original)

    if torch.distributed.get_rank() == 0:
        # After the first decision the policy's running sums are exactly this step's norms.
        norms = trainer.controller.policy.norm_sum.tolist()
        print(json.dumps({"collectives": calls, "norms": norms,
                          "reference": reference, "total": outcome.grad_norm,
                          "skipped": int(not applied)}))
    distributed.shutdown()


if __name__ == "__main__":
    main(sys.argv[1:])
