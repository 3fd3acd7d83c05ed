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

A preemption's save does not wait for the one in flight, which it supersedes: `abandon` ends
that writer (and the processes it forked), unpublished, so the preemption's window is spent on
the newer checkpoint alone.
"""

from __future__ import annotations

import contextlib
import gc
import inspect
import queue
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable

from megatron_gnmr.checkpoints.torch_dist import files


@dataclass
class _InFlight:
    staging: Path
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
        flight = _InFlight(staging, on_published)
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

    def abandon(self) -> Path | None:
        """Collective (every rank at the same point: a stop is agreed on): end the save in
        flight without publishing it and without waiting for its writer. Returns its staging
        directory (invisible, for the caller to remove), or None if none was in flight."""
        if not self.queue.get_num_unfinalized_calls():
            return None
        active = self.queue.async_calls.popleft()  # megatron's record of the call
        writer = getattr(active.async_caller, "process", None)
        if writer is not None:
            _end_process_tree(writer.pid)
            writer.join()
            active.async_caller.process = None
        _drain_write_results()
        staging, self.in_flight = self.in_flight.staging, None
        return staging


def _end_process_tree(pid: int) -> None:
    """SIGKILL a writer and every process it forked (megatron-core 0.16's writer forks one per
    file): stopped first, so that it forks no more while its children are listed. The caller
    reaps the writer; its children, orphaned, are not waited for (a container's init may never
    reap them), only killed."""
    import psutil

    try:
        writer = psutil.Process(pid)
        writer.suspend()
        tree = [*writer.children(recursive=True), writer]
    except psutil.Error:  # it has already exited
        return
    for process in tree:
        with contextlib.suppress(psutil.Error):
            process.kill()


def _drain_write_results() -> None:
    """A writer ended after it reported leaves its report in megatron's results queue, where
    the next save (the synchronous one that superseded it) would read it as its own."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    results = filesystem_async._results_queue
    while results is not None:
        try:
            results.get_nowait()
        except queue.Empty:
            return
