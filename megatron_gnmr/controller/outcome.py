"""StepOutcome: what the step component tells the trainer after backward.

The trainer asks one object (the GNMR controller, or `training.plain_step.PlainStep` when
there is none) once per optimizer step, after megatron's DDP has reduced the gradients and
before the update, and gets back everything it acts on: the global gradient norm (already
used to clip), whether to apply the update and what was non-finite. The metrics of the step
come from its second call, `decide`, after the monitors' check.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StepOutcome:
    grad_norm: float
    """Global L2 norm of the gradients before clipping, on the true scale."""
    apply: bool
    """Apply the optimizer update (gradients are finite, clipped and ready)."""
    nonfinite: tuple[str, ...] = ()
    """What was NaN/Inf at this step: unit names, "loss", or "gradient" (outside any unit)."""
