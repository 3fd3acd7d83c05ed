"""A trainer's torch_dist checkpoints: save (every rank), load on the same or another layout.

megatron-core's `dist_checkpointing` does the sharded work: its torch_dist strategy, the save
spread over the data-parallel replicas (`FullyParallelSaveStrategyWrapper`, Megatron-LM's
`--ckpt-fully-parallel-save`) so each tensor is written once, by one rank; the load resharded
to this run's layout. `files.py` makes the result complete-or-invisible and checks it before
any byte is read; `data_only.py` keeps the reading free of code.
"""

from __future__ import annotations

from pathlib import Path

import torch
from megatron.core import dist_checkpointing, parallel_state

from megatron_gnmr.errors import UserError
from megatron_gnmr.model import unwrap
from megatron_gnmr.training.torch_dist import content, files
from megatron_gnmr.training.torch_dist.data_only import (
    CheckpointNotData,
    read_common,
    reading_data_only,
)


def _save_strategy():
    from megatron.core.dist_checkpointing.serialization import (
        get_default_save_sharded_strategy,
    )
    from megatron.core.dist_checkpointing.strategies.fully_parallel import (
        FullyParallelSaveStrategyWrapper,
    )

    return FullyParallelSaveStrategyWrapper(
        get_default_save_sharded_strategy("torch_dist"),
        parallel_state.get_data_parallel_group(with_context_parallel=True))


def save(trainer, step: int, settings: dict, padded_vocab_size: int,
         flops_per_step: float, faults) -> Path:
    """Collective: this step's checkpoint in `--save`, published when complete."""
    root = trainer.run_dir
    staging = files.staging_directory(root, step) if torch.distributed.get_rank() == 0 \
        else Path(root) / f"iter_{step:07d}.tmp"
    torch.distributed.barrier()
    with trainer.overlap.whole_weights():
        state = content.sharded_state(trainer, is_loading=False, with_rank_state=True)
        state.update(content.common_state(trainer, step, settings, padded_vocab_size,
                                          flops_per_step))
        dist_checkpointing.save(state, str(staging), sharded_strategy=_save_strategy())
    faults.maybe_kill(step, "save")  # reliability tests: die with the checkpoint half written
    torch.distributed.barrier()
    return files.finish(root, staging, step,
                        {"settings": settings, "layout": content.layout(trainer.config)},
                        trainer.config.training.keep_last)


def read_saved(directory: Path) -> dict:
    """The checkpoint's own state (`megatron_gnmr` of common.pt) and its scheduler."""
    try:
        common = read_common(directory / "common.pt")
    except CheckpointNotData as error:
        raise UserError(f"--load {directory}: {error}; load an older checkpoint") from None
    ours = common.get("megatron_gnmr")
    if not isinstance(ours, dict):
        raise UserError(f"--load {directory}: not written by megatron-gnmr (no megatron_gnmr "
                        "state in common.pt)")
    from megatron_gnmr.training.safe_state import from_plain

    return {**from_plain(ours), "opt_param_scheduler": common.get("opt_param_scheduler")}


def load(trainer, directory: Path, saved: dict, load_optimizer: bool = True,
         load_rng: bool = True) -> list[str]:
    """Collective: the model, optimizer and run state of `directory` into this run (any
    layout; the scheduler is the caller's). Returns what could not be carried exactly, for
    the start notice."""
    same_layout = saved["layout"] == content.layout(trainer.config)
    state = content.sharded_state(trainer, is_loading=True, with_rank_state=same_layout)
    if not load_optimizer:
        del state["optimizer"]
    try:
        with reading_data_only():
            loaded = dist_checkpointing.load(state, str(directory))
    except CheckpointNotData as error:
        raise UserError(f"--load {directory}: {error}; load an older checkpoint") from None
    except Exception as error:  # megatron raises many kinds for a checkpoint that does not fit
        line = str(error).strip().splitlines()[0][:200] if str(error).strip() else ""
        raise UserError(f"--load {directory}: the checkpoint does not fit this model "
                        f"({type(error).__name__}: {line})") from None
    unwrap(trainer.model[0]).load_state_dict(loaded["model"])
    if load_optimizer:
        trainer.optimizer.load_state_dict(loaded["optimizer"])
    trainer.state.load_state_dict(saved["run_state"])
    trainer.controller.load_state_dict(saved["controller"])
    notes = []
    if same_layout:
        rank_state = content.unpack_rank_state(loaded["rank_state"])
        from megatron_gnmr.training.checkpoint import set_rng_state

        if load_rng:
            set_rng_state(rank_state["rng"])
        else:
            content.rederive_rng(trainer.config.training.seed, trainer.state.step)
        trainer.monitors.load_state_dict(rank_state["monitors"])
    else:
        content.rederive_rng(trainer.config.training.seed, trainer.state.step)
        trainer.monitors.load_alarms(saved["alarms"])
        notes.append(f"resumed on another layout ({_describe(saved['layout'])} -> "
                     f"{_describe(content.layout(trainer.config))}): the model and optimizer "
                     "were resharded; the per-rank RNG streams were re-derived from the seed, "
                     "the step and the rank, and the attention monitor takes its weight "
                     "snapshots again (its next check is skipped)")
    return notes


def _describe(layout: dict) -> str:
    return (f"TP={layout['tensor_model_parallel_size']} "
            f"PP={layout['pipeline_model_parallel_size']} "
            f"EP={layout['expert_model_parallel_size']} world {layout['world_size']}"
            + (" distributed optimizer" if layout["use_distributed_optimizer"] else ""))


def load_model_weights(model_chunks, directory: Path, source: str) -> None:
    """Collective: only the model's weights (evaluation, a fine-tune's base), resharded."""
    state = {"model": unwrap(model_chunks[0]).sharded_state_dict()}
    try:
        with reading_data_only():
            loaded = dist_checkpointing.load(state, str(directory))
    except CheckpointNotData as error:
        raise UserError(f"{source}: {error}") from None
    except Exception as error:
        line = str(error).strip().splitlines()[0][:200] if str(error).strip() else ""
        raise UserError(f"{source}: the checkpoint does not fit this model "
                        f"({type(error).__name__}: {line})") from None
    unwrap(model_chunks[0]).load_state_dict(loaded["model"])
