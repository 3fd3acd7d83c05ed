"""`--async-save`: a torch_dist checkpoint written while training goes on, with megatron-core's
own machinery (`AsyncCallsQueue`, a writer process forked per save, as Megatron-LM's
`--async-save` without its persistent worker), keeping every promise of a synchronous save.

The loop waits only for the copy to host (the writer is forked from a snapshot of the state:
megatron's preload copies device tensors to the host, a fork freezes host memory copy-on-write)
and goes on training. The writer, once its files are written and fsynced, hashes them too (off
the training thread: `files.record_writer_hashes`). Nothing is visible until every rank's
writer has finished: then, in the finalize step that megatron runs on every rank at the same
point (`poll`, once per training step: one small all-reduce), the checkpoint is described and
published as a synchronous save publishes it (`files.finish`: the writers' hashes and those of
megatron's small files, the manifest, the atomic rename, the tracker file, the pruning), so a
crash while writing leaves no partial checkpoint and the published step is always complete.
Never two in flight: a save waits for the one before it; the run's last save, a stop (SIGTERM,
--exit-interval) and the end of the run wait for theirs.

What the loop loses to a save is counted whole: the snapshot and fork, every `poll` while the
save is in flight, and the finalize that publishes it (`on_published` gets the sum).
"""

from __future__ import annotations

import gc
import inspect
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable

from megatron_gnmr.training.torch_dist import files


@dataclass
class _InFlight:
    on_published: Callable[[Path, float, float], None]
    stall_s: float = 0.0
    path: Path | None = None


def _write_then_hash(write, staging: Path, *args, **kwargs) -> None:
    """The writer process: megatron's write (`args`: rank, write buckets, results queue; a
    bucket's first item is its file's path), then the sha256 of the files it wrote. With the
    garbage collector off, as megatron's writer runs: a collection in a forked process may
    free the parent's device tensors. A failure to hash leaves the hashing to `finish`."""
    write(*args, **kwargs)
    gc.disable()
    try:
        rank, buckets = args[0], args[1]
        files.record_writer_hashes(staging, rank, [str(bucket[0]) for bucket in buckets])
    except (OSError, TypeError, IndexError, ValueError):
        pass


class AsyncSaves:
    def __init__(self):
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

        self.queue = AsyncCallsQueue(persistent=False)  # persistent: a CUDA-only worker
        self.in_flight: _InFlight | None = None

    @staticmethod
    def save_arguments() -> dict:
        """`dist_checkpointing.save`'s keywords for an async save: megatron-core 0.19 defaults
        to the nvidia-resiliency-ext strategy (not installed here); its own is `mcore`."""
        from megatron.core import dist_checkpointing

        accepted = inspect.signature(dist_checkpointing.save).parameters
        return {"async_sharded_save": True,
                **({"async_strategy": "mcore"} if "async_strategy" in accepted else {})}

    def schedule(self, request, staging: Path, publish: Callable[[], Path],
                 on_published: Callable[[Path, float, float], None]) -> None:
        """Collective: start writing `request` (megatron's AsyncRequest) into `staging`;
        `publish` runs on every rank once every rank's writer is done, and then
        `on_published(path, loop stall seconds, seconds of the call that published)`."""
        self.wait()
        if request.async_fn is not None:  # None: this rank writes nothing
            request = request._replace(async_fn=partial(_write_then_hash, request.async_fn,
                                                        staging))
        flight = _InFlight(on_published)
        request.add_finalize_fn(lambda: setattr(flight, "path", publish()))
        self.queue.schedule_async_request(request)
        self.in_flight = flight

    def charge(self, seconds: float) -> None:
        """The loop's stall to start the save in flight (the snapshot and the fork)."""
        self.in_flight.stall_s += seconds

    def poll(self) -> None:
        """Collective, once per step: publish what has finished writing."""
        self._finalize(blocking=False)

    def wait(self) -> None:
        """Collective: until the save in flight (if any) is published."""
        self._finalize(blocking=True)

    def _finalize(self, blocking: bool) -> None:
        if not self.queue.get_num_unfinalized_calls():
            return
        started = time.perf_counter()
        self.queue.maybe_finalize_async_calls(blocking=blocking)
        seconds = time.perf_counter() - started
        flight = self.in_flight
        flight.stall_s += seconds
        if flight.path is not None:
            self.in_flight = None
            flight.on_published(flight.path, flight.stall_s, seconds)
