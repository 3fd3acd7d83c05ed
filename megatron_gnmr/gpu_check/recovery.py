"""gpu_check parts (a) and (d): units forced onto the recovery path at step k and back at k+1.

Step k: the checked units are forced onto the recovery path while the FP8 arm trains; their
input, weights and output gradient are captured inside the step. Replayed on those (the
recovery path, inside the layer's FP8 autocast as in training), each unit's forward, dgrad
and wgrad must be bitwise what the same unit of its group's BF16 arm computes with the
captured weights (`te` for te-fp8: Transformer Engine's layers without FP8; megatron's BF16
linears for fp8-torchao), and the output the training step itself computed must be that
forward. The old check compared the forward alone: a backward that did not inherit its
forward's path would have passed it.

Step k+1: the units are back on the low-cost path. The output the training step computed must
equal a fresh FP8 forward of the captured input and weights (a module that casts its weights
anew and caches nothing), which rules out a stale FP8 weight cache (TE keeps the cast weights
between micro-batches and recasts them on a step's first one), and must differ from BF16's
(FP8 is really on again).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

from megatron_gnmr.gpu_check.replay import (Capture, bitwise_equal, difference, mismatches,
                                            no_weight_cache, parameters_set, replay)
from megatron_gnmr.gpu_check.table import Row, judged

CHECKS = ("recovered at step k: forward in the training step = BF16",
          "recovered at step k: forward, dgrad, wgrad (replay) = BF16",
          "back on FP8 at step k+1: output = a fresh FP8 forward (no stale weight cache)",
          "back on FP8 at step k+1: output differs from BF16")


@dataclass
class SwitchingArm:
    """What the flow needs of an FP8 arm: its units, its plan, one training step."""

    units: dict  # unit name -> module
    plan: object  # PrecisionPlan: `recovery` is the set forced at step k
    train_step: Callable[[int], object]
    fp8_context: Callable[[str], object] = lambda unit: contextlib.nullcontext()
    """unit name -> the FP8 autocast its layer's forward runs in (TE: megatron's
    `get_fp8_context` for the layer; torchao switches inside the linear: none)."""


def layer_index(unit_name: str) -> int:
    """`layers.3.mlp.linear_fc1` -> 3."""
    return int(unit_name.split(".")[1])


def checked_unit_names(unit_names: list[str], num_layers: int) -> list[str]:
    """The first layer's units and the last layer's fc2: each kind of linear (column- and
    row-parallel, fused norm or not) and both ends of the network."""
    names = [name for name in unit_names if name.startswith("layers.0.")]
    last = f"layers.{num_layers - 1}.mlp.linear_fc2"
    return names + ([last] if last in unit_names and last not in names else [])


def _captured(arm: SwitchingArm, names: list[str], recovery: frozenset, step: int) -> dict:
    captures = {name: Capture(arm.units[name]) for name in names}
    saved = arm.plan.recovery
    arm.plan.recovery = recovery
    try:
        arm.train_step(step)
    finally:
        arm.plan.recovery = saved
        for capture in captures.values():
            capture.remove()
    missing = [name for name, c in captures.items() if not c.complete()]
    if missing:
        raise RuntimeError(f"the training step did not run the forward and backward of "
                           f"{', '.join(missing)}")
    return captures


def _summary(names: list[str], problems: dict[str, list[str]], what: str) -> tuple[str, bool]:
    if not any(problems.values()):
        return f"{len(names)} units ({', '.join(names)}): {what}", True
    bad = [f"{name}: {'; '.join(found)}" for name, found in problems.items() if found]
    return f"{len(bad)} of {len(names)} units differ: {' / '.join(bad)}", False


def recovery_rows(part: str, arm: SwitchingArm, reference_units: dict, names: list[str],
                  step: int) -> list[Row]:
    """Train steps `step` (units forced onto recovery) and `step + 1` (back) of `arm`, and
    the four rows of CHECKS against `reference_units` (the BF16 arm's modules, same names)."""
    forced = frozenset(names)
    at_k = _captured(arm, names, arm.plan.recovery | forced, step)
    in_training, replayed = {}, {}
    for name in names:
        c = at_k[name]
        with parameters_set(reference_units[name], c.params) as reference:
            want = replay(reference, c.x, c.dy)
        with parameters_set(arm.units[name], c.params) as module:
            saved = arm.plan.recovery
            arm.plan.recovery = saved | {name}
            try:
                got = replay(module, c.x, c.dy, lambda: arm.fp8_context(name))
            finally:
                arm.plan.recovery = saved
        in_training[name] = [] if bitwise_equal(c.y, want.output) else \
            [f"forward: {difference(c.y, want.output)}"]
        replayed[name] = mismatches(got, want)
    rows = [judged(part, CHECKS[0], *_summary(names, in_training, "bitwise equal")),
            judged(part, CHECKS[1], *_summary(names, replayed, "forward, dgrad and wgrad "
                                                                "bitwise equal"))]
    at_next = _captured(arm, names, arm.plan.recovery - forced, step + 1)
    stale, same_as_bf16 = {}, {}
    for name in names:
        c = at_next[name]
        with parameters_set(arm.units[name], c.params) as module, no_weight_cache(module):
            fresh = replay(module, c.x, context=lambda: arm.fp8_context(name))
        with parameters_set(reference_units[name], c.params) as reference:
            bf16 = replay(reference, c.x)
        stale[name] = [] if bitwise_equal(c.y, fresh.output) else \
            [f"output: {difference(c.y, fresh.output)}"]
        same_as_bf16[name] = ["output equals BF16's"] if bitwise_equal(c.y, bf16.output) \
            else []
    rows.append(judged(part, CHECKS[2], *_summary(names, stale, "bitwise equal")))
    rows.append(judged(part, CHECKS[3], *_summary(names, same_as_bf16, "each differs")))
    return rows
