"""PlainStep: the step component when the GNMR controller is off.

It does exactly what megatron's `optimizer.step()` does before the update (prepare the
gradients, one norm pass, clip), but it leaves the update to the trainer and reports a
non-finite loss or gradient norm instead of applying it: megatron's own NaN check is off
here (`check_for_nan_in_grad=False`) and fp32 Adam reports nothing, so without this a NaN
would train on silently and fill the checkpoints. It stands in for the controller in its
other roles too (no trace, no state, agreement trivially held), so the trainer never asks
whether there is one.
"""

from __future__ import annotations

import math

from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

from megatron_gnmr.controller.outcome import StepOutcome


class PlainStep:
    unit_names: list[str] = []
    policy = None

    def after_backward(self, step: int, optimizer, loss: float) -> StepOutcome:
        """megatron's `step()` up to the update (`MegatronOptimizer.step` and
        `ChainedOptimizer.step` alike): prepare, one norm, clip every part by it."""
        found_inf = optimizer.prepare_grads()
        norm = float(optimizer.get_grad_norm()) if not found_inf else math.nan
        nonfinite = tuple(name for name, bad in (("gradient", not math.isfinite(norm)),
                                                 ("loss", not math.isfinite(loss))) if bad)
        if not nonfinite:
            for part in getattr(optimizer, "chained_optimizers", [optimizer]):
                parameters = part.get_parameters()
                if parameters and part.config.clip_grad > 0:
                    clip_grad_by_total_norm_fp32(parameters, part.config.clip_grad, norm)
        return StepOutcome(norm, not nonfinite, nonfinite)

    def decide(self, step: int, alarmed) -> dict:
        return {}

    def open_trace(self, run_dir: str, resume_step: int) -> None:
        pass

    def verify_agreement(self, step: int) -> None:
        pass

    def recent_window(self) -> None:
        return None

    def summary(self) -> dict:
        return {}

    def state_dict(self) -> None:
        return None

    def load_state_dict(self, state) -> None:
        pass

    def close(self) -> None:
        pass
