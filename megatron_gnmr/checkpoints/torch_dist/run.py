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

from megatron_gnmr.checkpoints import rng
from megatron_gnmr.checkpoints.torch_dist import content, files, te_extra_state
from megatron_gnmr.checkpoints.torch_dist.data_only import (
    CheckpointNotData,
    read_common,
    read_index,
    reading_data_only,
)
from megatron_gnmr.errors import UserError
from megatron_gnmr.model import unwrap
from megatron_gnmr.platform.megatron_compat import fix_torch_adam_reshard


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


def _die_with_parent_and_survive_termination() -> None:
    """In megatron's writer-results server process: it dies when the training process does
    (a SIGKILLed rank leaves no process holding the job's output open), and a scheduler's
    SIGTERM to the whole job leaves it alive until the rank it serves has saved."""
    import ctypes
    import signal

    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:  # not Linux: the server outlives a killed parent, as megatron's does
        pass


def _start_writer_results_queue() -> None:
    """megatron-core's torch_dist writer reports through a queue served by a spawned
    `multiprocessing` manager, started on first use; start it here with the two properties
    above (once per process), forked rather than spawned where the platform forks: a spawned
    process imports the caller's `__main__` again, which a script run from stdin, or any that
    starts training at import, does not survive (the server runs no torch)."""
    import multiprocessing
    from multiprocessing.managers import SyncManager

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is not None:
        return
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    manager = SyncManager(ctx=multiprocessing.get_context(method))
    manager.start(initializer=_die_with_parent_and_survive_termination)
    filesystem_async._results_queue = manager.Queue()


def save(trainer, step: int, settings: dict, padded_vocab_size: int,
         flops_per_step: float, faults, asynchronous=None, published=None,
         publish_first=None) -> Path | None:
    """Collective: this step's checkpoint in `--save`, published when complete. With
    `asynchronous` (an `async_save.AsyncSaves`): written by a forked writer while training
    goes on, published later (then, on every rank, `published(path, loop stall seconds,
    seconds of the call that published)`); returns None. With `publish_first` (a preemption's
    save, whose window is short): published before its files are hashed, and
    `publish_first(path)` called in between (`files.finish_then_hash`)."""
    _start_writer_results_queue()
    root = trainer.run_dir
    staging = files.staging_directory(root, step) if torch.distributed.get_rank() == 0 \
        else Path(root) / f"iter_{step:07d}.tmp"
    torch.distributed.barrier()
    form = content.optimizer_form(trainer.config.checkpoint)

    described = {"settings": settings, "layout": content.layout(trainer.config)}
    keep_last = trainer.config.checkpoint.keep_last

    def publish() -> Path:
        return files.finish(root, staging, step, described, keep_last)

    with trainer.overlap.whole_weights():
        state = content.sharded_state(trainer, is_loading=False, with_rank_state=True,
                                      form=form)
        state.update(content.common_state(trainer, step, settings, padded_vocab_size,
                                          flops_per_step))
        written = dist_checkpointing.save(
            state, str(staging), sharded_strategy=_save_strategy(),
            content_metadata=form,  # read by Megatron-LM's loader
            **(asynchronous.save_arguments() if asynchronous is not None else {}))
        if asynchronous is not None:  # the writer forks from the weights as they are now
            asynchronous.schedule(written, staging, publish, published)
    faults.maybe_kill(step, "save")  # reliability tests: die with the checkpoint half written
    if asynchronous is not None:
        return None
    torch.distributed.barrier()
    if publish_first is not None:
        return files.finish_then_hash(root, staging, step, described, keep_last, publish_first)
    return publish()


def read_saved(directory: Path) -> dict:
    """The checkpoint's own state (`megatron_gnmr` of the common state) and its scheduler."""
    try:
        common = read_common(directory)
    except CheckpointNotData as error:
        raise UserError(f"--load {directory}: {error}; load an older checkpoint") from None
    ours = common.get("megatron_gnmr")
    if not isinstance(ours, dict):
        raise UserError(f"--load {directory}: not written by megatron-gnmr (no megatron_gnmr "
                        "state in its common state)")
    from megatron_gnmr.checkpoints.safe_state import from_plain

    return {**from_plain(ours), "opt_param_scheduler": common.get("opt_param_scheduler")}


def load(trainer, directory: Path, saved: dict, load_optimizer: bool = True,
         load_rng: bool = True) -> list[str]:
    """Collective: the model, optimizer and run state of `directory` into this run (any
    layout; the scheduler is the caller's). Returns what could not be carried exactly, for
    the start notice."""
    fix_torch_adam_reshard()
    now = content.layout(trainer.config)
    same_layout = saved["layout"] == now
    if load_optimizer and saved["layout"]["expert_model_parallel_size"] != \
            now["expert_model_parallel_size"] and not (
                saved["layout"]["use_distributed_optimizer"] and
                now["use_distributed_optimizer"]):
        raise UserError(f"--load {directory}: a resume that changes --expert-model-parallel-"
                        f"size ({saved['layout']['expert_model_parallel_size']} -> "
                        f"{now['expert_model_parallel_size']}) reshards the optimizer's expert "
                        "state through the distributed optimizer: use "
                        "--use-distributed-optimizer in both runs (or --no-load-optim)")
    form = saved.get("optimizer_form") or content.EARLIER_FORM
    changed = [key for key in content.RESHARDS_ONLY_FULLY if saved["layout"][key] != now[key]]
    if load_optimizer and changed and saved["layout"]["use_distributed_optimizer"] and \
            form["distrib_optim_sharding_type"] != content.FULLY_RESHARDABLE:
        raise UserError(f"--load {directory}: its optimizer was saved DP-reshardable "
                        f"(Megatron-LM's default), which a change of "
                        f"{', '.join('--' + k.replace('_', '-') for k in changed)} cannot "
                        f"reshard; resume once on its layout ({_describe(saved['layout'])}) "
                        "with --dist-ckpt-optim-fully-reshardable to save a reshardable "
                        "checkpoint, or add --no-load-optim (weights only, fresh moments)")
    state = content.sharded_state(trainer, is_loading=True, with_rank_state=same_layout,
                                  form=form)
    if not load_optimizer:
        del state["optimizer"]
    loaded = _read_as_data(state, directory, f"--load {directory}",
                           trainer.config.checkpoint.ckpt_fully_parallel_load)
    model = unwrap(trainer.model[0])
    model.load_state_dict(te_extra_state.loadable(model, loaded["model"]))
    if load_optimizer:
        trainer.optimizer.load_state_dict(_reconciled(loaded["optimizer"], state["optimizer"]))
    trainer.state.load_state_dict(saved["run_state"])
    trainer.controller.load_state_dict(saved["controller"])
    notes, seed, step = [], trainer.config.training.seed, trainer.state.step
    if same_layout:
        rank_state = content.unpack_rank_state(loaded["rank_state"])
        if load_rng:
            notes += rng.restore_rng(rank_state["rng"], seed, step)
        else:
            rng.rederive_rng(seed, step)
        trainer.monitors.load_state_dict(rank_state["monitors"])
    else:
        rng.rederive_rng(seed, step)
        trainer.monitors.load_alarms(saved["alarms"])
        notes.append(f"resumed on another layout ({_describe(saved['layout'])} -> "
                     f"{_describe(content.layout(trainer.config))}): the model and optimizer "
                     "were resharded; the RNG streams were re-derived from the seed and the "
                     "step as a run's start seeds them, and the attention monitor takes its "
                     "weight snapshots again (its next check is skipped)")
    return notes


def _reconciled(loaded, runtime):
    """The loaded optimizer state in the shape this run's optimizer has. megatron chains one
    optimizer per parameter kind, dense and expert apart only with EP > 1, and saves each
    one's parameter groups (with Adam's step count) in the common state in its own chain
    shape; its sharded state (the moments, the main weights) is keyed per parameter and
    loads into any shape. Where the shapes differ (EP 2 -> 1), this run's own groups are
    taken, with the checkpoint's step count."""
    if not isinstance(loaded, dict) or set(loaded) == set(runtime):
        return loaded  # the same chain shape: megatron's own load
    steps = {group["step"] for group in _groups(loaded) if "step" in group}

    def shaped(saved, wanted):
        if not isinstance(wanted, dict) or not isinstance(saved, dict):
            return saved
        kept = {key: value for key, value in saved.items()  # e.g. Adam's common step
                if key not in wanted and not isinstance(key, int)}
        return {**kept, **{key: shaped(saved[key], value) if key in saved else value
                           for key, value in wanted.items()}}

    reshaped = shaped(loaded, runtime)
    if len(steps) == 1:
        for group in _groups(reshaped):
            if "step" in group:
                group["step"] = next(iter(steps))
    return reshaped


def _groups(state) -> list[dict]:
    """Every optimizer parameter group in a (possibly chained) optimizer state."""
    if isinstance(state, dict):
        if isinstance(state.get("param_groups"), list):
            return [g for g in state["param_groups"] if isinstance(g, dict)]
        return [g for value in state.values() for g in _groups(value)]
    return []


def _load_strategy(directory: Path, fully_parallel: bool):
    """megatron's torch_dist load strategy; fully parallel (Megatron-LM's
    --ckpt-fully-parallel-load): each data-parallel replica reads a share and they exchange
    the rest, instead of every rank reading everything it needs."""
    if not fully_parallel:
        return None  # megatron's default
    from megatron.core.dist_checkpointing.serialization import (
        get_default_load_sharded_strategy,
    )
    from megatron.core.dist_checkpointing.strategies.fully_parallel import (
        FullyParallelLoadStrategyWrapper,
    )

    return FullyParallelLoadStrategyWrapper(
        get_default_load_sharded_strategy(str(directory)),
        parallel_state.get_data_parallel_group(with_context_parallel=True))


def _read_as_data(state: dict, directory: Path, source: str,
                  fully_parallel: bool = False) -> dict:
    """Collective: `dist_checkpointing.load` with the index and byte items read as data;
    every failure is one line naming `source`."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        with open(directory / ".metadata", "rb") as stream:  # here, not inside torch's
            read_index(stream)  # collective, which turns the reason into a string
        with reading_data_only():
            return dist_checkpointing.load(state, str(directory),
                                           _load_strategy(directory, fully_parallel))
    except CheckpointNotData as error:
        raise UserError(f"{source}: {error}; load an older checkpoint") from None
    except (Exception, CheckpointException) as error:  # torch's is a BaseException
        wrapped = [failure[0] for failure in getattr(error, "failures", {}).values()]
        not_data = next((e for e in wrapped if isinstance(e, CheckpointNotData)), None)
        if not_data is not None:
            raise UserError(f"{source}: {not_data}; load an older checkpoint") from None
        # megatron and torch raise many kinds for a checkpoint that does not fit
        reason = wrapped[0] if wrapped else error
        line = str(reason).strip().splitlines()[0][:200] if str(reason).strip() else ""
        raise UserError(f"{source}: the checkpoint does not fit this model "
                        f"({type(reason).__name__}: {line})") from None


def _describe(layout: dict) -> str:
    return (f"TP={layout['tensor_model_parallel_size']} "
            f"PP={layout['pipeline_model_parallel_size']} "
            f"EP={layout['expert_model_parallel_size']} world {layout['world_size']}"
            + (" distributed optimizer" if layout["use_distributed_optimizer"] else ""))


def load_model_weights(model_chunks, directory: Path, source: str,
                       not_in_checkpoint=lambda key: False) -> None:
    """Collective: only the model's weights (evaluation, a fine-tune's base), resharded.
    Weights for which `not_in_checkpoint(key)` holds (a fine-tune's new adapters) keep their
    values; every other weight must be in the checkpoint."""
    model = unwrap(model_chunks[0])
    sharded = {k: v for k, v in te_extra_state.not_read(model.sharded_state_dict()).items()
               if not not_in_checkpoint(k)}
    loaded = _read_as_data({"model": sharded}, directory, source)
    missing, unexpected = model.load_state_dict(te_extra_state.loadable(model, loaded["model"]),
                                                strict=False)
    missing = [k for k in missing if not not_in_checkpoint(k)]
    if missing or unexpected:  # dist_checkpointing already refused a key it could not fill
        raise UserError(f"{source}: the weights do not fit this model ({len(unexpected)} "
                        f"unexpected, {len(missing)} missing, e.g. {(unexpected or missing)[0]})")


def save_weights(model_chunks, root: str, settings: dict, config, run_state: dict) -> Path:
    """Collective: a checkpoint of the model's weights alone, as step 0 (`import-hf`,
    merge-lora): what `--finetune --load` and evaluate read, resharded to their layout.
    `run_state`: a fresh run's (`RunState().state_dict()`), recorded as a resume reads it."""
    from megatron_gnmr.checkpoints.safe_state import to_plain

    _start_writer_results_queue()
    staging = files.staging_directory(root, 0) if torch.distributed.get_rank() == 0 \
        else Path(root) / f"iter_{0:07d}.tmp"
    torch.distributed.barrier()
    state = {"model": te_extra_state.written_empty(unwrap(model_chunks[0]).sharded_state_dict()),
             "args": content.megatron_args(config, 0, unwrap(model_chunks[0])
                                           .embedding.word_embeddings.weight.shape[0]
                                           * config.parallel.tensor_model_parallel_size),
             "checkpoint_version": 3.0, "iteration": 0,
             "megatron_gnmr": to_plain({"run_state": run_state,
                                        "layout": content.layout(config),
                                        "settings": settings, "weights_only": True})}
    dist_checkpointing.save(state, str(staging), sharded_strategy=_save_strategy())
    torch.distributed.barrier()
    return files.finish(root, staging, 0, {"settings": settings,
                                           "layout": content.layout(config),
                                           "weights_only": True}, keep_last=1)
