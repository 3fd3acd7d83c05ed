"""Preemption: SIGTERM (and `--exit-signal-handler`'s `--exit-signal`) ends a run cleanly.

The handler only notes the signal; the training loop asks, once per step and with one
all-reduce (every rank the same answer, the first rank signalled decides for all), whether
to stop, and then checkpoints the step it just finished and exits with status 0 (a scheduler's
time limit is not a failure: the job resumes from that checkpoint). `--exit-duration-in-mins`
rides the same all-reduce.

The save a stop triggers has a window: torchrun's agent SIGKILLs its workers 30 s after it
passed SIGTERM on (torch 2.13's `torchrun --shutdown-timeout` or TORCH_ELASTIC_SHUTDOWN_TIMEOUT
sets it; a torch without them hard-codes 30 s). So it does not wait for an async save in
flight, which it supersedes, and publishes before it hashes (`resume.RunCheckpoints.save`,
`preempted`); the time from the signal (`received_at`) to publication is in its `checkpoint`
event.
"""

from __future__ import annotations

import signal
import time

import torch

from megatron_gnmr.platform.device import run_device


class ExitRequests:
    def __init__(self, checkpoint):
        self.limit_s = 60.0 * checkpoint.exit_duration_in_mins \
            if checkpoint.exit_duration_in_mins else None
        self.started = time.monotonic()
        self.received: str | None = None
        self.received_at: float | None = None  # time.monotonic() of the first signal
        names = {"SIGTERM"} | ({checkpoint.exit_signal} if checkpoint.exit_signal_handler else set())
        self.previous = {}
        for name in sorted(names):
            number = getattr(signal, name)
            self.previous[number] = signal.signal(number, self._note)

    def _note(self, number, frame) -> None:
        self.received = signal.Signals(number).name
        if self.received_at is None:
            self.received_at = time.monotonic()

    def reason(self) -> str | None:
        """Collective (once per step): why every rank stops now, or None."""
        late = self.limit_s is not None and time.monotonic() - self.started > self.limit_s
        flags = torch.tensor([float(late), float(self.received is not None)],
                             device=run_device())
        torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX)
        if flags[1] > 0:
            return f"{self.received or 'a signal (on another rank)'}: saved and stopped"
        if flags[0] > 0:
            return "--exit-duration-in-mins reached: saved and stopped"
        return None

    def close(self) -> None:
        for number, handler in self.previous.items():
            signal.signal(number, handler)
        self.previous = {}
