"""Overlapped gradient reduction and parameter gathering, run the way megatron's own
trainer runs them (`megatron/training/training.py`).

- `--overlap-grad-reduce`: DDP launches each bucket's reduction from its backward hooks;
  the schedule must hold them back on all but the last micro-batch, through
  `config.no_sync_func` (megatron's trainer sets it; megatron-core does not).
- `--overlap-param-gather` (distributed optimizer): after an update each rank holds only its
  own shard of the new weights; the rest arrive by all-gathers that DDP's forward pre-hooks
  dispatch and wait for during the next forward. The hooks are off until the first update
  has been applied (megatron: so that a bad load or init does not propagate through the
  first all-gather), and whatever reads whole weights outside a training forward
  (evaluation, a checkpoint, the weight monitors) first forces the gathers to finish.

The controller is unaffected by either: it reads the gradients after `finalize_model_grads`
has waited for every reduction, and it never reads weights.
"""

from __future__ import annotations

import contextlib


class CommunicationOverlap:
    def __init__(self, parallel, model_chunks, transformer_config):
        self.chunks = model_chunks
        if parallel.overlap_grad_reduce:
            no_sync = [chunk.no_sync for chunk in model_chunks]
            transformer_config.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync
        self.gathers_params = parallel.overlap_param_gather
        self.hooks_on = self.gathers_params
        if self.gathers_params:
            self._hooks(False, sync=False)

    def after_update(self) -> None:
        """An update has been applied: from now on the forward gathers the weights."""
        if self.gathers_params and not self.hooks_on:
            self._hooks(True)

    @contextlib.contextmanager
    def whole_weights(self):
        """Every weight complete on every rank inside (pending gathers finished first)."""
        if not self.hooks_on:
            yield
            return
        self._hooks(False, sync=True)
        try:
            yield
        finally:
            self._hooks(True)

    def _hooks(self, on: bool, sync: bool = False) -> None:
        for chunk in self.chunks:
            if on:
                chunk.enable_forward_pre_hook()
            else:
                chunk.disable_forward_pre_hook(param_sync=sync)
        self.hooks_on = on
