"""What a first GPU cluster resume would meet (issue 51), caught on a CPU by faking the GPU's
side: megatron's optimizer as it is where Transformer Engine imports, a checkpoint written on
one GPU index and read where it is absent, tools that must fit on the device the model fits on.
The device audit's own checks of these classes are in tests/distributed/test_device_rule.py."""

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
