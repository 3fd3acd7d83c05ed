"""One device rule for the whole run: the local accelerator when there is one, else the CPU.

The run's device is decided once, from the launch (`LOCAL_RANK`) and what torch can see;
the model is placed on it before megatron's DDP wraps it, batches are moved to it in the
forward step, and every tensor that enters a collective is created on it, because NCCL
reduces device tensors only (a CPU tensor in an NCCL all-reduce is an error, not a slow
path). Nothing outside this layer names "cuda".

Under the device audit (`device_audit.py`, a CPU-only check) the rule names a CUDA device
that the CPU patches turn into CPU tensors, so a CPU run can prove that every collective
and every optimizer parameter follows the rule.
"""

from __future__ import annotations

import os

import torch


def local_rank() -> int:
    """This process's index on its node (torchrun and srun launches set LOCAL_RANK)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def has_accelerator() -> bool:
    """A CUDA device is visible to this process."""
    return torch.cuda.is_available()


def distributed_backend() -> str:
    return "nccl" if has_accelerator() else "gloo"


def select_device() -> None:
    """Bind this process to its local GPU (before the process group is created)."""
    if has_accelerator():
        torch.cuda.set_device(local_rank() % torch.cuda.device_count())


def run_device() -> torch.device:
    """Where the model, the batches and every collective's tensors live."""
    if has_accelerator():
        return torch.device("cuda", torch.cuda.current_device())
    from megatron_gnmr.platform import device_audit

    if device_audit.active():
        return device_audit.AUDITED_DEVICE
    return torch.device("cpu")


def to_run_device(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A batch of tensors on the run's device (non-blocking from pinned memory on GPU)."""
    device = run_device()
    return {key: value.to(device, non_blocking=True) for key, value in batch.items()}


def rng_state() -> dict:
    """The run device's generator state, for checkpoints ({} on the CPU: torch's CPU
    generator is saved with the other host generators)."""
    if has_accelerator():
        return {"cuda": torch.cuda.get_rng_state()}
    return {}


def set_rng_state(state: dict) -> None:
    if has_accelerator() and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])
