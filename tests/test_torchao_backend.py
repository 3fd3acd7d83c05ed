"""The fp8-torchao backend on the CPU: torchao's internals behave as `torchao_compat` was
written against (this fails loudly if torchao changes them), the real-FP8 GEMMs equal the
emulated fp8 recipe within the accumulation-order tolerance, rowwise scaling against a
float64 reference, the TP amax rule, the qerr probe on the real casts, and bad input."""

import numpy as np
import pytest
import torch

from megatron_gnmr.arguments import parse_config
from megatron_gnmr.errors import UserError
from megatron_gnmr.precision import torchao_compat
from megatron_gnmr.precision.paths import GemmPath, emulated_linear
from megatron_gnmr.precision.probes import ProbeBank
from megatron_gnmr.precision.scaling import QuantSpec, quantize
from megatron_gnmr.precision.torchao_linear import SPLIT_DIM, torchao_linear
from megatron_gnmr.validation import validate
from tests.helpers import TINY

pytest.importorskip("torchao", reason="torchao is part of the dev extra")

TENSORWISE = GemmPath("t", QuantSpec("e4m3"), QuantSpec("e4m3"), QuantSpec("e5m2"),
                      kernel="torchao")
ROWWISE = GemmPath("r", QuantSpec("e4m3", "row", True), QuantSpec("e4m3", "row", True),
                   QuantSpec("e4m3", "row", True), kernel="torchao")


def tensors(seed=0, m=64, k=128, n=96):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.exp(torch.randn(m, 1, generator=g))
    return x, torch.randn(n, k, generator=g) * 0.05, torch.randn(m, n, generator=g) * 1e-3


def test_tensorwise_cast_is_the_emulated_quantizer_with_the_same_scale():
    x, _, _ = tensors()
    fp8 = torchao_compat.cast(x, "e4m3", "tensor", -1, "INPUT", False)
    emulated_scale = torch.tensor(448.0) / x.abs().amax()  # float32, as scaling._scale
    assert fp8._scale.dtype == torch.float32 and fp8._data.dtype == torch.float8_e4m3fn
    assert torch.equal(fp8._scale.reshape(()), emulated_scale)
    assert torch.equal(torchao_compat.dequantized(fp8), quantize(x, QuantSpec("e4m3")))


def test_rowwise_cast_has_power_of_two_scales_per_slice():
    x, _, _ = tensors(1)
    for amax_dim in (-1, 0):
        fp8 = torchao_compat.cast(x, "e4m3", "row", amax_dim, "INPUT", True)
        x64 = x.double()
        amax = x64.abs().amax(dim=amax_dim, keepdim=True)
        scale = torch.exp2(torch.floor(torch.log2(448.0 / amax)))
        assert torch.equal(fp8._scale.double(), scale)
        expected = ((x64 * scale).float().to(torch.float8_e4m3fn).double() / scale).float()
        assert torch.equal(torchao_compat.dequantized(fp8), expected)


def run(function, path, x, w, g, probe=None):
    x = x.clone().requires_grad_(True)
    w = w.clone().requires_grad_(True)
    if function is torchao_linear:
        out = torchao_linear(x, w, None, path, False, None, "column", probe)
    else:
        out = emulated_linear(x, w, None, path, False, None, probe)
    out.backward(g)
    return out.detach(), x.grad, w.grad


def test_tensorwise_gemms_equal_the_emulated_recipe_up_to_accumulation_order():
    """Same quantized operands; `_scaled_mm` multiplies FP8 codes and scales after the sum,
    emulation multiplies dequantized floats: float32 rounding apart (rtol 1e-5)."""
    x, w, g = tensors(2)
    emulated = GemmPath("e", QuantSpec("e4m3"), QuantSpec("e4m3"), QuantSpec("e5m2"))
    for real, fake in zip(run(torchao_linear, TENSORWISE, x, w, g),
                          run(emulated_linear, emulated, x, w, g)):
        torch.testing.assert_close(real, fake, rtol=1e-5, atol=1e-5 * fake.abs().max().item())
    # and FP8 really changed the result
    exact = run(emulated_linear, GemmPath("exact"), x, w, g)
    assert not torch.allclose(run(torchao_linear, TENSORWISE, x, w, g)[0], exact[0], rtol=1e-3)


def test_rowwise_gemms_against_a_float64_reference():
    """Each operand scaled along the axis its GEMM contracts, as torchao's rowwise recipe;
    torchao rounds the float32 output through bf16 (rtol 1e-2)."""
    x, w, g = tensors(3)
    out, grad_x, grad_w = run(torchao_linear, ROWWISE, x, w, g)

    def q(t, dim):
        t = t.double()
        scale = torch.exp2(torch.floor(torch.log2(448.0 / t.abs().amax(dim=dim, keepdim=True))))
        return (t * scale).float().to(torch.float8_e4m3fn).double() / scale

    assert torch.allclose(out.double(), q(x, -1) @ q(w, -1).t(), rtol=1e-2, atol=1e-3)
    assert torch.allclose(grad_x.double(), q(g, -1) @ q(w, 0), rtol=1e-2, atol=1e-6)
    assert torch.allclose(grad_w.double(), q(g, 0).t() @ q(x, 0), rtol=1e-2, atol=1e-4)


def test_tensor_parallel_amax_rule():
    """Which casts reduce their amax over TP: where the amax axis is the split one (rowwise),
    or the tensor is split at all (tensorwise); see torchao_linear's table."""
    from megatron_gnmr.precision import torchao_linear as module

    def reduced(parallel, operand, amax_dim, granularity):
        calls = []
        original = torchao_compat.cast
        torchao_compat.cast = lambda *a: calls.append(a[-1]) or original(*a[:-1], None)
        try:
            ctx = type("Ctx", (), {"parallel": parallel, "tp_group": "TP"})
            spec = QuantSpec("e4m3", granularity, granularity == "row")
            module._cast(torch.ones(16, 16), spec, amax_dim, "INPUT", operand, ctx)
        finally:
            torchao_compat.cast = original
        return calls[0] == "TP"

    assert SPLIT_DIM == {"column": {"weight_t": 1, "grad": 1}, "row": {"input": 1, "weight_t": 0}}
    expected_rowwise = {("column", "input", -1): False, ("column", "weight_t", 0): False,
                        ("column", "grad", -1): True, ("column", "weight_t", -1): True,
                        ("column", "grad", 0): False, ("column", "input", 0): False,
                        ("row", "input", -1): True, ("row", "weight_t", 0): True,
                        ("row", "grad", -1): False, ("row", "weight_t", -1): False,
                        ("row", "grad", 0): False, ("row", "input", 0): False}
    for (parallel, operand, dim), want in expected_rowwise.items():
        assert reduced(parallel, operand, dim, "row") == want, (parallel, operand, dim)
        split = operand in SPLIT_DIM[parallel]
        assert reduced(parallel, operand, dim, "tensor") == split, (parallel, operand, dim)


def test_qerr_probe_measures_the_real_casts():
    x, w, g = tensors(4)
    bank = ProbeBank(["u"], TENSORWISE, ("qerr",))
    run(torchao_linear, TENSORWISE, x, w, g, bank.probe("u"))
    pairs = bank.take().reshape(4, 2).numpy()  # qerr's (err^2, ref^2) per operand

    def relative_error(t, dtype, fmax):
        t = t.double()
        scale = fmax / t.abs().max()
        q = (t * scale).float().to(dtype).double() / scale
        return float((q - t).norm() / t.norm())

    measured = np.sqrt(pairs[:3, 0] / pairs[:3, 1])  # input, weight, grad
    assert measured[0] == pytest.approx(relative_error(x, torch.float8_e4m3fn, 448.0), rel=1e-6)
    assert measured[1] == pytest.approx(relative_error(w, torch.float8_e4m3fn, 448.0), rel=1e-6)
    assert measured[2] == pytest.approx(relative_error(g, torch.float8_e5m2, 57344.0), rel=1e-6)


def check(flags):
    validate(parse_config([*TINY, "--precision-recipe", "fp8-torchao", *flags]), world_size=1)


def test_bad_input_is_refused_in_one_line(monkeypatch):
    check([])
    check(["--fp8-recipe", "rowwise"])
    with pytest.raises(UserError, match="--fp8-recipe 'blockwise' with --precision-recipe "
                                        "fp8-torchao: use tensorwise or rowwise"):
        check(["--fp8-recipe", "blockwise"])
    with pytest.raises(UserError, match="multiple of 16; linear_fc1: N .* = 360 is not a "
                                        "multiple of 16"):
        check(["--ffn-hidden-size", "180"])
    with pytest.raises(UserError, match="tokens .* = 200 is not a multiple of 16"):
        check(["--seq-length", "50"])
    monkeypatch.setattr(torchao_compat, "torchao_version", lambda: None)
    with pytest.raises(UserError, match="needs torchao: pip install"):
        check([])
    monkeypatch.setattr(torchao_compat, "torchao_version", lambda: (0, 25))
    with pytest.raises(UserError, match="torchao 0.25 is not a version"):
        check([])
