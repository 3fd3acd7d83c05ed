"""torchao FP8 with compilation (issue 59 item 4): torchao documents its float8 training as
torch.compile's to speed up (the scaling and casting kernels fuse; torchtitan's float8
requires --compile.enable). --compile with --precision-recipe fp8-torchao compiles each unit's
casts and `_scaled_mm` GEMMs in the unit's region: the training losses equal eager ones."""

import numpy as np
import pytest
import torch

from megatron_gnmr.precision.scaling import QuantSpec
from megatron_gnmr.precision.paths import GemmPath
from tests.helpers import TINY, read_jsonl, run_pretrain, train_losses

pytest.importorskip("torchao", reason="torchao is part of the dev extra")

SMALL = [*TINY, "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "2",
         "--eval-interval", "1000", "--eval-iters", "1", "--precision-recipe", "fp8-torchao"]
STEPS = 3


def test_the_fp8_linear_compiles_to_the_eager_values():
    """One unit's torchao function under torch.compile: the same output and gradients (the
    same FP8 codes and scales; `_scaled_mm` as eager calls it)."""
    from megatron_gnmr.precision.torchao_linear import torchao_linear

    path = GemmPath("t", QuantSpec("e4m3"), QuantSpec("e4m3"), QuantSpec("e5m2"),
                    kernel="torchao")
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(32, 64, generator=g), torch.randn(48, 64, generator=g) * 0.05
    grad = torch.randn(32, 48, generator=g) * 1e-3

    def step(function):
        xs, ws = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        out = function(xs, ws)
        out.backward(grad)
        return out.detach(), xs.grad, ws.grad

    def linear(xs, ws):
        return torchao_linear(xs, ws, None, path, False, None, "column")

    for eager, compiled in zip(step(linear), step(torch.compile(linear, dynamic=False))):
        torch.testing.assert_close(compiled, eager, rtol=1e-6, atol=0)


def test_fp8_torchao_with_compiled_layers_trains_to_the_eager_losses(tmp_path):
    eager = train_losses(_train(tmp_path / "eager", []))
    run = tmp_path / "compiled"
    compiled = train_losses(_train(run, ["--compile"]))
    np.testing.assert_allclose([compiled[s] for s in range(1, STEPS + 1)],
                               [eager[s] for s in range(1, STEPS + 1)], rtol=1e-4)
    logged = [r for r in read_jsonl(run / "metrics.jsonl") if "compile/graphs" in r]
    assert logged and logged[0]["compile/graphs"] > 0


def _train(run, flags):
    run_pretrain([*SMALL, "--train-iters", str(STEPS), *flags, "--save", str(run)])
    return run
