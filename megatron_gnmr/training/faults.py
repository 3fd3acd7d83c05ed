"""Faults on purpose, for the reliability tests: a NaN in a unit's gradient, a SIGKILL at a
chosen step or in the middle of a checkpoint write.

The NaN comes from the test flag `--inject-nonfinite STEP:UNIT[,STEP:UNIT...]`. The kills
come from the environment (`GNMR_TEST_SIGKILL=STEP:RANK` or `STEP:RANK:save`) and fire only
in the first attempt of a torchrun job (`TORCHELASTIC_RESTART_COUNT` 0), so the restarted
job runs to the end. `GNMR_TEST_CORRUPT_CONTROLLER=STEP:RANK` changes one rank's controller
state, to prove the agreement check catches it. None of this does anything unless asked.
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


class NonFiniteInjector:
    def __init__(self, spec: str | None, unit_modules: dict[str, torch.nn.Module]):
        self.injections = parse_injections(spec)
        self.unit_modules = unit_modules  # this rank's units

    @torch.no_grad()
    def corrupt(self, step: int) -> None:
        """Put a NaN into the reduced gradient of each unit scheduled for this step."""
        for unit in self.injections.get(step, []):
            module = self.unit_modules.get(unit)
            if module is not None:  # owned by another pipeline stage otherwise
                grad = module.weight.main_grad if hasattr(module.weight, "main_grad") \
                    else module.weight.grad
                grad.view(-1)[0] = float("nan")


def _kill_requested(step: int, where: str) -> bool:
    request = os.environ.get("GNMR_TEST_SIGKILL")
    if not request or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return False
    parts = request.split(":")
    at, rank = int(parts[0]), int(parts[1])
    place = parts[2] if len(parts) > 2 else "step"
    return at == step and rank == int(os.environ.get("RANK", "0")) and place == where


def maybe_sigkill(step: int, where: str = "step") -> None:
    if _kill_requested(step, where):
        os.kill(os.getpid(), signal.SIGKILL)


def maybe_corrupt_controller(step: int, policy) -> None:
    request = os.environ.get("GNMR_TEST_CORRUPT_CONTROLLER")
    if request:
        at, rank = (int(part) for part in request.split(":"))
        if at == step and rank == int(os.environ.get("RANK", "0")):
            policy.locks[0] += 1
