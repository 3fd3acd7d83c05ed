"""Defects planted on purpose in a real run (`batch_runner.py`'s `defect` entries), to show
that a cross-layout comparison fails when the distributed arithmetic is wrong, not only that
it passes when it is right. Each is a context manager patching one function for one run."""

from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def probe_partial_dropped(rank: int = 1):
    """TP rank `rank` hands zeros to the statistics all-reduce in place of its probe sums:
    its partial sums (a column-parallel rank's slice of the output, a row-parallel rank's
    partial products) never reach the whole layer's value."""
    from megatron_gnmr.precision.probes import ProbeBank

    take = ProbeBank.take

    def dropped(self):
        sums = take(self)
        return torch.zeros_like(sums) if torch.distributed.get_rank() == rank else sums

    ProbeBank.take = dropped
    try:
        yield
    finally:
        ProbeBank.take = take


@contextlib.contextmanager
def probe_sums_averaged():
    """The wrong reduction: the probe sums averaged over the ranks instead of summed (what a
    mean-reducing all-reduce, or a reduction meant for replicated values, would do)."""
    from megatron_gnmr.precision.probes import ProbeBank

    take = ProbeBank.take

    def averaged(self):
        return take(self) / torch.distributed.get_world_size()

    ProbeBank.take = averaged
    try:
        yield
    finally:
        ProbeBank.take = take


@contextlib.contextmanager
def reshard_misplaced():
    """A resume that puts a shard in the wrong place: after a torch_dist load, the first
    layer's fc2 weight (row-parallel: split along its input columns under TP) has its two
    halves swapped, as a reshard that misplaced TP=2's shards would leave it."""
    from megatron_gnmr.model import unwrap
    from megatron_gnmr.checkpoints.torch_dist import run

    load = run.load

    def misplaced(trainer, *args, **kwargs):
        notes = load(trainer, *args, **kwargs)
        model = unwrap(trainer.model[0])
        weight = model.decoder.layers[0].mlp.linear_fc2.weight
        with torch.no_grad():
            weight.copy_(torch.cat(list(reversed(weight.chunk(2, dim=1))), dim=1))
        return notes

    run.load = misplaced
    try:
        yield
    finally:
        run.load = load


@contextlib.contextmanager
def optimizer_state_misplaced():
    """A resume that misplaces the optimizer's shards: after a torch_dist load, the Adam
    moments of the largest parameter this rank holds (the embedding's) have their halves
    swapped, as a reshard that put one DP or EP rank's part where another's belongs would
    leave them. The weights themselves load right."""
    from megatron_gnmr.checkpoints.torch_dist import run

    load = run.load

    def misplaced(trainer, *args, **kwargs):
        notes = load(trainer, *args, **kwargs)
        parts = getattr(trainer.optimizer, "chained_optimizers", [trainer.optimizer])
        states = [state for part in parts for state in part.optimizer.state.values()
                  if "exp_avg" in state]
        state = max(states, key=lambda s: s["exp_avg"].numel())
        with torch.no_grad():
            for name in ("exp_avg", "exp_avg_sq"):
                flat = state[name].view(-1)
                half = flat.numel() // 2
                flat.copy_(torch.cat([flat[half:2 * half], flat[:half], flat[2 * half:]]))
        return notes

    run.load = misplaced
    try:
        yield
    finally:
        run.load = load


DEFECTS = {"probe_partial_dropped": probe_partial_dropped,
           "probe_sums_averaged": probe_sums_averaged,
           "reshard_misplaced": reshard_misplaced,
           "optimizer_state_misplaced": optimizer_state_misplaced}
