"""One live job per run directory.

A run directory that holds checkpoints belongs to one run, and a run to one live job: two
jobs writing checkpoints into it (a relaunch beside the orphans of a killed one, a second
sbatch of the same script) interleave their steps and collide on the tracker file. Rank 0
of a job holds `RUN_DIR/job.lock` for the job's life, created atomically (O_EXCL) and
refreshed by a heartbeat thread; it names the holder's host, pid, job and when it started. A
second launch is refused in one line naming them. A lock whose holder is gone is taken over
(with a notice): one whose heartbeat is older than `STALE_S` (any host: the clocks of a
cluster's nodes agree to seconds, the heartbeat is minutes), or whose pid is no longer alive
on this host, or one left by an earlier attempt of this same job: a Slurm requeue (the job id
kept, `SLURM_RESTART_COUNT` counting requeues) or a torchrun restart
(`TORCHELASTIC_RESTART_COUNT`), compared in that order. A lock must never turn a recoverable
job into a failed one: where the holder is this same job and nothing tells whether it lives
(no counter moved, another host), the launch waits for its heartbeat to go stale, says so,
and takes it over; if the heartbeat moves meanwhile, its holder lives and the launch is
refused.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from pathlib import Path

from megatron_gnmr.errors import UserError

LOCK = "job.lock"
HEARTBEAT_S = 30.0
STALE_S = 300.0


def _identity() -> dict:
    return {"host": socket.gethostname(), "pid": os.getpid(),
            "job": os.environ.get("SLURM_JOB_ID") or os.environ.get("TORCHELASTIC_RUN_ID"),
            "requeue": int(os.environ.get("SLURM_RESTART_COUNT") or 0),
            "attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0),
            "started": time.strftime("%Y-%m-%d %H:%M:%S")}


def _same_job(holder: dict, me: dict) -> bool:
    return me["job"] is not None and holder.get("job") == me["job"]


def _generation(identity: dict) -> tuple[int, int]:
    """(Slurm requeues, torchrun restarts): a later attempt of a job has a larger one."""
    return int(identity.get("requeue", 0)), int(identity.get("attempt", 0))


def _alive_here(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def _gone(holder: dict, age_s: float, me: dict) -> str | None:
    """Why the holder of a lock no longer holds it, or None if it may be alive."""
    if age_s > STALE_S:
        return f"no heartbeat for {age_s:.0f} s"
    if holder.get("host") == me["host"] and not _alive_here(int(holder.get("pid", -1))):
        return "its process has ended"
    if _same_job(holder, me) and _generation(holder) < _generation(me):
        requeue, attempt = _generation(holder)
        return f"an earlier attempt of this job (requeue {requeue}, restart {attempt})"
    return None


class RunLock:
    """Held by rank 0 of a job from before anything is written until it ends."""

    def __init__(self, directory: str):
        self.path = Path(directory) / LOCK
        self.me = _identity()
        self.taken_over: str | None = None
        self._stop = threading.Event()
        self._beating: threading.Thread | None = None

    def acquire(self) -> None:
        """Take the lock or raise a UserError naming its live holder."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(3):  # a lock taken over by another launch at the same moment
            try:
                descriptor = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                self._take_over_or_refuse()
                continue
            with os.fdopen(descriptor, "w") as file:
                json.dump(self.me, file)
            self._beating = threading.Thread(target=self._beat, daemon=True,
                                             name="run-lock-heartbeat")
            self._beating.start()
            return
        raise UserError(f"--save {self.path.parent}: could not take {LOCK} (another launch is "
                        "taking it at the same time)")

    def _take_over_or_refuse(self) -> None:
        try:
            holder = json.loads(self.path.read_text())
            age = time.time() - self.path.stat().st_mtime
        except FileNotFoundError:
            return  # released meanwhile: try again
        except (OSError, json.JSONDecodeError):
            holder, age = {}, STALE_S + 1  # unreadable: a crash while writing it
        reason = _gone(holder, age, self.me)
        if reason is None and _same_job(holder, self.me):
            reason = self._wait_for_stale(holder, age)
        if reason is None:
            raise UserError(
                f"--save {self.path.parent} is in use by a live job: host "
                f"{holder.get('host')}, pid {holder.get('pid')}"
                f"{', job ' + str(holder['job']) if holder.get('job') else ''}, started "
                f"{holder.get('started')}; wait for it to end or stop it (a job that died "
                f"leaves {LOCK} to be taken over once its heartbeat is {STALE_S:.0f} s old)")
        self.taken_over = f"{LOCK} of host {holder.get('host')} pid {holder.get('pid')} " \
                          f"taken over ({reason})"
        self.path.unlink(missing_ok=True)

    def _wait_for_stale(self, holder: dict, age: float) -> str | None:
        """This job's own lock from an attempt nothing tells apart (another host, no counter
        moved: a requeue whose counter did not reach us): wait until its heartbeat is
        `STALE_S` old, saying so. None if the heartbeat moves meanwhile (its holder lives)."""
        print(f"[run lock] {LOCK} is held by this job ({holder.get('job')}) on host "
              f"{holder.get('host')} pid {holder.get('pid')}, and nothing tells whether that "
              f"holder lives: waiting up to {max(0.0, STALE_S - age):.0f} s for its heartbeat "
              "to go stale before resuming", flush=True)
        try:
            beat = self.path.stat().st_mtime
            while time.time() - beat <= STALE_S:
                time.sleep(min(HEARTBEAT_S / 6, STALE_S / 10))
                if self.path.stat().st_mtime != beat:
                    return None
        except FileNotFoundError:
            return "released while waiting"
        return f"no heartbeat for {time.time() - beat:.0f} s"

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                os.utime(self.path)
            except OSError:
                return

    def release(self) -> None:
        self._stop.set()
        try:
            holder = json.loads(self.path.read_text())
        except (OSError, json.JSONDecodeError):
            return
        if (holder.get("host"), holder.get("pid")) == (self.me["host"], self.me["pid"]):
            self.path.unlink(missing_ok=True)  # never another job's
