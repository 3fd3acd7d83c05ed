"""Per-GEMM recovery: each of a unit's fprop, dgrad and wgrad GEMMs switched to the recovery
path alone changes that GEMM's output only, checked against float64 GEMMs of the operands
each GEMM must read; the three switched together are the recovery path bit for bit."""

import pytest
import torch

from megatron_gnmr.precision.paths import (
    GEMM_ROLES,
    GemmPath,
    RolePaths,
    emulated_linear,
    mixed_path,
)
from megatron_gnmr.precision.plan import PrecisionPlan, PrecisionRuntime
from megatron_gnmr.precision.recipes import EXACT, Recipe
from megatron_gnmr.precision.scaling import QuantSpec, quantize

# Every operand quantized, so every GEMM reads something the recovery path does not.
LOW = GemmPath("fp8", QuantSpec("e4m3", "tensor"), QuantSpec("e4m3", "tensor"),
               QuantSpec("e5m2", "tensor"))
# A low path whose wgrad reads its own saved copy of x (act-quant's shape of path).
SAVED_LOW = GemmPath("act-int3", saved_input=QuantSpec("int3", "tensor"))


def _operands(seed=0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 48, generator=generator)
    w = torch.randn(32, 48, generator=generator) * 0.1
    dy = torch.randn(64, 32, generator=generator)
    return x, w, dy


def _run(path, x, w, dy):
    x = x.clone().requires_grad_(True)
    w = w.clone().requires_grad_(True)
    y = emulated_linear(x, w, None, path, False, None)
    y.backward(dy)
    return {"fprop": y.detach(), "dgrad": x.grad, "wgrad": w.grad}


def _reference(low: GemmPath, recovered: set[str], x, w, dy):
    """float64 GEMMs of the operands each GEMM reads: the quantized ones on the low path,
    the originals on the (exact) recovery path."""
    def q(tensor, spec, role):
        if role in recovered or spec is None:
            return tensor.double()
        return quantize(tensor, spec).double()
    saved_spec = low.saved_input or low.input
    return {"fprop": q(x, low.input, "fprop") @ q(w, low.weight, "fprop").t(),
            "dgrad": q(dy, low.grad, "dgrad") @ q(w, low.weight, "dgrad"),
            "wgrad": q(dy, low.grad, "wgrad").t() @ q(x, saved_spec, "wgrad")}


@pytest.mark.parametrize("low", [LOW, SAVED_LOW], ids=["fp8", "saved-int3"])
@pytest.mark.parametrize("role", GEMM_ROLES)
def test_one_gemm_recovered_changes_that_gemm_only(low, role):
    x, w, dy = _operands()
    out = _run(mixed_path(low, EXACT, {role}), x, w, dy)
    expected = _reference(low, {role}, x, w, dy)
    all_low = _reference(low, set(), x, w, dy)
    for gemm in GEMM_ROLES:
        torch.testing.assert_close(out[gemm].double(), expected[gemm], rtol=1e-5, atol=1e-5)
    # the switched GEMM moved (where the low path quantizes its operands at all), the others
    # did not
    if (all_low[role] - expected[role]).abs().max() > 0:
        assert (out[role].double() - all_low[role]).abs().max() > 1e-3
    for gemm in set(GEMM_ROLES) - {role}:
        torch.testing.assert_close(out[gemm].double(), all_low[gemm], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("low", [LOW, SAVED_LOW], ids=["fp8", "saved-int3"])
def test_all_roles_are_the_recovery_path_and_none_the_low_path(low):
    x, w, dy = _operands(1)
    assert mixed_path(low, EXACT, set(GEMM_ROLES)) is EXACT
    assert mixed_path(low, EXACT, set()) is low
    # two roles at a time still split the shared operands correctly
    for kept_low in GEMM_ROLES:
        recovered = set(GEMM_ROLES) - {kept_low}
        out = _run(mixed_path(low, EXACT, recovered), x, w, dy)
        expected = _reference(low, recovered, x, w, dy)
        for gemm in GEMM_ROLES:
            torch.testing.assert_close(out[gemm].double(), expected[gemm], rtol=1e-5, atol=1e-5)


def test_per_role_path_with_every_role_low_is_bitwise_the_low_path():
    x, w, dy = _operands(2)
    plain = _run(LOW, x, w, dy)
    split = _run(RolePaths(LOW, LOW, LOW), x, w, dy)
    for gemm in GEMM_ROLES:
        assert torch.equal(plain[gemm], split[gemm])


def test_runtime_recovers_only_the_configured_gemms():
    recipe = Recipe("test", LOW, EXACT)
    plan = PrecisionPlan(recovery=frozenset({"layers.0.mlp.linear_fc2"}))
    runtime = PrecisionRuntime(recipe, plan, recovery_gemms=("wgrad",))
    path = runtime.path_for("layers.0.mlp.linear_fc2")
    assert isinstance(path, RolePaths)
    assert (path.fprop, path.dgrad, path.wgrad) == (LOW, LOW, EXACT)
    assert runtime.path_for("layers.1.mlp.linear_fc2") is LOW
    assert PrecisionRuntime(recipe, plan).path_for("layers.0.mlp.linear_fc2") is EXACT


def test_per_role_recovery_refuses_a_real_fp8_kernel():
    torchao_low = GemmPath("fp8-torchao", LOW.input, LOW.weight, LOW.grad, kernel="torchao")
    with pytest.raises(ValueError, match="emulated"):
        mixed_path(torchao_low, EXACT, {"wgrad"})
