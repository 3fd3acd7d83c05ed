"""What a first GPU cluster resume would meet (issue 51), caught on a CPU by faking the GPU's
side: megatron's optimizer as it is where Transformer Engine imports, a checkpoint written on
one GPU index and read where it is absent, tools that must fit on the device the model fits on.
The device audit's own checks of these classes are in tests/distributed/test_device_rule.py."""

import pytest
import torch

from megatron_gnmr.platform.megatron_compat import zero_adam_state
from tests.fused_adam_like import FusedAdamLike, megatron_builds_fused_adam
from tests.helpers import TINY, pretrain_in_process, train_losses

FAST = [*TINY, "--eval-interval", "100", "--lr-warmup-iters", "1",
        "--use-distributed-optimizer", "--ckpt-format", "torch_dist"]


def test_a_torch_dist_resume_where_te_imports_continues_the_run_bit_for_bit(tmp_path,
                                                                             monkeypatch):
    """With TE's FusedAdam as megatron's optimizer, a run stopped at step 3 and resumed from
    its torch_dist checkpoint equals the uninterrupted run (before the fix: KeyError 'step'
    in FusedAdam.state_dict at every resume, `--no-load-optim` too)."""
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    with megatron_builds_fused_adam(monkeypatch):
        assert pretrain_in_process([*FAST, "--train-iters", "6", "--save", str(whole)]) == 0
        assert pretrain_in_process([*FAST, "--train-iters", "6", "--exit-interval", "3",
                                    "--save-interval", "3", "--save", str(parts)]) == 0
        assert pretrain_in_process([*FAST, "--train-iters", "6", "--save", str(parts),
                                    "--resume", "auto"]) == 0
    assert train_losses(parts) == train_losses(whole)


def test_only_torch_adam_is_given_a_step_before_a_load():
    """zero_adam_state fills torch's Adam (which keeps a per-parameter step) and leaves an
    optimizer like TE's FusedAdam as megatron expects it: empty."""
    import torch

    class Part:
        def __init__(self, inner):
            self.optimizer = inner

    weights = [torch.nn.Parameter(torch.ones(3))]
    torch_adam, fused = torch.optim.AdamW(weights), FusedAdamLike(weights)
    holder = type("Chained", (), {"chained_optimizers": [Part(torch_adam), Part(fused)]})()
    with zero_adam_state(holder):
        assert set(torch_adam.state[weights[0]]) == {"step", "exp_avg", "exp_avg_sq"}
        assert len(fused.state) == 0
        fused.state_dict()  # TE's mapping of state names: no KeyError
    assert len(torch_adam.state) == 0


def test_the_tools_build_the_model_without_gradients_and_evaluate_in_micro_batches(tmp_path,
                                                                                   monkeypatch):
    """evaluate (as export, import and merge) reads a run into a model with no gradient and
    no DDP wrapper: its float32 gradient buffer is twice a bf16 model's weights. It forwards
    the run's micro-batch at a time (4 here), not the whole evaluation set (10 sequences)."""
    import torch
    from megatron.core.distributed import DistributedDataParallel

    from megatron_gnmr.evaluation import command
    from megatron_gnmr.evaluation.loaded_run import LoadedRun, load_run
    from megatron_gnmr.training import distributed

    run = tmp_path / "run"
    assert pretrain_in_process([*TINY, "--train-iters", "3", "--eval-interval", "3",
                                "--micro-batch-size", "4", "--save", str(run)]) == 0
    try:
        loaded = load_run(str(run))
        chunk = loaded.model[0]
        assert not isinstance(chunk, DistributedDataParallel)
        assert not any(p.requires_grad for p in chunk.parameters())
        assert not any(hasattr(p, "main_grad") for p in chunk.parameters())
        sizes = []
        original = LoadedRun.losses

        def recording(self, tokens, labels):
            sizes.append(tokens.shape[0])
            return original(self, tokens, labels)

        monkeypatch.setattr(LoadedRun, "losses", recording)
        valid = loaded.valid_split(sequences=10)
        assert torch.isfinite(torch.tensor(command.mean_loss(loaded, valid, 10)))
        assert sizes == [4, 4, 2]
    finally:
        distributed.shutdown()


def _as_if_saved_on_a_gpu(real):
    """The generator states a GPU run writes: megatron's tracker and the device keep CUDA
    (Philox) states, 16 bytes each, where a CPU run keeps 5056-byte CPU states."""
    import torch

    def rng_state():
        state = real()
        cuda_state = torch.arange(16, dtype=torch.uint8)
        state["tracker"] = {name: cuda_state.clone() for name in state["tracker"]}
        state["device"] = {"cuda": cuda_state.clone()}
        return state
    return rng_state


@pytest.mark.parametrize("ckpt_format", ["torch", "torch_dist"])
def test_a_gpu_checkpoint_resumed_on_the_cpu_continues_with_rederived_rng(tmp_path, monkeypatch,
                                                                          capfd, ckpt_format):
    """The H200 check's resume in a CPU process (2026-12-04): the GPU's CUDA generator states
    were set into the CPU generator ('Expected a CPUGeneratorImplState of size 5056 but found
    the input RNG state size to be 16'). The run now continues and says the streams were
    re-derived. With dropout on, the streams decide the losses: the resumed run leaves the
    uninterrupted one after the resume, and the generators it resumed with are torch's and
    megatron's own seeding at the seed a run's start would use for step 3, computed here."""
    from megatron.core import tensor_parallel

    from megatron_gnmr.checkpoints import rng
    from megatron_gnmr.checkpoints.torch_dist import content

    flags = [*TINY, "--eval-interval", "100", "--lr-warmup-iters", "1", "--seed", "1234",
             "--hidden-dropout", "0.1", "--attention-dropout", "0.1", "--ckpt-format", ckpt_format]
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    assert pretrain_in_process([*flags, "--train-iters", "6", "--save", str(whole)]) == 0
    with monkeypatch.context() as patch:
        gpu_like = _as_if_saved_on_a_gpu(rng.rng_state)
        patch.setattr(rng, "rng_state", gpu_like)
        patch.setattr(content, "rng_state", gpu_like)
        assert pretrain_in_process([*flags, "--train-iters", "6", "--exit-interval", "3",
                                    "--save-interval", "3", "--save", str(parts)]) == 0
    capfd.readouterr()
    resumed_with = []
    rederive = rng.rederive_rng

    def recorded(seed, step):
        rederive(seed, step)
        resumed_with.append((torch.get_rng_state(),
                             tensor_parallel.get_cuda_rng_tracker().get_states()))
    monkeypatch.setattr(rng, "rederive_rng", recorded)
    assert pretrain_in_process([*flags, "--train-iters", "6", "--save", str(parts),
                                "--resume", "auto"]) == 0
    assert "saved on another kind of device" in capfd.readouterr().out
    (default, tracker), = resumed_with

    expected_seed = (1234 * 1_000_003 + 3 * 7919) % 2**31  # world of one: stage 0
    torch.manual_seed(expected_seed)
    tensor_parallel.model_parallel_cuda_manual_seed(expected_seed, tp_rank=0, ep_rank=0,
                                                    etp_rank=0)
    assert torch.equal(default, torch.get_rng_state())
    expected = tensor_parallel.get_cuda_rng_tracker().get_states()
    assert tracker.keys() == expected.keys()
    assert all(torch.equal(tracker[name], expected[name]) for name in expected)
    ours, theirs = train_losses(parts), train_losses(whole)
    assert [ours[s] for s in (1, 2, 3)] == [theirs[s] for s in (1, 2, 3)]
    assert all(ours[s] != theirs[s] for s in (4, 5, 6))  # dropout draws from the streams


@pytest.mark.parametrize("pipeline_rank", [0, 1])
def test_rederived_streams_keep_megatrons_rule_across_tensor_parallel_ranks(monkeypatch,
                                                                            pipeline_rank):
    """Re-derived after a resume on another layout, as at a run's start: the default
    generator (the replicated residual stream's dropout) is the same on both TP ranks of a
    stage, the model-parallel tracker differs between them, and both differ between stages.
    Before: every rank's default generator was seeded with its own global rank."""
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.tensor_parallel import random as megatron_random

    from megatron_gnmr.platform.cpu_patches import apply_cpu_patches
    from megatron_gnmr.checkpoints import rng

    apply_cpu_patches()
    streams = {}
    monkeypatch.setattr(parallel_state, "get_pipeline_model_parallel_rank",
                        lambda: pipeline_rank)
    for name in ("get_expert_model_parallel_rank", "get_expert_tensor_parallel_rank"):
        monkeypatch.setattr(megatron_random, name, lambda: 0)
    for tp_rank in (0, 1):
        monkeypatch.setattr(megatron_random, "get_tensor_model_parallel_rank", lambda: tp_rank)
        monkeypatch.setattr(torch.distributed, "get_rank",
                            lambda *a, **k: 2 * pipeline_rank + tp_rank)
        rng.rederive_rng(seed=7, step=300)
        tracker = tensor_parallel.get_cuda_rng_tracker().get_states()
        streams[tp_rank] = (torch.get_rng_state(), tracker["model-parallel-rng"])
    assert torch.equal(streams[0][0], streams[1][0])  # the default generator: equal
    assert not torch.equal(streams[0][1], streams[1][1])  # the tracker: per TP rank
    rng.rederive_rng(seed=7, step=300)
    assert torch.equal(torch.get_rng_state(), streams[1][0])  # the same resume, the same
