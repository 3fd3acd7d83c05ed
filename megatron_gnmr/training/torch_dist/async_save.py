"""`--async-save`: a torch_dist checkpoint written while training goes on, with megatron-core's
own machinery (`AsyncCallsQueue`, a writer process forked per save, as Megatron-LM's
`--async-save` without its persistent worker), keeping every promise of a synchronous save.

The loop waits only for the copy to host (the writer is forked from a snapshot of the state:
megatron's preload copies device tensors to the host, a fork freezes host memory copy-on-write)
and goes on training. Nothing is visible until every rank's writer has finished: then, in the
finalize step that megatron runs on every rank at the same point (`poll`, once per training
step: one small all-reduce), the checkpoint is hashed, described and published as a
synchronous save publishes it (`files.finish`: the manifest, the atomic rename, the tracker
file, the pruning), so a crash while writing leaves no partial checkpoint and the published
step is always complete. Never two in flight: a save waits for the one before it; the run's
last save, a stop (SIGTERM, --exit-interval) and the end of the run wait for theirs.
"""

from __future__ import annotations

import inspect


class AsyncSaves:
    def __init__(self):
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

        self.queue = AsyncCallsQueue(persistent=False)  # persistent: a CUDA-only worker

    @staticmethod
    def save_arguments() -> dict:
        """`dist_checkpointing.save`'s keywords for an async save: megatron-core 0.19 defaults
        to the nvidia-resiliency-ext strategy (not installed here); its own is `mcore`."""
        from megatron.core import dist_checkpointing

        accepted = inspect.signature(dist_checkpointing.save).parameters
        return {"async_sharded_save": True,
                **({"async_strategy": "mcore"} if "async_strategy" in accepted else {})}

    def schedule(self, request, finalize) -> None:
        """Collective: start writing `request` (megatron's AsyncRequest); `finalize` runs on
        every rank once every rank's writer is done."""
        self.wait()
        request.add_finalize_fn(finalize)
        self.queue.schedule_async_request(request)

    def poll(self) -> None:
        """Collective, once per step: publish what has finished writing."""
        if self.queue.get_num_unfinalized_calls():
            self.queue.maybe_finalize_async_calls(blocking=False)

    def wait(self) -> None:
        """Collective: until the save in flight (if any) is published."""
        if self.queue.get_num_unfinalized_calls():
            self.queue.maybe_finalize_async_calls(blocking=True)
