"""The training loop: megatron-core's schedules, optimizer and LR scheduler, with one step
component around the update.

One step: forward/backward over the micro-batches (megatron's no-pipelining or 1F1B
schedule; DDP reduces gradients in `finalize_model_grads`) -> `controller.after_backward`
(the GNMR controller: per-unit statistics in one all-reduce, clipping with the same norm; or
`PlainStep`: megatron's own norm pass and clipping) -> the update, only if the outcome says
every gradient and the loss are finite -> LR scheduler -> monitors (they read the updated
weights) -> `controller.decide` (the plan of the next step from this step's statistics and
the alarms of this step's check, so an alarm acts within one step). The loop never asks
whether there is a controller or monitors: their stand-ins answer the same calls.

Setup runs in two kinds of phase: local work (data, model, controller, monitors), after
which all ranks agree that every rank succeeded (`consensus.on_every_rank`), and collective
work (optimizer, datasets, checkpoint choice), which every rank reaches together.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from functools import partial
from pathlib import Path

import torch
from megatron.core import parallel_state
from megatron.core.distributed import finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func

from megatron_gnmr.config import RunConfig
from megatron_gnmr.controller.runtime import Controller
from megatron_gnmr.controller.units import UnitShape, build_registry, local_unit_modules
from megatron_gnmr.data.datasets import (
    BatchReader,
    build_datasets,
    prepare_default_data,
    resolve_data,
)
from megatron_gnmr.data.mixture import mixture
from megatron_gnmr.errors import RunAborted
from megatron_gnmr.lora.adapters import lora_units
from megatron_gnmr.model_families import family_of
from megatron_gnmr.model import (
    attention_backend_note,
    bind_precision,
    build_model,
    count_parameters,
    padded_vocab_size,
    unwrap,
)
from megatron_gnmr.monitors.detectors.reference_runs import config_mismatches
from megatron_gnmr.monitors.runtime import MonitorSuite, NoMonitors
from megatron_gnmr.observe.loggers import NullLogger, build_loggers
from megatron_gnmr.platform.device import run_device, to_run_device
from megatron_gnmr.platform.housekeeping import Housekeeping
from megatron_gnmr.precision.attention_fault import fault_schedule
from megatron_gnmr.precision.attention_unit import EmulatedFlashAttention, bind_attention
from megatron_gnmr.precision.backends import backend as precision_backend
from megatron_gnmr.precision.plan import PrecisionPlan
from megatron_gnmr.precision.scaling import set_quantizer_compile
from megatron_gnmr.precision.unit_costs import RecoveredShare
from megatron_gnmr.precision.kept_high import kept_high
from megatron_gnmr.precision.probes import build_probes
from megatron_gnmr.training import run_directory
from megatron_gnmr.checkpoints.choice import checkpoint_steps
from megatron_gnmr.training.consensus import on_every_rank
from megatron_gnmr.training.distributed import is_logging_rank
from megatron_gnmr.training.exit_signals import ExitRequests
from megatron_gnmr.training.faults import NO_FAULTS, FaultHooks
from megatron_gnmr.training.finetune import load_base_weights
from megatron_gnmr.training.layer_compile import CompileLog, compile_layers
from megatron_gnmr.training.lr_schedule import build_scheduler
from megatron_gnmr.training.memory_estimate import GIB
from megatron_gnmr.training.memory_estimate import estimate as estimate_memory
from megatron_gnmr.training.optimizer_stats import params_norm, zeros_in_grad
from megatron_gnmr.training.overlap import CommunicationOverlap
from megatron_gnmr.training.plain_step import PlainStep
from megatron_gnmr.training.resume import RunCheckpoints
from megatron_gnmr.training.run_state import RunState
from megatron_gnmr.training.throughput import step_flops


class NonFiniteGradientError(RunAborted):
    pass


def _loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    losses = output_tensor.float().view(-1)
    mask = loss_mask.float().view(-1)
    loss = torch.sum(losses * mask) / mask.sum().clamp(min=1)
    # clone: the schedule divides the returned loss in place by the micro-batch count.
    return loss, {"lm loss": loss.detach().clone()}


def _per_token_loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """--calculate-per-token-loss: megatron-core's contract (the loss summed, its token count;
    the schedule divides the gradients by the step's count)."""
    losses = output_tensor.float().view(-1)
    mask = loss_mask.float().view(-1)
    total, tokens = torch.sum(losses * mask), mask.sum()
    return total, tokens.int(), {"lm loss": torch.stack([total.detach(), tokens.detach()])}


def _forward_step(data_iterator, model, per_token: bool = False):
    batch = to_run_device(next(data_iterator))
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, partial(_per_token_loss_func if per_token else _loss_func,
                           batch["loss_mask"])


def build_optimizer(config: RunConfig, model_chunks, clip_in_megatron: bool):
    t = config.training
    optimizer_config = OptimizerConfig(
        optimizer="adam", lr=t.lr, min_lr=t.min_lr, weight_decay=t.weight_decay,
        adam_beta1=t.adam_beta1, adam_beta2=t.adam_beta2, adam_eps=t.adam_eps,
        decoupled_lr=t.decoupled_lr, decoupled_min_lr=t.decoupled_min_lr,
        clip_grad=t.clip_grad if clip_in_megatron else 0.0,
        bf16=t.bf16, params_dtype=torch.bfloat16 if t.bf16 else torch.float32,
        use_distributed_optimizer=config.parallel.use_distributed_optimizer,
    )
    optimizer = get_megatron_optimizer(optimizer_config, model_chunks)
    ck = config.checkpoint
    return optimizer, build_scheduler(t, optimizer, override=ck.override_opt_param_scheduler,
                                      use_checkpoint=ck.use_checkpoint_opt_param_scheduler)


def _reduce_loss(losses: list[dict]) -> float:
    """The step's mean loss on every rank (it exists on the last pipeline stage only): the
    mean over micro-batches, or with per-token losses ([sum, tokens] each) over tokens."""
    value = torch.zeros(2, dtype=torch.float64, device=run_device())
    if parallel_state.is_pipeline_last_stage() and losses:
        if losses[0]["lm loss"].numel() == 2:
            value += sum(d["lm loss"].double() for d in losses)
        else:
            value[0] = sum(d["lm loss"].double() for d in losses) / len(losses)
            value[1] = 1.0
    torch.distributed.all_reduce(value)
    return float(value[0] / value[1])


class Trainer:
    def __init__(self, config: RunConfig):
        self.config = config
        t = config.training
        self.faults = NO_FAULTS
        on_every_rank(lambda: prepare_default_data(config.data) if is_logging_rank() else None)
        on_every_rank(self._build_locally)
        self.optimizer, self.scheduler = build_optimizer(
            config, self.model, clip_in_megatron=not config.gnmr.enabled)
        # --decoupled-lr, logged as Megatron-LM logs it: the embedding's and output layer's
        # own schedule, on the stages that hold them (megatron-core 0.16+ marks their group by
        # its max_lr, not by is_decoupled_lr)
        self.decoupled_group = None if t.decoupled_lr is None else next(
            (g for g in self.optimizer.param_groups if g.get("max_lr") == t.decoupled_lr), None)
        # What megatron's schedules call after backward: DDP reduction and loss scaling.
        tconfig = unwrap(self.model[0]).config
        tconfig.finalize_model_grads_func = finalize_model_grads
        tconfig.grad_scale_func = self.optimizer.scale_loss
        self.overlap = CommunicationOverlap(config.parallel, self.model, tconfig)
        self.eval_iters = t.eval_iters
        train, valid = build_datasets(
            config.data, self.data, config.model.seq_length, t.seed,
            train_samples=t.train_iters * t.global_batch_size,
            valid_samples=max(self.eval_iters, 1) * t.global_batch_size)
        self.mixture = mixture(train, t.train_iters * t.global_batch_size) \
            if self.data.plan is not None else []
        self.train_reader = BatchReader(train, t.micro_batch_size, t.global_batch_size,
                                        config.data.num_workers)
        self.valid_reader = BatchReader(valid, t.micro_batch_size, t.global_batch_size)
        self.state = RunState()
        self.base = None  # --finetune: the base checkpoint's identity
        self.run_dir = config.checkpoint.save
        self.logger = NullLogger()  # real loggers open after --load is validated
        self.forward_backward = get_forward_backward_func()
        self.housekeeping = Housekeeping(config.housekeeping, config.checkpoint.save)
        self.exit_requests: ExitRequests | None = None  # run() installs them
        self.padded_vocab_size = padded_vocab_size(self.data.tokenizer.vocab_size, config)
        self.flops_per_step = step_flops(config, self.padded_vocab_size)
        self.checkpoints = RunCheckpoints(self)

    def _build_locally(self) -> None:
        """Everything that runs no collective: a failure here is agreed on by all ranks."""
        config, t = self.config, self.config.training
        self.data = resolve_data(config.data)
        self.model = build_model(config, self.data.tokenizer.vocab_size)
        shape = UnitShape.of_run(config)
        self.plan = PrecisionPlan(all_recovery=config.precision.precision_static == "recovery",
                                  always=kept_high(config.precision, shape.names()))
        self.unit_order = shape.names()
        costs = RecoveredShare(config, self.unit_order)
        self.recovered_share = costs if config.precision.precision_recipe != "none" else None
        units_here = local_unit_modules(self.model, shape)
        registry = build_registry(self.model, shape, config.gnmr.units, lora_units(config)) \
            if config.gnmr.enabled else None
        probes = build_probes(config, registry)
        linears = {name: m for name, m in units_here.items()
                   if not isinstance(m, EmulatedFlashAttention)}
        bind_precision(linears, config, self.plan, probes)
        self.faults = FaultHooks(t.inject_nonfinite, linears, from_environment=True)
        self.attention_fault = fault_schedule(t, config.model.num_layers)
        attention_sums = bind_attention(self.model, units_here, self.plan, config,
                                        self.attention_fault, registry, probes)
        set_quantizer_compile(t.quantizer_compile)
        if t.compile:  # after binding: a compiled unit reads its path from the runtime
            compile_layers(self.model)
        self.compile_log = CompileLog(t.compile)
        self.controller = Controller(
            config.gnmr, registry, self.model, self.plan,
            expert_parallel=bool(config.model.num_experts), probes=probes, seed=t.seed,
            clip_grad=t.clip_grad, faults=self.faults,
            sharded_gradients=config.parallel.use_distributed_optimizer,
            attention_sums=attention_sums, unit_costs=costs.budget_costs(registry.names),
        ) if config.gnmr.enabled else PlainStep()
        self.monitors = MonitorSuite(config.monitor, self.model, shape.names(),
                                     family_of(config)) \
            if config.monitor.monitors else NoMonitors()

    def _log_timeline_image(self, step: int) -> None:
        interval = self.config.logging.image_interval
        if not interval or not is_logging_rank() or \
                not (step % interval == 0 or step == self.config.training.train_iters):
            return
        window = self.controller.recent_window()
        if window is None:
            return
        import matplotlib.pyplot as plt

        from megatron_gnmr.observe.report import RunLog, timeline_figure

        name = Path(self.run_dir).name if self.run_dir else "run"
        figure = timeline_figure(RunLog(name, [], window["units"], window["recovery"],
                                        window["gnmr"], window["alpha"], window["first_step"]))
        self.logger.image(step, "gnmr/recovery_timeline", figure)
        plt.close(figure)

    # -- one step ---------------------------------------------------------------------
    def _forward_backward(self, batches, forward_only: bool):
        per_token = self.config.training.calculate_per_token_loss
        return self.forward_backward(
            forward_step_func=partial(_forward_step, per_token=per_token),
            data_iterator=iter(batches), model=self.model,
            num_microbatches=len(batches), seq_length=self.config.model.seq_length,
            micro_batch_size=self.config.training.micro_batch_size,
            decoder_seq_length=self.config.model.seq_length, forward_only=forward_only)

    def train_step(self, step: int) -> dict:
        """Optimizer step number `step + 1` (reads the data of 0-based index `step`), the
        monitors' check of the weights it leaves, and the controller's plan for the next step
        (after the check, so an alarm raised at it already acts on the next step)."""
        self.monitors.before_step(step + 1)
        # the plan of this step, as a share of the units' GEMM FLOPs on the recovery path
        spent = {"precision/recovered_flop_share": self.recovered_share.of(self.plan)} \
            if self.recovered_share is not None else {}
        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        self.attention_fault.step = step + 1
        losses = self._forward_backward(self.train_reader.step_batches(step), False)
        self.faults.corrupt_gradients(step + 1)
        loss = _reduce_loss(losses)
        outcome = self.controller.after_backward(step + 1, self.optimizer, loss)
        stats, asked = self.config.logging, {}  # Megatron-LM's optional statistics
        if stats.log_num_zeros_in_grad:  # the gradients as the update will read them
            asked["train/num_zeros_in_grad"] = zeros_in_grad(self.optimizer)
        applied = outcome.apply and self.optimizer.step_with_ready_grads()
        if applied:  # as megatron: a skipped update does not advance the LR schedule
            self.scheduler.step(increment=self.config.training.global_batch_size)
            self.overlap.after_update()
        if outcome.nonfinite:
            self._nonfinite(step + 1, outcome.nonfinite)
        else:
            self.state.nonfinite_streak = 0
        if stats.log_params_norm:
            asked["train/params_norm"] = params_norm(self.optimizer)
        self._run_monitors(step + 1)
        return {"train/loss": loss, "train/grad_norm": outcome.grad_norm,
                "train/skipped": int(not applied), **spent, **asked,
                **self.controller.decide(step + 1, self.monitors.alarmed()),
                **self.compile_log.after_step(step + 1)}

    def _nonfinite(self, step: int, names: tuple[str, ...]) -> None:
        """A NaN/Inf: reported, never applied. With the controller the unit runs the recovery
        path next step (`--gnmr-nonfinite skip`); without one there is no recovery path, so
        the run stops with its last good checkpoint."""
        self.logger.event(step, "nonfinite_gradient", {"units": list(names)})
        self.state.nonfinite_streak += 1
        gnmr = self.config.gnmr
        if not gnmr.enabled:
            raise NonFiniteGradientError(
                f"non-finite {' and '.join(names)} at step {step}; without --gnmr there is no "
                "recovery path, so the update was not applied and the run stops")
        if gnmr.nonfinite == "raise":
            raise NonFiniteGradientError(f"non-finite gradient at step {step} in {list(names)} "
                                         "(--gnmr-nonfinite raise)")
        if self.state.nonfinite_streak >= gnmr.max_nonfinite_steps:
            raise NonFiniteGradientError(
                f"{self.state.nonfinite_streak} consecutive steps with non-finite gradients "
                f"(last at step {step} in {list(names)}); stopping instead of skipping forever "
                "(--gnmr-max-nonfinite-steps)")

    @torch.no_grad()
    def evaluate(self) -> dict:
        for chunk in self.model:
            chunk.eval()
        total = 0.0
        with self.overlap.whole_weights():
            for batch_index in range(self.eval_iters):
                losses = self._forward_backward(self.valid_reader.step_batches(batch_index),
                                                True)
                total += _reduce_loss(losses)
        for chunk in self.model:
            chunk.train()
        loss = total / self.eval_iters
        return {"valid/loss": loss, "valid/ppl": math.exp(min(loss, 50.0))}

    # -- the run -----------------------------------------------------------------------
    def run(self) -> dict:
        t, ck = self.config.training, self.config.checkpoint
        # SIGTERM and --exit-duration-in-mins, for the run's lifetime: close() gives the
        # signals back (a process that builds a Trainer and fails keeps its own handlers)
        self.exit_requests = ExitRequests(ck)
        run_directory.honour_stop_marker(ck.save)
        if ck.overwrite and is_logging_rank():
            run_directory.clear_for_overwrite(ck.save)
        torch.distributed.barrier()
        own = ck.save if run_directory.resumes(ck) and checkpoint_steps(ck.save) else None
        if ck.finetune:  # the base's weights, then (resuming) this fine-tune's own state
            self.base = load_base_weights(self.model, ck.load, self.checkpoints.settings())
            source = own
        else:
            source = ck.load or own
        started = time.perf_counter()
        choice = self.checkpoints.load(source) if source else None
        load_seconds = round(time.perf_counter() - started, 3)
        self.logger = build_loggers(self.config, self.run_dir, torch.distributed.get_rank(),
                                    resume_step=self.state.step)
        if choice is not None:
            for warning in choice.warnings:
                self.logger.event(self.state.step, "warning", {"checkpoint": warning})
            self.logger.event(self.state.step, "resumed", {"path": str(choice.directory),
                                                           "seconds": load_seconds})
        if self.run_dir and is_logging_rank():
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
            start = time.perf_counter()
            self.checkpoints.poll()  # an async save's publication: in the step it stalls
            self.housekeeping.before_step(step)
            try:
                metrics = self.train_step(self.state.step)
            except NonFiniteGradientError as error:
                raise NonFiniteGradientError(f"{error}; {self.checkpoints.keep()}") from None
            elapsed = time.perf_counter() - start
            self.state.step = step
            self.housekeeping.after_step(step)
            metrics.update({"train/lr": self.scheduler.get_lr(self.optimizer.param_groups[0]),
                            "train/step_time_s": elapsed,
                            "train/tokens_per_s": tokens_per_step / elapsed,
                            "train/ppl": math.exp(min(metrics["train/loss"], 50.0))})
            if self.decoupled_group is not None:
                metrics["train/decoupled_lr"] = self.scheduler.get_lr(self.decoupled_group)
            if self.config.housekeeping.log_throughput:
                metrics["train/tflops_per_device"] = self.flops_per_step / elapsed / \
                    torch.distributed.get_world_size() / 1e12
            self.state.last_loss = metrics["train/loss"]
            self.logger.log(step, metrics)  # each logger keeps its interval (build_loggers)
            self._log_timeline_image(step)
            if step % t.eval_interval == 0 or step == t.train_iters:
                result = self.evaluate()
                summary["final_valid_loss"] = result["valid/loss"]
                self.logger.log(step, result)
                self.housekeeping.after_evaluation()
            should_exit = ck.exit_interval and step % ck.exit_interval == 0
            if stop := self.exit_requests.reason():
                self.logger.event(step, "exit", {"reason": stop})
                summary["exit"] = stop
                should_exit = True
            if self.state.divergence.observe(step, metrics["train/loss"]) and \
                    t.stop_on_divergence:
                self.logger.event(step, "diverged", {"stopping": True})
                summary["diverged_at"] = step
                should_exit = True
            last = step == t.train_iters or should_exit
            if self.run_dir and ((ck.save_interval and step % ck.save_interval == 0) or last):
                self.checkpoints.save(step, last=last, preempted=stop is not None)
            self.faults.maybe_kill(step)
            if should_exit:
                break
        self.checkpoints.wait()
        summary.update({"steps": self.state.step, "final_train_loss": self.state.last_loss,
                        "unigram_entropy": self.data.unigram_entropy,
                        **self.controller.summary()})
        self.logger.event(self.state.step, "summary", summary)
        return summary

    def _run_monitors(self, step: int) -> None:
        reads = self.monitors.reads_weights(step)
        with self.overlap.whole_weights() if reads else contextlib.nullcontext():
            metrics, alarms = self.monitors.after_step(step)
        if metrics:
            self.logger.log(step, metrics)
        for alarm in alarms:
            self.logger.event(step, "alarm", alarm)

    def _announce(self) -> None:
        note = precision_backend(self.config.precision).start_note
        message = note(self.config, torch.distributed.get_world_size()) if note else None
        if message:
            self.logger.event(self.state.step, "notice", {"precision": message})
        if attention_note := attention_backend_note(self.config):
            self.logger.event(self.state.step, "notice", {"attention": attention_note})
        memory = estimate_memory(self.config, torch.distributed.get_world_size())
        self.logger.event(self.state.step, "memory_estimate", {
            "layout": memory.note, **{f"{name}_GiB": round(getattr(memory, name) / GIB, 2)
                                      for name in ("weights", "gradients", "optimizer",
                                                   "activations", "total")}})
        if len(self.mixture) > 1:
            self.logger.event(self.state.step, "data_mixture", {"datasets": self.mixture})
        params = count_parameters(self.model)
        self.logger.event(self.state.step, "start", {
            "parameters_on_rank0": params,
            "world_size": torch.distributed.get_world_size(),
            "tp": self.config.parallel.tensor_model_parallel_size,
            "pp": self.config.parallel.pipeline_model_parallel_size,
            "dp": parallel_state.get_data_parallel_world_size(),
            "gnmr_units": len(self.controller.unit_names),
            **({"trainable_on_rank0": sum(p.numel() for chunk in self.model
                                          for p in chunk.parameters() if p.requires_grad)}
               if self.config.lora.enabled else {}),
            **({"kept_in_bf16": sorted(self.plan.always, key=self.unit_order.index)}
               if self.plan.always else {}),
            **({"attention_fault_layers": sorted(self.attention_fault.layers)}
               if self.attention_fault.bits else {}),
        })
        if self.run_dir and is_logging_rank():
            # What this run was, for reference-band checks and for whoever reads it later.
            (Path(self.run_dir) / "config.json").write_text(
                json.dumps(self.config.to_dict(), indent=2))
        references = self.config.monitor.monitor_reference
        if self.config.monitor.monitors and references:
            for line in config_mismatches(references, self.config.to_dict()):
                self.logger.event(self.state.step, "warning", {"reference_mismatch": line})

    def close(self) -> None:
        self.controller.close()
        self.logger.close()
        self.train_reader.close()
        self.housekeeping.close()
        if self.exit_requests is not None:
            self.exit_requests.close()
