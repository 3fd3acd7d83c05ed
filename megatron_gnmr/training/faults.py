"""Faults on purpose, for the reliability tests: a NaN in a unit's gradient, a SIGKILL at a
chosen step or in the middle of a checkpoint write, a controller state changed on one rank.

All of them sit behind one `FaultHooks` object that the trainer calls at fixed points; the
default (`NO_FAULTS`) does nothing, and the environment is read once, at start, never in the
step. The NaN comes from the test flag `--inject-nonfinite STEP:UNIT[,STEP:UNIT...]`; the
kills from `GNMR_TEST_SIGKILL=STEP:RANK` or `STEP:RANK:save`, which fire only in the first
attempt of a torchrun job (`TORCHELASTIC_RESTART_COUNT` 0) so the restarted job runs to the
end; `GNMR_TEST_CORRUPT_CONTROLLER=STEP:RANK` changes one rank's controller state, to prove
the agreement check catches it.
"""

from __future__ import annotations

import os
import signal

import torch

from megatron_gnmr.errors import UserError


def parse_injections(spec: str | None) -> dict[int, list[str]]:
    injections: dict[int, list[str]] = {}
    for item in filter(None, (spec or "").split(",")):
        step, _, unit = item.partition(":")
        if not step.isdigit() or not unit:
            raise UserError(f"--inject-nonfinite {spec!r}: expected STEP:UNIT, e.g. "
                            "7:layers.0.mlp.linear_fc2")
        injections.setdefault(int(step), []).append(unit)
    return injections


def _step_and_rank(variable: str) -> tuple[int, int, str] | None:
    request = os.environ.get(variable)
    if not request:
        return None
    parts = request.split(":")
    return int(parts[0]), int(parts[1]), parts[2] if len(parts) > 2 else "step"


class FaultHooks:
    def __init__(self, inject_nonfinite: str | None = None, unit_modules: dict | None = None,
                 from_environment: bool = False):
        self.injections = parse_injections(inject_nonfinite)
        self.unit_modules = unit_modules or {}  # this rank's units
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        self.kill = _step_and_rank("GNMR_TEST_SIGKILL") \
            if from_environment and first_attempt else None
        self.corrupt = _step_and_rank("GNMR_TEST_CORRUPT_CONTROLLER") \
            if from_environment else None
        self.rank = int(os.environ.get("RANK", "0"))

    @torch.no_grad()
    def corrupt_gradients(self, step: int) -> None:
        """Put a NaN into the reduced gradient of each unit scheduled for this step."""
        for unit in self.injections.get(step, []):
            module = self.unit_modules.get(unit)
            if module is not None:  # owned by another pipeline stage otherwise
                grad = module.weight.main_grad if hasattr(module.weight, "main_grad") \
                    else module.weight.grad
                grad.view(-1)[0] = float("nan")

    def maybe_kill(self, step: int, where: str = "step") -> None:
        if self.kill == (step, self.rank, where):
            os.kill(os.getpid(), signal.SIGKILL)

    def corrupt_controller(self, step: int, policy) -> None:
        if self.corrupt is not None and self.corrupt[:2] == (step, self.rank):
            policy.locks[0] += 1


NO_FAULTS = FaultHooks()
