"""The host memory a torch_dist save pins and never gives back (issue 57 item 8), as
`estimate-memory` reports it: on a GPU, megatron-core stages each tensor a rank writes from the
device with `tensor.to("cpu", non_blocking=True)` (`FileSystemWriterAsync.preload_tensors`, at
every save), which torch allocates pinned and its caching host allocator keeps for the rest of
the process. Checked against a hand count per optimizer form, and against what megatron-core
itself hands to `preload_tensors` in a real save (a world of one, CPU: there every tensor it
stages is one a GPU run holds on the device)."""

import pytest

from megatron_gnmr.arguments import parse_config
from megatron_gnmr.checkpoints.size import checkpoint_bytes, host_bytes_per_rank
from megatron_gnmr.training.memory_estimate import estimate
from tests.helpers import TINY, pretrain_in_process

MODEL = [*TINY, "--hidden-size", "256", "--ffn-hidden-size", "704", "--eval-interval", "100",
         "--ckpt-format", "torch_dist"]
DIST_OPT = ["--use-distributed-optimizer"]
FULLY = [*DIST_OPT, "--dist-ckpt-optim-fully-reshardable"]
MEM_EFFICIENT = [*FULLY, "--distrib-optim-fully-reshardable-mem-efficient"]


@pytest.mark.parametrize("form, pinned_per_parameter", [
    ([], 2 / 2 + 12 / 2),  # the weights and the replicated Adam state, each written in halves
    (DIST_OPT, 2 / 2 + 12 / 2),  # DP-reshardable: each rank writes its own part
    (FULLY, 2 / 2),  # the optimizer state is gathered into ordinary host tensors: not pinned
    (MEM_EFFICIENT, 2 / 2),
], ids=["no_distributed_optimizer", "dp_reshardable", "fully_reshardable", "mem_efficient"])
def test_pinned_is_the_written_share_of_what_lives_on_the_device(form, pinned_per_parameter):
    """bf16 at DP 2: weights 2 bytes, Adam's moments and the fp32 main weight 12, per
    parameter of the rank's shard (N, the count tests/test_memory_estimate.py holds exact)."""
    config = parse_config([*MODEL, "--bf16", *form])
    parameters = estimate(config, 2).parameters
    host = host_bytes_per_rank(config, 2)
    assert host["pinned"] == pytest.approx(parameters * pinned_per_parameter)
    assert host["pinned"] <= host["save"]


def test_estimate_memory_reports_pinned_memory_as_held_for_the_run(capsys):
    """Before: one `save` figure, read as a peak at save time, where a GPU run keeps the
    pinned part from its first save to its end."""
    from megatron_gnmr.cli import main

    flags = [*MODEL, "--bf16", *FULLY]
    main(["estimate-memory", "--world-size", "2", *flags])
    out = capsys.readouterr().out
    assert "held from the first save to the end of the run" in out
    host = host_bytes_per_rank(parse_config(flags), 2)
    gib = 1024 ** 3
    assert f"pinned {host['pinned'] / gib:10.2f} GiB held from the first save to the end of " \
           "the run" in out.replace("pinned     ", "pinned ")
    assert f"up to {2 * host['pinned'] / gib:.2f} GiB as torch rounds each pinned block" in out
    assert f"at a save  {(host['save'] - host['pinned']) / gib:10.2f} GiB more" in out


@pytest.mark.parametrize("form", [[], DIST_OPT], ids=["no_distributed_optimizer",
                                                    "dp_reshardable"])
def test_pinned_is_what_megatron_stages_in_a_save(tmp_path, monkeypatch, form):
    """The bytes of the tensors megatron-core passes to `preload_tensors` in a save (what a GPU
    run copies into pinned memory) against the estimate's `pinned`, fp32, a world of one; at
    DP 1 they are every tensor the checkpoint holds, so also its size's tensor part. Before:
    the distributed optimizer's fp32 `param`, which its torch_dist state writes, was left out
    (42.9 MB counted, 57.2 MB staged)."""
    from megatron.core.dist_checkpointing.strategies.filesystem_async import (
        FileSystemWriterAsync,
    )

    staged = []
    original = FileSystemWriterAsync.preload_tensors

    def counting(write_buckets, non_blocking=True):
        staged.append(sum(tensor.numel() * tensor.element_size()
                          for _, _, (_, tensors) in write_buckets for _, tensor in tensors))
        return original(write_buckets, non_blocking=False)

    monkeypatch.setattr(FileSystemWriterAsync, "preload_tensors", staticmethod(counting))
    flags = [*MODEL, *form, "--train-iters", "2", "--lr-warmup-iters", "1", "--save", str(tmp_path / "run")]
    assert pretrain_in_process(flags) == 0
    assert len(staged) == 1
    config = parse_config(flags)
    for expected in (checkpoint_bytes(config, 1)["torch_dist"],
                     host_bytes_per_rank(config, 1)["pinned"]):
        assert expected <= staged[0] <= 1.01 * expected, (staged[0], expected)
