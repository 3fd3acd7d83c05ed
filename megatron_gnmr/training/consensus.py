"""Errors that reach the user from any rank.

A mistake found on one rank only (its checkpoint shard is corrupt, its node cannot read the
tokenizer) must not leave the other ranks waiting in their next collective while the one
that knows says nothing. Setup work that runs no collective is wrapped in `on_every_rank`:
each rank does its part, catching its own UserError; then ONE all-reduce says whether any
rank failed, and if one did, the failing ranks' messages are gathered so that rank 0 prints
the first of them, naming its rank, and every rank exits with the same status.
"""

from __future__ import annotations

from typing import Callable, TypeVar

import torch

from megatron_gnmr.errors import UserError
from megatron_gnmr.platform.device import run_device

T = TypeVar("T")


def on_every_rank(work: Callable[[], T]) -> T:
    """Run `work` (no collectives inside) on this rank; raise on every rank if it raised a
    UserError on any."""
    failure: UserError | None = None
    result = None
    try:
        result = work()
    except UserError as error:
        failure = error
    failed = torch.tensor([int(failure is not None)], device=run_device())
    torch.distributed.all_reduce(failed, op=torch.distributed.ReduceOp.MAX)
    if int(failed) == 0:
        return result
    messages = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(messages, str(failure) if failure else None)
    failing = [(rank, message) for rank, message in enumerate(messages) if message]
    rank, message = failing[0]
    if len(failing) < len(messages):  # some ranks were fine: say which one was not
        others = f" and {len(failing) - 1} more" if len(failing) > 1 else ""
        message = f"{message} (on rank {rank}{others})"
    raise UserError(message)
