"""The run's random streams: seeded at a run's start, saved into a checkpoint, continued from
one, or re-derived where they cannot be continued (another kind of device, another layout).

Every generator a run draws from (Python's, NumPy's, torch's default one and megatron's
model-parallel tracker, the accelerator's) is seeded from one `--seed` by `set_seeds`, saved
by `rng_state` and set back by `set_rng_state`; both checkpoint formats carry these states
(the torch format in every shard, torch_dist per rank), and a resume that cannot set them
back re-derives them from the seed and the step (`rederive_rng`).
"""

from __future__ import annotations

import random

import numpy as np
import torch
from megatron.core import parallel_state, tensor_parallel

from megatron_gnmr.platform import device

PIPELINE_SEED_STRIDE = 100  # Megatron-LM's `_set_random_seed`: seed + 100 x pp_rank


def stage_seed(seed: int) -> int:
    """The seed of this rank's pipeline stage. The same on every TP and DP rank of a stage:
    with CPU initialisation megatron draws full weights from it and splits them, so every TP
    layout starts from the same model. Offset per stage as Megatron-LM does: stages without
    the embedding would otherwise draw their layers from the same position of the same
    stream, identical initial layers (PP >= 3)."""
    return seed + PIPELINE_SEED_STRIDE * parallel_state.get_pipeline_model_parallel_rank()


def set_seeds(seed: int) -> None:
    seed = stage_seed(seed)
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def rng_state() -> dict:
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
        "device": device.rng_state(),
    }


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])
    device.set_rng_state(state["device"])


def restore_rng(state: dict, seed: int, step: int) -> list[str]:
    """Continue a checkpoint's generator streams, or, where they were saved on another kind of
    device, re-derive them (`rederive_rng`) and say so (the returned start-notice lines)."""
    if _rng_fits_this_device(state):
        set_rng_state(state)
        return []
    rederive_rng(seed, step)
    return ["the checkpoint's RNG streams were saved on another kind of device (GPU <-> CPU) "
            "and cannot continue here: they were re-derived from the seed and the step, as a "
            "run's start seeds them (dropout masks differ from an uninterrupted run)"]


def _rng_fits_this_device(state: dict) -> bool:
    """Megatron's tracker keeps CUDA generator states on a GPU and CPU ones on the CPU
    (cpu_patches), and neither can be set into the other (a GPU run resumed in a CPU
    process, or back)."""
    here = (torch.cuda.get_rng_state() if device.has_accelerator()
            else torch.get_rng_state()).numel()
    return (("cuda" in state["device"]) == device.has_accelerator() and
            all(torch.as_tensor(s).numel() == here for s in state["tracker"].values()))


def rederive_rng(seed: int, step: int) -> None:
    """RNG streams for a layout the checkpoint was not written in: seeded from the seed and
    the step as a run's start seeds them (`distributed.set_seeds`), so the same resume gives
    the same streams and they keep Megatron's rule: the default generator equal on every TP
    rank of a stage (the replicated residual stream's dropout), the model-parallel tracker
    one per TP rank."""
    set_seeds((seed * 1_000_003 + step * 7919) % (2**31))
