"""GPU checks: run where CUDA (and Transformer Engine) exist, skip here with the reason."""

import pytest

from megatron_gnmr.platform import capabilities
from tests.helpers import TINY, run_pretrain, train_losses

needs_cuda = pytest.mark.skipif(not capabilities.cuda(), reason=capabilities.cuda().reason)
needs_te = pytest.mark.skipif(not capabilities.transformer_engine(),
                              reason=capabilities.transformer_engine().reason)


@needs_cuda
def test_bf16_training_with_the_controller_on_gpu(tmp_path):
    """Same entry point, nccl backend, bf16: trains and the controller runs."""
    run_pretrain([*TINY, "--train-iters", "20", "--eval-interval", "100", "--bf16", "--gnmr",
                  "--save", str(tmp_path)])
    losses = train_losses(tmp_path)
    assert losses[20] < losses[1]


@needs_te
def test_te_reports_fp8_capability():
    """TE imports, and its FP8 check answers with a reason either way."""
    capability = capabilities.te_fp8()
    assert isinstance(capability.reason, str) and capability.reason


@needs_te
def test_te_fp8_trains_with_per_unit_bf16_recovery(tmp_path):
    """te-fp8 with the controller: units switch to BF16 per step and the run trains."""
    run_pretrain([*TINY, "--hidden-size", "128", "--ffn-hidden-size", "256", "--bf16",
                  "--precision-recipe", "te-fp8", "--train-iters", "20", "--eval-interval",
                  "100", "--gnmr", "--gnmr-alpha", "1.05", "--gnmr-beta", "1.05",
                  "--gnmr-delta", "1", "--gnmr-warmup", "2", "--save", str(tmp_path)])
    losses = train_losses(tmp_path)
    assert losses[20] < losses[1]


@needs_te
def test_te_disabled_autocast_gives_the_bf16_result():
    """Inside an FP8 autocast, a module under the nested disabled autocast computes what it
    computes with FP8 off altogether (bitwise)."""
    import torch

    from megatron_gnmr.precision.te_backend import disabled_fp8_autocast

    te = capabilities.te_module()
    layer = te.Linear(256, 256, params_dtype=torch.bfloat16).cuda()
    x = torch.randn(32, 256, device="cuda", dtype=torch.bfloat16)
    reference = layer(x)
    enter = te.autocast if hasattr(te, "autocast") else te.fp8_autocast
    with enter(enabled=True):
        with disabled_fp8_autocast():
            recovered = layer(x)
        quantized = layer(x)
    assert torch.equal(recovered, reference)
    assert not torch.equal(quantized, reference)
