"""What one checkpoint of a layout writes, in each format, before a launch
(`megatron-gnmr estimate-memory`).

Per parameter of the whole model: its weight (2 bytes in bf16, else 4) and the optimizer's
state (Adam's two fp32 moments, 8, and in bf16 the fp32 main weight, 4). torch_dist writes
every tensor once, whatever the layout (megatron-core's fully parallel save spreads the
writing over the data-parallel replicas). The torch format writes one file per rank: every
data-parallel replica writes its model shard, and its optimizer state too unless the
distributed optimizer splits that over the replicas. `--keep-last` checkpoints stay on disk.
Metadata (a few KiB per tensor) comes on top.
"""

from __future__ import annotations

import dataclasses

from megatron_gnmr.training.memory_estimate import GIB, parameters_per_rank


def whole_model_parameters(config) -> int:
    """Every parameter of the model, counted once (the layout's sharding undone)."""
    single = dataclasses.replace(config.parallel, tensor_model_parallel_size=1,
                                 pipeline_model_parallel_size=1, expert_model_parallel_size=1)
    dense, experts = parameters_per_rank(dataclasses.replace(config, parallel=single))
    return dense + experts


def checkpoint_bytes(config, world_size: int) -> dict[str, float]:
    """{format: bytes one checkpoint writes, summed over every rank}."""
    p, bf16 = config.parallel, config.training.bf16
    dp = max(world_size // (p.tensor_model_parallel_size * p.pipeline_model_parallel_size), 1)
    parameters = whole_model_parameters(config)
    weights = parameters * (2 if bf16 else 4)
    optimizer = parameters * (8 + (4 if bf16 else 0))
    return {"torch_dist": weights + optimizer,
            "torch": dp * weights + (1 if p.use_distributed_optimizer else dp) * optimizer}


def lines(config, world_size: int) -> list[str]:
    sizes, keep = checkpoint_bytes(config, world_size), config.training.keep_last
    chosen = config.training.ckpt_format
    return [f"checkpoint size ({whole_model_parameters(config) / 1e6:.1f} M parameters, "
            f"weights and optimizer state; --keep-last {keep} on disk):"] + [
        f"  {name:<11}{size / GIB:10.2f} GiB per checkpoint, {keep * size / GIB:.2f} GiB kept"
        + ("  <- --ckpt-format" if name == chosen else "") for name, size in sizes.items()]
