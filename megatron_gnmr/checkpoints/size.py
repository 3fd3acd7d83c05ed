"""What one checkpoint of a layout writes, in each format, before a launch
(`megatron-gnmr estimate-memory`).

Per parameter of the whole model: its weight (2 bytes in bf16, else 4) and the optimizer's
state (Adam's two fp32 moments, 8, and the fp32 main weight, 4, in bf16, or in torch_dist
with the distributed optimizer: `state_bytes`). torch_dist writes
every tensor once, whatever the layout (megatron-core's fully parallel save spreads the
writing over the data-parallel replicas). The torch format writes one file per rank: every
data-parallel replica writes its model shard, and its optimizer state too unless the
distributed optimizer splits that over the replicas. `--keep-last` checkpoints stay on disk.
Metadata (a few KiB per tensor) comes on top.

Host memory per rank at a torch_dist save and load (`host_bytes_per_rank`), where a large
model's checkpoints fail first (host OOM on an 8-GPU node). Per rank, N parameters (its TP/PP/EP
shard), S bytes of optimizer state each (8, or 12 with an fp32 main weight: bf16, or the
distributed optimizer, whose torch_dist state writes `param` in fp32 too), D the data-parallel
size: the weights are written once, the writing spread over the replicas (N x
weight bytes / D staged per rank); the optimizer, with the distributed optimizer,
- DP-reshardable (the default): each rank its own part, N x S / D, at a save and a load;
- fully reshardable: every rank gathers its shard's whole state, N x S, at a save and a load
  (megatron-core's NCCL all-gather of each buffer);
- fully reshardable, memory-efficient: data-parallel rank 0 alone gathers at a save, N x S
  plus as much in receive buffers; a load is still N x S on every rank.
Without the distributed optimizer each replica holds the whole N x S and reads it whole. A
load reads whole what the rank needs (the weights of its shard, D times its written share),
or only its share with --ckpt-fully-parallel-load (the replicas exchange the rest).

Part of a save's host memory is never given back (`pinned`): on a GPU, megatron-core stages
every tensor a rank writes that lives on the device into host memory with `tensor.to("cpu",
non_blocking=True)` (`FileSystemWriterAsync.preload_tensors`, at every torch_dist save,
synchronous or `--async-save`: 0.16.1 and 0.19), which torch allocates pinned; torch's caching
host allocator keeps freed pinned blocks for reuse and returns them only at the process's end,
rounding each up to a power of two (`CachingHostAllocator`: `PowerOf2Ceil`). So from the first
save on, the rank holds its written share of the device tensors as page-locked host memory for
the rest of the run: the weights (N x weight bytes / D) and, unless the optimizer is fully
reshardable (which gathers its state into ordinary host tensors first: those are written as
they are and freed), the optimizer state it writes (N x S / D); up to twice that with the
rounding. A CPU run pins nothing.
"""

from __future__ import annotations

from megatron_gnmr.checkpoints.formats import FORMATS, TORCH_DIST, checkpoint_format, state_bytes
from megatron_gnmr.model_families.parameter_count import (
    GIB,
    parameters_per_rank,
    whole_model_parameters,
)


def checkpoint_bytes(config, world_size: int) -> dict[str, float]:
    """{format: bytes one checkpoint writes, summed over every rank}."""
    return {f.name: f.bytes_written(config, world_size) for f in FORMATS.values()}


def host_bytes_per_rank(config, world_size: int) -> dict[str, float]:
    """{"save": bytes, "load": bytes, "pinned": bytes} of host memory one rank needs for a
    torch_dist checkpoint (the most loaded rank), per the module docstring: `save` the peak
    while a save runs, `pinned` the part of it a GPU run keeps from its first save on."""
    p, t, ck = config.parallel, config.training, config.checkpoint
    dp = max(world_size // (p.tensor_model_parallel_size * p.pipeline_model_parallel_size), 1)
    dense, experts = parameters_per_rank(config)
    shard = dense + experts
    weights = shard * (2 if t.bf16 else 4) / dp
    state = shard * state_bytes(config, TORCH_DIST)
    # a load reads what the rank needs whole, or its share with a fully parallel load
    read = 1 if ck.ckpt_fully_parallel_load else dp
    if not p.use_distributed_optimizer:
        written = weights + state / dp
        return {"save": written, "load": written * read, "pinned": written}
    if not ck.dist_ckpt_optim_fully_reshardable:
        written = weights + state / dp
        return {"save": written, "load": weights * read + state / dp, "pinned": written}
    gather = 2 * state if ck.distrib_optim_fully_reshardable_mem_efficient else state
    return {"save": weights + gather, "load": weights * read + state / dp * read,
            "pinned": weights}


def lines(config, world_size: int) -> list[str]:
    sizes, keep = checkpoint_bytes(config, world_size), config.checkpoint.keep_last
    chosen = config.checkpoint.ckpt_format
    return [f"checkpoint size ({whole_model_parameters(config) / 1e6:.1f} M parameters, "
            f"weights and optimizer state; --keep-last {keep} on disk):"] + [
        f"  {name:<11}{size / GIB:10.2f} GiB per checkpoint, {keep * size / GIB:.2f} GiB kept"
        + ("  <- --ckpt-format" if name == chosen else "") for name, size in sizes.items()] + \
        _host_lines(config, world_size)


def _host_lines(config, world_size: int) -> list[str]:
    t = config.checkpoint
    if not checkpoint_format(t.ckpt_format).sharded_save:
        return []
    form = "optimizer not distributed" if not config.parallel.use_distributed_optimizer \
        else "fully reshardable" + (", memory-efficient" if
                                    t.distrib_optim_fully_reshardable_mem_efficient else "") \
        if t.dist_ckpt_optim_fully_reshardable else "DP-reshardable"
    host = host_bytes_per_rank(config, world_size)
    pinned = host["pinned"] / GIB
    return [f"torch_dist host memory per rank ({form}):",
            f"  pinned     {pinned:10.2f} GiB held from the first save to the end of the run "
            "(a GPU run),",
            f"{'':28}up to {2 * pinned:.2f} GiB as torch rounds each pinned block up to a "
            "power of two",
            f"  at a save  {(host['save'] - host['pinned']) / GIB:10.2f} GiB more while it "
            "is written",
            f"  at a load  {host['load'] / GIB:10.2f} GiB while it is read"]
