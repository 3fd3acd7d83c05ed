"""gpu_check's two groups of arms, each an FP8 backend against its own BF16 baseline:

| group | BF16 arm | FP8 arm | controller on | recovery part |
|---|---|---|---|---|
| Transformer Engine | `te` (TE's layers, BF16) | `te-fp8` | `te-fp8+gnmr` | (a) |
| torchao, compiled | megatron's BF16 layers | `fp8-torchao` | `fp8-torchao+gnmr` | (d) |

A group's arms are built from one seed and trained side by side (parts (b) and training),
then the two FP8 arms, with and without the controller, are stepped with the step
component's work timed (part (c)), then the FP8 arm's units are forced onto the recovery path
for one step and back (parts (a), (d)). Only one group's trainers live at a time (three
trainers of the 2-layer, hidden-4096 model fit one H100 with room to spare; six would not).
Whatever cannot run fails its rows with the reason.
"""

from __future__ import annotations

import contextlib
import gc
import sys
import time
from dataclasses import dataclass
from typing import Callable

from megatron_gnmr.gpu_check import recovery
from megatron_gnmr.gpu_check import speed
from megatron_gnmr.gpu_check.table import Row, cannot_run, info, rows_or_cannot_run

# The controller does all its per-step work (statistics, scores, decision) but recovers
# nothing: what (c) measures is its overhead, not the BF16 GEMMs of the units it recovers
# (that is recovery's intended cost), and under torch.compile each new recovery set would
# recompile the layers (issue 59), minutes the check does not have.
GNMR = ["--gnmr", "--gnmr-agreement-interval", "0", "--gnmr-max-o", "0"]
SPEED, CONTROLLER, TRAINING = "(b) FP8 pays", "(c) controller's cost", "training"


@dataclass(frozen=True)
class Group:
    reference: str
    fp8: str
    controlled: str
    flags: dict[str, list[str]]
    recovery_part: str
    compile_backend: str | None
    """torch.compile backend for every arm's layers (None: eager)."""
    missing: Callable[[], str | None]
    """Why this group cannot run here, or None."""
    fp8_context: Callable[[object], Callable[[str], object]] = \
        lambda trainer: (lambda unit: contextlib.nullcontext())
    """trainer -> (unit name -> the FP8 autocast its layer runs in)."""


def _te_missing() -> str | None:
    from megatron_gnmr.platform import capabilities

    support = capabilities.te_recipe("tensorwise")
    return None if support else f"Transformer Engine FP8 (tensorwise): {support.reason}"


def _torchao_missing() -> str | None:
    from megatron_gnmr.precision.torchao_compat import torchao_version

    return None if torchao_version() is not None else \
        "torchao is not installed (pip install -e .[torchao])"


def _megatron_fp8_context(trainer):
    """Megatron's own FP8 autocast for a unit's layer: the recipe and amax group it trains
    with (`fp8_utils.get_fp8_context`, megatron-core 0.16 and 0.19)."""
    from megatron.core.fp8_utils import get_fp8_context

    from megatron_gnmr.model import unwrap

    config = unwrap(trainer.model[0]).config
    return lambda unit: get_fp8_context(config, recovery.layer_index(unit))


def groups(base: list[str], reference: str, compile_backend: str) -> list[Group]:
    """The two groups over the model flags `base`; `reference` names the BF16 arm (`fp32`
    in the CPU smoke run)."""
    te_fp8 = [*base, "--precision-recipe", "te-fp8", "--fp8-recipe", "tensorwise"]
    torchao = [*base, "--precision-recipe", "fp8-torchao"]
    compiled = " (compiled)"
    return [
        Group("te", "te-fp8", "te-fp8+gnmr",
              {"te": [*base, "--precision-recipe", "te"], "te-fp8": te_fp8,
               "te-fp8+gnmr": [*te_fp8, *GNMR]},
              "(a) te-fp8 recovery", None, _te_missing, _megatron_fp8_context),
        Group(reference + compiled, "fp8-torchao" + compiled, "fp8-torchao+gnmr" + compiled,
              {reference + compiled: base, "fp8-torchao" + compiled: torchao,
               "fp8-torchao+gnmr" + compiled: [*torchao, *GNMR]},
              "(d) torchao recovery", compile_backend, _torchao_missing),
    ]


def expected(group: Group) -> dict[str, list[tuple[str, str]]]:
    """The (part, check) of every row a group produces, by stage."""
    return {
        "train": [(SPEED, speed.fp8_pays_check(group.fp8, group.reference)),
                  *((TRAINING, speed.loss_check(arm, group.reference))
                    for arm in (group.fp8, group.controlled))],
        "controller": [(CONTROLLER, check)
                       for check in speed.controller_checks(group.controlled, group.fp8)],
        "recovery": [(group.recovery_part, check) for check in recovery.CHECKS],
    }


def run_group(group: Group, steps: int, warmup: int, work_steps: int, judge: bool) -> list[Row]:
    """Every row of the group: measured, or failed with the reason it could not run."""
    checks = expected(group)
    reason = group.missing()
    if reason is not None:
        return [cannot_run(part, check, reason)
                for stage in checks.values() for part, check in stage]
    from megatron_gnmr.gpu_check.arms import (CompiledLayers, Stepper, build_trainers,
                                              transformer_layers)

    state = {}

    def train() -> list[Row]:
        trainers = state["trainers"] = build_trainers(group.flags)
        _progress(f"built {', '.join(trainers)}")
        if group.compile_backend is not None:
            layers = [layer for trainer in trainers.values()
                      for layer in transformer_layers(trainer)]
            state["compiled"] = CompiledLayers(layers, group.compile_backend)
        stepper = state["stepper"] = Stepper(trainers)
        before = _compile_counts()
        seconds, losses = stepper.side_by_side(list(trainers), steps, warmup)
        _progress(f"trained {warmup + steps} steps side by side")
        config = trainers[group.reference].config
        tokens = config.training.global_batch_size * config.model.seq_length
        state["seconds"] = seconds
        rows = [speed.fp8_pays_row(SPEED, group.fp8, group.reference, tokens,
                                   seconds[group.fp8], seconds[group.reference], judge),
                *(speed.loss_row(TRAINING, arm, group.reference, losses[arm],
                                 losses[group.reference]) for arm in (group.fp8, group.controlled))]
        if group.compile_backend is not None:  # what the compiled arms' times include
            rows.append(info(SPEED, "torch.compile of the layers",
                             _compile_summary(before, _compile_counts(), warmup + steps,
                                              len(trainers))))
        return rows

    def controller() -> list[Row]:
        from megatron_gnmr.gpu_check.arms import time_step_work

        work = time_step_work(state["stepper"], [group.fp8, group.controlled], work_steps)
        _progress(f"timed the step component over {work_steps} steps")
        seconds = state["seconds"]
        return speed.controller_rows(CONTROLLER, group.controlled, group.fp8,
                                     seconds[group.controlled], seconds[group.fp8],
                                     work[group.controlled], work[group.fp8], judge)

    def recovered() -> list[Row]:
        from megatron_gnmr.controller.units import UnitShape, local_unit_modules

        trainers, stepper = state["trainers"], state["stepper"]
        low, reference = trainers[group.fp8], trainers[group.reference]
        shape = UnitShape.of(low.config)
        units = local_unit_modules(low.model, shape)
        names = recovery.checked_unit_names(list(units), low.config.model.num_layers)
        arm = recovery.SwitchingArm(units, low.plan, lambda step: low.train_step(step),
                                    group.fp8_context(low))
        eager = state["compiled"].eager() if "compiled" in state else contextlib.nullcontext()
        with eager:
            rows = recovery.recovery_rows(group.recovery_part, arm,
                                          local_unit_modules(reference.model, shape), names,
                                          stepper.next_step[group.fp8])
        stepper.next_step[group.fp8] += 2
        _progress(f"{group.fp8}: units forced onto the recovery path and back")
        return rows

    try:
        rows = rows_or_cannot_run(checks["train"], train)
        for stage, produce in (("controller", controller), ("recovery", recovered)):
            if "seconds" in state:
                rows += rows_or_cannot_run(checks[stage], produce)
            else:
                rows += [cannot_run(part, check, "the group's arms did not train (see above)")
                         for part, check in checks[stage]]
        return rows
    finally:
        state.clear()
        _free_device_memory()


def _progress(message: str) -> None:
    print(f"gpu_check: {time.strftime('%H:%M:%S')} {message}", file=sys.stderr, flush=True)


def _compile_counts() -> tuple[int, dict[str, int]]:
    """(frames dynamo compiled, graph breaks by reason) so far in this process."""
    from torch._dynamo.utils import counters

    return int(counters["frames"]["total"]), dict(counters["graph_break"])


def _compile_summary(before, after, steps: int, arms: int) -> str:
    """What compilation did during a group's steps: a graph break splits a layer into
    graphs that cannot fuse across it, so it bounds what compilation can buy."""
    breaks = {reason: count - before[1].get(reason, 0) for reason, count in after[1].items()}
    breaks = {reason: count for reason, count in breaks.items() if count > 0}
    text = f"{after[0] - before[0]} frames compiled and {sum(breaks.values())} graph breaks " \
           f"over {steps} steps of {arms} arms"
    if breaks:
        reason = max(breaks, key=breaks.get)
        lines = [line.strip() for line in reason.splitlines() if line.strip()]
        why = next((line for line in lines if line.startswith("Explanation:")), lines[0])
        text += f" (most often, {breaks[reason]}x: {why[:160]})"
    return text


def _free_device_memory() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
