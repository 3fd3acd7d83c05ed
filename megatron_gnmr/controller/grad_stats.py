"""Per-unit gradient norms with ONE all-reduce per step (SPEC 3).

After megatron's DDP has reduced gradients into `param.main_grad`, every local gradient's
norm is taken in one fused pass (`torch._foreach_norm`), squared, and summed into a
`[num_units + 1]` float64 vector: a slot per unit, and a last slot holding the total over
every parameter (the units' and the rest: embeddings, norms, output head), summed in the
parameters' order whatever the registry holds. TP-duplicated parameters (e.g. norm
weights) are counted on TP rank 0 only, as megatron's `get_grad_norm_fp32` does. A weightless
unit (a core attention) adds the squared norm of the gradients it hands back to its inputs,
summed on the device during the backward; it does not enter the global norm (clipping scales
parameters only). One SUM
all-reduce over megatron's grad-stats group (the model-parallel group) completes the
vector: every rank then holds every unit's full, unsharded norm and the global norm for
clipping, which is never computed a second time.

With expert parallelism the experts of a layer live on different EP ranks, which megatron
carves out of data parallelism: the all-reduce then runs over the expert-tensor-model-pipeline
group (TP x EP x PP), expert parameters count on their owning rank, and every other parameter
(identical on all EP ranks after DDP) counts on EP rank 0 only.

With the distributed optimizer DDP reduce-scatters the gradients: each data-parallel rank
holds the reduced values of its own shard of the gradient buffer only. Every rank then
counts its shard of each parameter (the range the optimizer owns), and the same one
all-reduce spans all ranks, which sums the shards, as megatron's own clip-norm does over
its grad-stats group.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

from megatron_gnmr.controller.units import UnitRegistry
from megatron_gnmr.platform.device import run_device
from megatron_gnmr.platform.megatron_compat import distributed_optimizer_shards


@dataclass
class StepGradStats:
    unit_norms: np.ndarray  # float64 [num_units], on the true gradient scale
    total_norm: float  # global L2 norm of all gradients (units and the rest)
    probe_sums: np.ndarray | None = None  # [num_units, measurements' slots] over all ranks


class GradStats:
    def __init__(self, registry: UnitRegistry, model_chunks: list[torch.nn.Module],
                 group: torch.distributed.ProcessGroup | None = None,
                 expert_parallel: bool = False, probes=None, sharded: bool = False,
                 attention_sums=None):
        self.num_units = registry.num_units
        self.probes = probes
        # Weightless units (core attention): the squared norms of the gradients they hand
        # back, per data-parallel rank (precision/attention_unit.py).
        self.attention_sums = attention_sums
        self.sharded = sharded  # the distributed optimizer: gradients reduce-scattered
        self.shards: dict[int, tuple[int, int]] | None = None  # param id -> owned range
        # Probe and attention sums differ across data-parallel ranks (each saw its own
        # micro-batches), so with either the one all-reduce spans the world and the
        # (identical) gradient norms are contributed by data-parallel rank 0 only (with
        # shards: by every rank).
        per_rank_sums = probes is not None or attention_sums is not None
        self.norms_here = sharded or not per_rank_sums or \
            parallel_state.get_data_parallel_rank() == 0
        # Each data-parallel rank's loss is averaged over its own micro-batches, so its
        # activation gradients are dp x those of the global batch's loss: the sum of their
        # squares over dp ranks is dp^2 x the layout-free value.
        self.data_parallel_size = parallel_state.get_data_parallel_world_size()
        if group is None:
            if per_rank_sums or sharded:
                group = torch.distributed.group.WORLD
            elif expert_parallel:
                group = parallel_state.get_expert_tensor_model_pipeline_parallel_group()
            else:
                group = parallel_state.get_model_parallel_group()
        self.group = group
        unit_of = {id(p): u for u in range(self.num_units) for p in registry.local_parameters(u)}
        self.all_params = [p for chunk in model_chunks for p in chunk.parameters()
                           if p.requires_grad]
        first_ep_rank = sharded or not expert_parallel or \
            parallel_state.get_expert_model_parallel_rank() == 0
        self.params = [p for p in self.all_params if param_is_not_tensor_parallel_duplicate(p)
                       and (first_ep_rank or _is_expert_parameter(p))]
        slots = [unit_of.get(id(p), self.num_units) for p in self.params]
        # on the device once, not copied there at every step
        self.slots = torch.tensor(slots, dtype=torch.long, device=run_device())

    @torch.no_grad()
    def compute(self, loss_scale: float = 1.0, optimizer=None) -> StepGradStats:
        grads = self._local_gradients(optimizer) if self.norms_here else []
        # On the device: NCCL reduces device tensors only. The last slot holds the total over
        # every parameter, summed in the parameters' own order: summed slot by slot, its order
        # followed the registry, and in float32 that moved the clip coefficient's last bits,
        # so which units were measured changed training (tests/test_grad_norm_registry.py).
        # float64: a float32 norm's square is exact there.
        squared = torch.zeros(self.num_units + 1, dtype=torch.float64, device=run_device())
        if grads:
            norms = torch._foreach_norm([g.float() if g.dtype != torch.float32 else g
                                         for g in grads])
            per_parameter = torch.stack(norms).double().square()
            squared.index_add_(0, self.slots, per_parameter)  # the rest's lands in the last
            squared[-1] = per_parameter.sum()  # slot, replaced by the total
        parts = [squared]
        if self.attention_sums is not None:
            parts.append(self.attention_sums.take().to(squared.device))
        if self.probes is not None:
            parts.append(self.probes.take().to(squared.device))
        reduced = torch.cat(parts) if len(parts) > 1 else squared
        torch.distributed.all_reduce(reduced, group=self.group)  # the one collective
        reduced = reduced.double().cpu()
        squared = reduced[: self.num_units + 1] / (loss_scale**2)
        total_norm = float(squared[-1].sqrt())  # parameters only: what clipping scales
        unit_squared = squared[:-1]
        rest = reduced[self.num_units + 1:]
        if self.attention_sums is not None:
            activation = rest[: self.num_units] / (loss_scale * self.data_parallel_size) ** 2
            unit_squared = unit_squared + activation
            rest = rest[self.num_units:]
        probe_sums = rest.reshape(self.num_units, -1).numpy() if self.probes is not None \
            else None
        return StepGradStats(unit_norms=unit_squared.sqrt().numpy(), total_norm=total_norm,
                             probe_sums=probe_sums)

    def _local_gradients(self, optimizer) -> list[torch.Tensor]:
        if not self.sharded:
            return [_grad(p) for p in self.params]
        if self.shards is None:  # the optimizer is built after the controller
            self.shards = distributed_optimizer_shards(optimizer)
        # A parameter outside this rank's shards contributes an empty slice (norm 0).
        return [_grad(p).view(-1)[slice(*self.shards.get(id(p), (0, 0)))]
                for p in self.params]

    @torch.no_grad()
    def clip_(self, total_norm: float, max_norm: float) -> float:
        """Scale gradients so their global norm is at most max_norm; returns the factor."""
        if max_norm <= 0 or not np.isfinite(total_norm):
            return 1.0
        coefficient = max_norm / (total_norm + 1.0e-6)
        if coefficient >= 1.0:
            return 1.0
        # TP duplicates were counted once in the norm but every copy is clipped.
        torch._foreach_mul_([_grad(p) for p in self.all_params], coefficient)
        return coefficient


def _is_expert_parameter(param: torch.nn.Parameter) -> bool:
    # megatron marks expert-parallel parameters with `allreduce = False` (reduced over the
    # expert-data-parallel group instead of the data-parallel group).
    return getattr(param, "allreduce", True) is False


def _grad(param: torch.nn.Parameter) -> torch.Tensor:
    # megatron-core DDP accumulates into `main_grad`; plain modules into `grad`.
    return param.main_grad if hasattr(param, "main_grad") else param.grad
