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
