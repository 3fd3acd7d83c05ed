"""The training loop: megatron-core's schedules, optimizer and LR scheduler, with the GNMR
controller between the gradient reduction and the optimizer step.

One step: forward/backward over the micro-batches (megatron's no-pipelining or 1F1B
schedule; DDP reduces gradients in `finalize_model_grads`) -> with `--gnmr`: per-unit
statistics (one all-reduce), decision for the next step, clipping with the same total
norm, `prepare_grads` + `step_with_ready_grads` (megatron's own clipping and its second
norm pass are off) -> without: megatron's `optimizer.step()` as is -> LR scheduler.
"""

from __future__ import annotations

import json
import math
import time
from functools import partial
from pathlib import Path

import torch
from megatron.core import parallel_state
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.distributed import finalize_model_grads
from megatron.core.pipeline_parallel import get_forward_backward_func

from megatron_gnmr.config import RunConfig
from megatron_gnmr.controller.runtime import Controller
from megatron_gnmr.controller.units import build_registry, local_unit_modules
from megatron_gnmr.data.datasets import BatchReader, build_datasets, resolve_data
from megatron_gnmr.errors import RunAborted, UserError
from megatron_gnmr.model import bind_precision, build_model, count_parameters, unwrap
from megatron_gnmr.precision.probes import build_probes
from megatron_gnmr.monitors.detectors.reference_runs import config_mismatches
from megatron_gnmr.monitors.runtime import MonitorSuite
from megatron_gnmr.observe.loggers import NullLogger, build_loggers
from megatron_gnmr.platform.device import run_device, to_run_device
from megatron_gnmr.precision.attention_fault import EmulatedFlashAttention, FaultSchedule
from megatron_gnmr.precision.plan import PrecisionPlan
from megatron_gnmr.training import checkpoint
from megatron_gnmr.training.distributed import is_logging_rank
from megatron_gnmr.training.faults import (
    NonFiniteInjector,
    maybe_corrupt_controller,
    maybe_sigkill,
)
from megatron_gnmr.training.run_state import RunState


class NonFiniteGradientError(RunAborted):
    pass


def _loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    losses = output_tensor.float().view(-1)
    mask = loss_mask.float().view(-1)
    loss = torch.sum(losses * mask) / mask.sum().clamp(min=1)
    # clone: the schedule divides the returned loss in place by the micro-batch count.
    return loss, {"lm loss": loss.detach().clone()}


def _forward_step(data_iterator, model):
    batch = to_run_device(next(data_iterator))
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, partial(_loss_func, batch["loss_mask"])


def build_optimizer(config: RunConfig, model_chunks, clip_in_megatron: bool):
    t = config.training
    optimizer_config = OptimizerConfig(
        optimizer="adam", lr=t.lr, min_lr=t.min_lr, weight_decay=t.weight_decay,
        adam_beta1=t.adam_beta1, adam_beta2=t.adam_beta2, adam_eps=1e-8,
        clip_grad=t.clip_grad if clip_in_megatron else 0.0,
        bf16=t.bf16, params_dtype=torch.bfloat16 if t.bf16 else torch.float32,
        use_distributed_optimizer=False,
    )
    optimizer = get_megatron_optimizer(optimizer_config, model_chunks)
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=t.lr, min_lr=t.min_lr,
        lr_warmup_steps=t.lr_warmup_iters, lr_decay_steps=t.train_iters,
        lr_decay_style="cosine", start_wd=t.weight_decay, end_wd=t.weight_decay,
        wd_incr_steps=t.train_iters, wd_incr_style="constant",
    )
    return optimizer, scheduler


def _reduce_loss(losses: list[dict]) -> float:
    """The step's mean loss on every rank (it exists on the last pipeline stage only)."""
    value = torch.zeros(1, dtype=torch.float64, device=run_device())
    if parallel_state.is_pipeline_last_stage() and losses:
        value[0] = sum(d["lm loss"].double() for d in losses) / len(losses)
    torch.distributed.all_reduce(value)
    copies = parallel_state.get_data_parallel_world_size() * \
        parallel_state.get_tensor_model_parallel_world_size()
    return float(value[0]) / copies


class Trainer:
    def __init__(self, config: RunConfig):
        self.config = config
        t = config.training
        self.data = resolve_data(config)
        self.model = build_model(config, self.data.tokenizer.vocab_size)
        self.plan = PrecisionPlan(all_recovery=config.precision.precision_static == "recovery"
                                  and not config.gnmr.enabled)
        units_here = local_unit_modules(self.model, config.model.num_layers,
                                        config.model.num_experts)
        registry = build_registry(self.model, config.model.num_layers, config.gnmr.units,
                                  config.model.num_experts) if config.gnmr.enabled else None
        probes = build_probes(config, registry)
        bind_precision(units_here, config, self.plan, probes)
        self.injector = NonFiniteInjector(t.inject_nonfinite, units_here)
        self.attention_fault = FaultSchedule(t.attention_fault_bits, t.attention_fault_start)
        for module in (m for chunk in self.model for m in chunk.modules()):
            if isinstance(module, EmulatedFlashAttention):
                module.schedule = self.attention_fault
        self.controller = None
        if config.gnmr.enabled:
            self.controller = Controller(config.gnmr, registry, self.model, self.plan,
                                         expert_parallel=bool(config.model.num_experts),
                                         probes=probes, seed=t.seed)
        self.monitors = MonitorSuite(config.monitor, self.model) if config.monitor.monitors \
            else None
        self.optimizer, self.scheduler = build_optimizer(
            config, self.model, clip_in_megatron=self.controller is None)
        # What megatron's schedules call after backward: DDP reduction and loss scaling.
        tconfig = unwrap(self.model[0]).config
        tconfig.finalize_model_grads_func = finalize_model_grads
        tconfig.grad_scale_func = self.optimizer.scale_loss
        self.eval_iters = t.eval_iters
        train, valid = build_datasets(config, self.data, self.eval_iters)
        self.train_reader = BatchReader(train, t.micro_batch_size, t.global_batch_size)
        self.valid_reader = BatchReader(valid, t.micro_batch_size, t.global_batch_size)
        self.state = RunState()
        self.run_dir = t.save
        self.logger = NullLogger()  # real loggers open after --load is validated
        self.forward_backward = get_forward_backward_func()

    def _run_monitors(self, step: int) -> None:
        if self.monitors is None:
            return
        metrics, alarms = self.monitors.after_step(step)
        if metrics:
            self.logger.log(step, metrics)
        for alarm in alarms:
            self.logger.event(step, "alarm", alarm)
        if self.controller is not None:  # the `monitor` risk signal reads the firing alarms
            self.controller.firing = self.monitors.firing()

    def _log_timeline_image(self, step: int) -> None:
        interval = self.config.logging.image_interval
        if self.controller is None or not self.controller.recent or not is_logging_rank():
            return
        if interval and (step % interval == 0 or step == self.config.training.train_iters):
            from megatron_gnmr.observe.report import timeline_figure

            name = Path(self.run_dir).name if self.run_dir else "run"
            figure = timeline_figure(self.controller.recent_run_log(name))
            self.logger.image(step, "gnmr/recovery_timeline", figure)
            figure.clf()

    # -- one step ---------------------------------------------------------------------
    def _forward_backward(self, batches, forward_only: bool):
        return self.forward_backward(
            forward_step_func=_forward_step, data_iterator=iter(batches), model=self.model,
            num_microbatches=len(batches), seq_length=self.config.model.seq_length,
            micro_batch_size=self.config.training.micro_batch_size,
            decoder_seq_length=self.config.model.seq_length, forward_only=forward_only)

    def train_step(self, step: int) -> dict:
        """Optimizer step number `step + 1` (reads the data of 0-based index `step`)."""
        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        self.attention_fault.step = step + 1
        losses = self._forward_backward(self.train_reader.step_batches(step), False)
        self.injector.corrupt(step + 1)
        metrics = {"train/loss": _reduce_loss(losses)}
        if self.controller is None:
            ok, grad_norm, _ = self.optimizer.step()
            metrics["train/grad_norm"] = float(grad_norm) if grad_norm is not None else math.nan
            metrics["train/skipped"] = int(not ok)
        else:
            metrics.update(self._controlled_optimizer_step(step + 1))
        if not metrics["train/skipped"]:  # as megatron: a skipped update does not advance LR
            self.scheduler.step(increment=1)
        return metrics

    def _controlled_optimizer_step(self, step: int) -> dict:
        controller = self.controller
        loss_scale = float(self.optimizer.get_loss_scale())
        stats = controller.grad_stats.compute(loss_scale)
        decision = controller.observe(stats, step)
        interval = self.config.gnmr.agreement_interval
        maybe_corrupt_controller(step, controller.policy)
        if interval and step % interval == 0:
            controller.verify_agreement(step)
        metrics = {"train/grad_norm": stats.total_norm, **controller.metrics(decision)}
        if decision.nonfinite or not math.isfinite(stats.total_norm):
            return {**metrics, **self._skip_nonfinite(step, decision)}
        self.state.nonfinite_streak = 0
        controller.grad_stats.clip_(stats.total_norm, self.config.training.clip_grad)
        found_inf = self.optimizer.prepare_grads()
        metrics["train/skipped"] = int(found_inf or not self.optimizer.step_with_ready_grads())
        return metrics

    def _skip_nonfinite(self, step: int, decision) -> dict:
        """A NaN/Inf gradient: report it, never apply it. The policy has already left it out
        of every history and put the unit on the recovery path for the next step."""
        names = [self.controller.registry.names[u] for u in decision.nonfinite] or ["non-unit"]
        self.logger.event(step, "nonfinite_gradient", {"units": names})
        self.state.nonfinite_streak += 1
        gnmr = self.config.gnmr
        if gnmr.nonfinite == "raise":
            raise NonFiniteGradientError(f"non-finite gradient at step {step} in {names} "
                                         "(--gnmr-nonfinite raise)")
        if self.state.nonfinite_streak >= gnmr.max_nonfinite_steps:
            raise NonFiniteGradientError(
                f"{self.state.nonfinite_streak} consecutive steps with non-finite gradients "
                f"(last at step {step} in {names}); stopping instead of skipping forever "
                "(--gnmr-max-nonfinite-steps)")
        return {"train/skipped": 1}

    @torch.no_grad()
    def evaluate(self) -> dict:
        for chunk in self.model:
            chunk.eval()
        total = 0.0
        for batch_index in range(self.eval_iters):
            losses = self._forward_backward(self.valid_reader.step_batches(batch_index), True)
            total += _reduce_loss(losses)
        for chunk in self.model:
            chunk.train()
        loss = total / self.eval_iters
        return {"valid/loss": loss, "valid/ppl": math.exp(min(loss, 50.0))}

    # -- checkpoints -------------------------------------------------------------------
    def checkpoint_meta(self) -> dict:
        m, p = self.config.model, self.config.parallel
        return {
            "model": {k: getattr(m, k) for k in ("num_layers", "hidden_size", "ffn_hidden_size",
                                                 "num_attention_heads", "num_query_groups",
                                                 "seq_length")},
            "vocab_size": self.data.tokenizer.vocab_size,
            "layout": {"tp": p.tensor_model_parallel_size, "pp": p.pipeline_model_parallel_size,
                       "world_size": torch.distributed.get_world_size()},
            "gnmr_units": self.controller.registry.names if self.controller else None,
        }

    def save(self, step: int) -> None:
        shard = {
            "model": [chunk.state_dict() for chunk in self.model],
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "rng": checkpoint.rng_state(),
            "run_state": self.state.state_dict(),
            "controller": self.controller.state_dict() if self.controller else None,
            "monitors": self.monitors.state_dict() if self.monitors else None,
        }
        path = checkpoint.save_checkpoint(self.run_dir, step, shard, self.checkpoint_meta(),
                                          self.config.training.keep_last)
        self.logger.event(step, "checkpoint", {"path": str(path)})

    def _keep_checkpoint(self) -> str:
        """Before stopping on bad gradients: make sure the last good state is on disk. The
        optimizer has not stepped, so the weights are those after step `state.step`."""
        if not self.run_dir:
            return "no --save directory, nothing was saved"
        latest = checkpoint.latest_checkpoint(self.run_dir)
        if latest is not None and latest.name == f"iter_{self.state.step:07d}":
            return f"the last checkpoint is {latest}"
        if self.state.step == 0:
            return "no step was completed, nothing to save"
        self.save(self.state.step)
        return f"saved the last good state to {checkpoint.latest_checkpoint(self.run_dir)}"

    def load(self, directory: Path) -> None:
        expected = self.checkpoint_meta()
        meta = checkpoint.check_compatible(directory, {k: expected[k] for k in
                                                       ("model", "vocab_size", "layout")})
        if self.controller is not None and meta.get("gnmr_units") not in (None,
                                                                          expected["gnmr_units"]):
            raise UserError(
                f"--load {directory}: the checkpoint's controller has "
                f"{len(meta['gnmr_units'])} units, this run selects "
                f"{len(expected['gnmr_units'])}; use the checkpoint's --gnmr-units")
        shard = checkpoint.load_shard(directory)
        for chunk, state in zip(self.model, shard["model"]):
            chunk.load_state_dict(state)
        self.optimizer.load_state_dict(shard["optimizer"])
        self.scheduler.load_state_dict(shard["scheduler"])
        self.state.load_state_dict(shard["run_state"])
        if self.controller is not None and shard["controller"] is not None:
            self.controller.load_state_dict(shard["controller"])
        if self.monitors is not None and shard.get("monitors") is not None:
            self.monitors.load_state_dict(shard["monitors"])
        checkpoint.set_rng_state(shard["rng"])

    # -- the run -----------------------------------------------------------------------
    def run(self) -> dict:
        t = self.config.training
        load = t.load
        if t.resume == "auto" and load is None and checkpoint.latest_checkpoint(t.save):
            load = t.save
        if load:
            directory = checkpoint.find_checkpoint(load)
            self.load(directory)
        self.logger = build_loggers(self.config, self.run_dir, torch.distributed.get_rank())
        if load:
            self.logger.event(self.state.step, "resumed", {"path": str(directory)})
        if self.controller is not None and self.run_dir and is_logging_rank():
            self.controller.open_trace(self.run_dir, self.state.step)
        self._announce()
        summary = {}
        if self.state.step == 0:
            first = self.evaluate()
            summary["initial_valid_loss"] = first["valid/loss"]
            self.logger.log(0, first)
        tokens_per_step = t.global_batch_size * self.config.model.seq_length
        while self.state.step < t.train_iters:
            step = self.state.step + 1
            if self.monitors is not None:
                self.monitors.before_step(step)
            start = time.perf_counter()
            try:
                metrics = self.train_step(self.state.step)
            except NonFiniteGradientError as error:
                raise NonFiniteGradientError(f"{error}; {self._keep_checkpoint()}") from None
            elapsed = time.perf_counter() - start
            self.state.step = step
            self.state.consumed_samples += t.global_batch_size
            metrics.update({"train/lr": self.scheduler.get_lr(self.optimizer.param_groups[0]),
                            "train/step_time_s": elapsed,
                            "train/tokens_per_s": tokens_per_step / elapsed,
                            "train/ppl": math.exp(min(metrics["train/loss"], 50.0))})
            self.state.last_loss = metrics["train/loss"]
            if step % t.log_interval == 0 or step == t.train_iters:
                self.logger.log(step, metrics)
            self._log_timeline_image(step)
            self._run_monitors(step)
            if step % t.eval_interval == 0 or step == t.train_iters:
                result = self.evaluate()
                summary["final_valid_loss"] = result["valid/loss"]
                self.logger.log(step, result)
            should_exit = t.exit_interval and step % t.exit_interval == 0
            if self.run_dir and ((t.save_interval and step % t.save_interval == 0)
                                 or step == t.train_iters or should_exit):
                self.save(step)
            maybe_sigkill(step)
            if should_exit:
                break
        summary.update({"steps": self.state.step, "final_train_loss": self.state.last_loss,
                        "unigram_entropy": self.data.unigram_entropy})
        if self.controller is not None:
            summary.update({f"gnmr/{k}": v for k, v in self.controller.policy.summary().items()})
        self.logger.event(self.state.step, "summary", summary)
        return summary

    def _announce(self) -> None:
        params = count_parameters(self.model)
        self.logger.event(self.state.step, "start", {
            "parameters_on_rank0": params,
            "world_size": torch.distributed.get_world_size(),
            "tp": self.config.parallel.tensor_model_parallel_size,
            "pp": self.config.parallel.pipeline_model_parallel_size,
            "dp": parallel_state.get_data_parallel_world_size(),
            "gnmr_units": self.controller.registry.num_units if self.controller else 0,
        })
        if self.run_dir and is_logging_rank():
            # What this run was, for reference-band checks and for whoever reads it later.
            (Path(self.run_dir) / "config.json").write_text(
                json.dumps(self.config.to_dict(), indent=2))
        references = self.config.monitor.monitor_reference
        if self.monitors is not None and references:
            for line in config_mismatches(references, self.config.to_dict()):
                self.logger.event(self.state.step, "warning", {"reference_mismatch": line})

    def close(self) -> None:
        if self.controller is not None:
            self.controller.close()
        self.logger.close()
