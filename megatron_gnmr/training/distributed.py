"""Process groups and seeds: torch.distributed (gloo on CPU, nccl on GPU) + megatron's
model-parallel groups, and every random generator seeded from one `--seed`."""

from __future__ import annotations

import os
from datetime import timedelta

import torch
from megatron.core import parallel_state

from megatron_gnmr.checkpoints.rng import set_seeds  # the run's streams live with their saving
from megatron_gnmr.config import RunConfig
from megatron_gnmr.platform import apply_cpu_patches, device, megatron_compat


def initialize(config: RunConfig) -> None:
    """Start torch.distributed (also for a single process) and megatron's parallel state."""
    megatron_compat.bind_missing_moe_helpers()  # any machine without TE, CUDA or not
    megatron_compat.tell_mla_whether_te_is_there()
    apply_cpu_patches()
    if not torch.distributed.is_initialized():
        backend = device.distributed_backend()
        device.select_device()
        if "WORLD_SIZE" in os.environ:  # launched by torchrun / srun
            torch.distributed.init_process_group(
                backend=backend, store=_restart_safe_store(),
                timeout=timedelta(minutes=config.training.distributed_timeout_minutes),
                rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
        else:  # a plain `python pretrain_llama.py`: a world of one, no port to race for
            torch.distributed.init_process_group(backend=backend, rank=0, world_size=1,
                                                 store=torch.distributed.HashStore())
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=config.parallel.tensor_model_parallel_size,
            pipeline_model_parallel_size=config.parallel.pipeline_model_parallel_size,
            expert_model_parallel_size=config.parallel.expert_model_parallel_size,
        )
    set_seeds(config.training.seed)


def _restart_safe_store():
    """Under torchrun the workers share the agent's TCPStore, which outlives a restart
    (`--max-restarts`): without a per-attempt prefix the new workers read the old workers'
    gloo addresses and fail to connect. None (env:// as usual) outside torchelastic."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = torch.distributed.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
        world_size=int(os.environ["WORLD_SIZE"]), is_master=False,
        timeout=timedelta(minutes=10))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return torch.distributed.PrefixStore(f"megatron_gnmr/attempt_{attempt}", store)


def shutdown() -> None:
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def is_logging_rank() -> bool:
    """Global rank 0 logs (it is on the first stage; the loss is all-reduced to it)."""
    return rank() == 0
