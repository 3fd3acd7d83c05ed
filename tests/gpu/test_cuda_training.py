"""GPU checks: run where CUDA (and Transformer Engine) exist, skip elsewhere with the reason.
`scripts/gpu_check.sh` runs the same paths longer and measures their speed."""

import pytest
import torch

from megatron_gnmr.platform import capabilities
from tests.helpers import TINY, read_jsonl, run_pretrain, trace_records, train_losses

needs_cuda = pytest.mark.skipif(not capabilities.cuda(), reason=capabilities.cuda().reason)
needs_two_gpus = pytest.mark.skipif(
    not capabilities.cuda() or torch.cuda.device_count() < 2,
    reason="needs two CUDA devices")
needs_te = pytest.mark.skipif(not capabilities.transformer_engine(),
                              reason=capabilities.transformer_engine().reason)
TE_WIDE = ["--hidden-size", "128", "--ffn-hidden-size", "256", "--bf16",
           "--precision-recipe", "te-fp8"]
EAGER_GNMR = ["--gnmr", "--gnmr-alpha", "1.05", "--gnmr-beta", "1.05", "--gnmr-delta", "1",
              "--gnmr-warmup", "2"]


@needs_cuda
def test_bf16_training_with_the_controller_on_gpu(tmp_path):
    """Same entry point, nccl backend, bf16: trains and the controller runs."""
    run_pretrain([*TINY, "--train-iters", "20", "--eval-interval", "100", "--bf16", "--gnmr",
                  "--monitors", "attention", "--save", str(tmp_path)])
    losses = train_losses(tmp_path)
    assert losses[20] < losses[1]


@needs_two_gpus
def test_tensor_parallel_on_two_gpus_with_nccl(tmp_path):
    run_pretrain([*TINY, "--train-iters", "10", "--eval-interval", "5", "--bf16", "--gnmr",
                  "--gnmr-agreement-interval", "1", "--monitors", "attention",
                  "--monitor-interval", "2", "--monitor-delta", "1",
                  "--tensor-model-parallel-size", "2", "--save", str(tmp_path)], nproc=2)
    assert train_losses(tmp_path)[10] < train_losses(tmp_path)[1]


@needs_te
def test_te_reports_every_recipe_with_a_reason():
    for name in ("tensorwise", "blockwise", "mxfp8"):
        capability = capabilities.te_recipe(name)
        assert isinstance(capability.reason, str) and capability.reason


@needs_te
def test_te_fp8_trains_with_per_unit_bf16_recovery(tmp_path):
    """te-fp8 with the controller: units switch to BF16 per step and the run trains."""
    run_pretrain([*TINY, *TE_WIDE, "--train-iters", "20", "--eval-interval", "100",
                  *EAGER_GNMR, "--save", str(tmp_path)])
    losses = train_losses(tmp_path)
    assert losses[20] < losses[1]
    assert any(record["recovery"] for record in trace_records(tmp_path))


@needs_te
def test_te_fp8_with_experts_switches_experts(tmp_path):
    run_pretrain([*TINY, *TE_WIDE, "--num-experts", "4", "--moe-aux-loss-coeff", "0.01",
                  "--train-iters", "12",
                  "--eval-interval", "100", *EAGER_GNMR, "--gnmr-max-o", "6",
                  "--save", str(tmp_path)])
    names = read_jsonl(tmp_path / "gnmr_trace.jsonl")[0]["units"]
    recovered = {names[u] for record in trace_records(tmp_path) for u in record["recovery"]}
    assert any(".experts." in name for name in recovered)


@needs_te
def test_te_disabled_autocast_gives_the_bf16_result():
    """Inside an FP8 autocast, a module under the nested disabled autocast computes what it
    computes with FP8 off altogether (bitwise), forward and weight gradient."""
    from megatron_gnmr.precision.te_backend import disabled_fp8_autocast

    te = capabilities.te_module()
    layer = te.Linear(256, 256, params_dtype=torch.bfloat16).cuda()
    x = torch.randn(32, 256, device="cuda", dtype=torch.bfloat16)
    reference = layer(x)
    reference.float().square().sum().backward()
    reference_grad = layer.weight.grad.clone()
    layer.weight.grad = None
    enter = te.autocast if hasattr(te, "autocast") else te.fp8_autocast
    with enter(enabled=True):
        with disabled_fp8_autocast():
            recovered = layer(x)
        quantized = layer(x)
    recovered.float().square().sum().backward()
    assert torch.equal(recovered, reference)
    assert torch.equal(layer.weight.grad, reference_grad)
    assert not torch.equal(quantized, reference)
