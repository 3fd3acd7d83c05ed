"""A trainer's checkpoints: what goes into a shard, what a resume must match, and loading
that every rank agrees on (`checkpoints/` owns the files and the formats, which this asks;
this owns the trainer's content).

A shard holds the model chunks, optimizer, scheduler, RNG, run state, controller and
monitor state. Transformer Engine's `_extra_state` entries are left out: TE pickles its FP8
metadata into them and unpickles it on load, which would let a crafted checkpoint run code,
and the current / block / MX scaling recipes (the only ones allowed here) keep no state there
that a resume needs; on load every module is given TE's empty "no FP8 state" instead, whatever
the shard holds, so no pickle is ever unpickled (`checkpoints/torch_dist/te_extra_state.py`).
"""

from __future__ import annotations

import math
import shutil
import time
from pathlib import Path

import torch

from megatron_gnmr.checkpoints import rng
from megatron_gnmr.checkpoints.choice import Choice, choose, latest_step
from megatron_gnmr.checkpoints.formats import checkpoint_format
from megatron_gnmr.checkpoints.optimizer_state import load_optimizer_state, optimizer_state
from megatron_gnmr.checkpoints.torch_dist import run as dist_run
from megatron_gnmr.checkpoints.torch_dist import te_extra_state
from megatron_gnmr.errors import UserError
from megatron_gnmr.platform import device_audit
from megatron_gnmr.training.consensus import on_every_rank
from megatron_gnmr.training.distributed import is_logging_rank
from megatron_gnmr.training.finetune import adapter_state, load_adapters
from megatron_gnmr.training.lr_schedule import upgrade_state as upgrade_scheduler_state
from megatron_gnmr.training.resume_contract import check_resume, resume_settings


def model_state(chunk: torch.nn.Module) -> dict:
    return te_extra_state.without_extra_state(chunk.state_dict())


def load_model_state(chunk: torch.nn.Module, state: dict) -> None:
    chunk.load_state_dict(te_extra_state.loadable(chunk, state))


class RunCheckpoints:
    def __init__(self, trainer):
        self.trainer = trainer
        self.async_saves = None
        if trainer.config.checkpoint.async_save:
            from megatron_gnmr.checkpoints.torch_dist.async_save import AsyncSaves

            self.async_saves = AsyncSaves()

    def settings(self) -> dict:
        trainer = self.trainer
        settings = resume_settings(trainer.config, trainer.data.fingerprint(),
                                   trainer.data.tokenizer.vocab_size,
                                   torch.distributed.get_world_size())
        if trainer.base is not None:
            settings["base checkpoint (--finetune --load) sha256"] = trainer.base["sha256"]
        return settings

    @property
    def adapters_only(self) -> bool:
        """A LoRA fine-tune saves its adapters; its base is --load's."""
        config = self.trainer.config
        return config.checkpoint.finetune and config.lora.enabled

    def save(self, step: int, last: bool = False, preempted: bool = False) -> None:
        """Collective: this step's checkpoint. With --async-save, written while training goes
        on unless it is the run's `last` (a stop, the end); published at a later `poll`. A
        `preempted` save (a stop by a signal or the time limit: a window before SIGKILL) does
        not wait for an async save in flight, which it supersedes, and publishes before it
        hashes (torch_dist; the torch format hashes while it writes)."""
        trainer = self.trainer
        if not math.isfinite(trainer.state.last_loss):  # never a checkpoint of a non-finite step
            trainer.logger.event(step, "checkpoint_skipped", {"reason": "non-finite loss"})
            return
        abandoned = self._abandon(step) if preempted else None
        self.wait()  # never two in flight
        started, started_at, published_at = time.perf_counter(), time.monotonic(), []
        asynchronous = None if last else self.async_saves
        publish_first = (lambda path: published_at.append(time.monotonic())) if preempted \
            else None
        path = self._write(step, asynchronous, lambda path, stall, publish: self._log(
            step, path, started, stall, snapshot_seconds=blocked, publish_seconds=publish),
            publish_first)
        blocked = time.perf_counter() - started  # what the loop lost (async: so far)
        if path is not None:  # complete on every rank when _write returns
            self._log(step, path, started, blocked,
                      **self._preemption_times(started_at, published_at))
        else:
            self.async_saves.charge(blocked)
        if abandoned is not None and torch.distributed.get_rank() == 0:
            shutil.rmtree(abandoned, ignore_errors=True)  # every rank's writer has ended

    def _abandon(self, step: int) -> Path | None:
        """Collective: end the async save in flight unpublished (a preemption's save of a
        newer step supersedes it). Returns its staging directory."""
        staging = self.async_saves.abandon() if self.async_saves is not None else None
        if staging is not None and is_logging_rank():
            self.trainer.logger.event(step, "checkpoint_abandoned", {
                "path": str(staging), "reason": "superseded by this step's save, which a "
                "stop does not make wait for it"})
        return staging

    def _preemption_times(self, started_at: float, published_at: list[float]) -> dict:
        """A preemption's save: when it was published (before its files were hashed), and
        how long after this rank's signal it was published and hashed."""
        if not published_at:
            return {}
        now = time.monotonic()
        times = {"published_seconds": published_at[0] - started_at}
        received = getattr(self.trainer.exit_requests, "received_at", None)
        if received is not None:
            times.update(signal_to_published_seconds=published_at[0] - received,
                         signal_to_hashed_seconds=now - received)
        return times

    def _log(self, step: int, path: Path, started: float, stall: float, **parts) -> None:
        """`loop_seconds`: all the loop lost to this save (async: the snapshot and fork, the
        polls while it was written and the finalize that published it, in `parts`)."""
        if is_logging_rank():
            self.trainer.logger.event(step, "checkpoint", {
                "path": str(path), "seconds": round(time.perf_counter() - started, 3),
                "loop_seconds": round(stall, 3),
                **{name: round(seconds, 3) for name, seconds in parts.items()},
                "bytes": sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())})

    def poll(self) -> None:
        """Collective, once per step: publish an async save that has finished writing."""
        if self.async_saves is not None:
            self.async_saves.poll()

    def wait(self) -> None:
        """Collective: until an async save in flight is published."""
        if self.async_saves is not None:
            self.async_saves.wait()

    def _write(self, step: int, asynchronous=None, published=None,
               publish_first=None) -> Path | None:
        trainer = self.trainer
        trainer.controller.verify_agreement(step)
        fmt = checkpoint_format(trainer.config.checkpoint.ckpt_format)
        return fmt.save(self, step, asynchronous, published, publish_first)

    def per_rank_shard(self) -> dict:
        """This rank's whole state, for a format that writes one file per rank."""
        trainer = self.trainer
        state_of = adapter_state if self.adapters_only else model_state
        with trainer.overlap.whole_weights():
            models = [state_of(chunk) for chunk in trainer.model]
        return {
            "model": models,
            "optimizer": optimizer_state(trainer.optimizer),
            "scheduler": trainer.scheduler.state_dict(),
            "rng": rng.rng_state(),
            "run_state": trainer.state.state_dict(),
            "controller": trainer.controller.state_dict(),
            "monitors": trainer.monitors.state_dict(),
        }

    def per_rank_meta(self) -> dict:
        """What a per-rank checkpoint's meta.json records beside its shards."""
        trainer = self.trainer
        meta = {"settings": self.settings()}
        if trainer.config.lora.enabled:  # what merge-lora needs; `base`: adapters-only
            meta["lora"] = {"base": trainer.base if self.adapters_only else None,
                            **trainer.config.to_dict()["lora"]}
        return meta

    def keep(self) -> str:
        """Before stopping on bad gradients: make sure the last good state is on disk. The
        optimizer has not stepped, so the weights are those after step `state.step`."""
        trainer = self.trainer
        if not trainer.run_dir:
            return "no --save directory, nothing was saved"
        if latest_step(trainer.run_dir) == trainer.state.step and trainer.state.step:
            return f"the last checkpoint is of step {trainer.state.step}, in {trainer.run_dir}"
        if trainer.state.step == 0:
            return "no step was completed, nothing to save"
        self.save(trainer.state.step, last=True)
        return f"saved the last good state (step {trainer.state.step}) in {trainer.run_dir}"

    def load(self, source: str) -> Choice:
        """Collective: choose (every rank the same, either format), check the settings, read
        and apply on every rank with one agreement, then prove the controllers agree."""
        choice = choose(source, self.trainer.config.checkpoint.ckpt_step)
        fmt = choice.format
        saved = fmt.read_saved(choice.directory)
        check_resume(choice.directory, saved.get("settings"), self.settings(),
                     reshardable=fmt.reshards)
        notes: list[str] = []
        on_every_rank(lambda: notes.extend(fmt.restore(self, choice.directory, saved)))
        choice.warnings.extend(notes)
        self.trainer.controller.verify_agreement(self.trainer.state.step)
        return choice

    def restore_sharded(self, directory: Path, saved: dict) -> list[str]:
        """A resharding format's checkpoint into the trainer (`formats.py` calls it)."""
        trainer, t = self.trainer, self.trainer.config.checkpoint
        notes = dist_run.load(trainer, directory, saved, load_optimizer=not t.no_load_optim,
                              load_rng=not t.no_load_rng)
        if not t.no_load_optim:
            self._load_scheduler(directory, saved["opt_param_scheduler"])
        _check_restored_devices(trainer)
        return notes

    def _load_scheduler(self, directory: Path, state: dict) -> None:
        """Megatron's rule: the checkpoint's schedule must equal this run's unless one of
        --override-opt-param-scheduler / --use-checkpoint-opt-param-scheduler says which
        wins (extending a run changes its lengths)."""
        try:
            self.trainer.scheduler.load_state_dict(state)
        except AssertionError as error:
            raise UserError(f"--load {directory}: the learning-rate schedule differs from the "
                            f"checkpoint's ({str(error).strip()[:160]}); keep this run's with "
                            "--override-opt-param-scheduler, or the checkpoint's with "
                            "--use-checkpoint-opt-param-scheduler") from None

    def restore_shard(self, directory: Path, shard: dict) -> list[str]:
        """This rank's shard of a per-rank checkpoint into the trainer (`formats.py`)."""
        trainer, notes = self.trainer, []
        try:
            for chunk, state in zip(trainer.model, shard["model"], strict=True):
                if self.adapters_only:
                    load_adapters(chunk, state, f"--load {directory}")
                else:
                    load_model_state(chunk, state)
            load_optimizer_state(trainer.optimizer, shard["optimizer"])
            trainer.scheduler.load_state_dict(upgrade_scheduler_state(
                shard["scheduler"], shard["run_state"]["step"],
                trainer.config.training.global_batch_size))
            trainer.state.load_state_dict(shard["run_state"])
            trainer.controller.load_state_dict(shard["controller"])
            trainer.monitors.load_state_dict(shard["monitors"])
            notes += rng.restore_rng(shard["rng"], trainer.config.training.seed,
                                            trainer.state.step)
            _check_restored_devices(trainer)
        except (KeyError, ValueError, RuntimeError, TypeError, AssertionError) as error:
            first_line = str(error).strip().splitlines()[0][:160] if str(error).strip() else ""
            raise UserError(f"--load {directory}: the shard does not fit this run "
                            f"({type(error).__name__}: {first_line})") from None
        return notes


def _check_restored_devices(trainer) -> None:
    """Under the device audit: every tensor restored into the run's live state has left the
    host (what a GPU run needs; `platform/device_audit.py`)."""
    optimizers = getattr(trainer.optimizer, "chained_optimizers", [trainer.optimizer])
    device_audit.check_restored("the model", [chunk.state_dict() for chunk in trainer.model])
    device_audit.check_restored("the optimizer", [dict(getattr(o, "optimizer", o).state)
                                                  for o in optimizers])
    device_audit.check_restored("the monitors", trainer.monitors.state_dict())
    device_audit.check_restored("the controller", trainer.controller.state_dict())
