"""NVFP4 against float64 references: values and two-level scales (ml_dtypes E2M1 / E4M3),
stochastic rounding on the grid and unbiased, the random Hadamard transform orthogonal and
invisible in the weight gradient, and the recipe's switches."""

import ml_dtypes
import numpy as np
import pytest
import torch

from megatron_gnmr.arguments import parse_config
from megatron_gnmr.precision.backends import build_recipe
from megatron_gnmr.precision.formats import E2M1
from megatron_gnmr.precision.nvfp4 import (
    hadamard_matrix,
    quantize_nvfp4,
    random_signs,
    stochastic_round,
    transform_tokens,
)
from megatron_gnmr.precision.paths import saved_for_weight_gradient, weight_gradient

FLOAT32_MAX = float(np.finfo(np.float32).max)
E2M1_GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def nvfp4_reference(x: np.ndarray, two_d: bool) -> np.ndarray:
    """The published two-level scheme written out in float64 with ml_dtypes' casts."""
    x = x.astype(np.float64)
    encode = min(6.0 * 448.0 / np.abs(x).max(), FLOAT32_MAX)  # TE clamps to float32's max
    out = np.zeros_like(x)
    rows, cols = x.shape
    height = 16 if two_d else 1
    for r in range(0, rows, height):
        for c in range(0, cols, 16):
            block = x[r:r + height, c:c + 16]
            scale = np.float64(np.abs(block).max() / 6.0 * encode)
            scale = float(np.array(min(scale, 448.0)).astype(ml_dtypes.float8_e4m3fn))
            if scale == 0:
                continue
            factor = min(encode / scale, FLOAT32_MAX)  # TE's per-block encode, clamped
            values = (block * factor).astype(ml_dtypes.float4_e2m1fn).astype(np.float64)
            out[r:r + height, c:c + 16] = values * scale / encode
    return out


def _tensor(rows=64, cols=96, seed=0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=generator)
    x *= torch.exp(1.5 * torch.randn(rows, 1, generator=generator))  # per-row spread
    x[3, 17] = 40.0  # an outlier sets the tensor scale
    x[5, :16] = 0.0  # an all-zero block
    return x


@pytest.mark.parametrize("two_d", [False, True], ids=["1x16", "16x16"])
def test_values_and_scales_match_the_float64_reference(two_d):
    x = _tensor()
    got = quantize_nvfp4(x, two_d=two_d).double().numpy()
    # the same grid point everywhere (grid points are >= 1/8 apart, relatively); the
    # float32 dequantization q * (d / s) is within two float32 roundings of float64's
    np.testing.assert_allclose(got, nvfp4_reference(x.numpy(), two_d), rtol=2 ** -22, atol=0)
    # every block is an E4M3 scale times E2M1 values: at most 8 magnitudes per 1x16 block
    assert all(np.unique(np.abs(got[r, c:c + 16])).size <= 8 for r in range(64)
               for c in range(0, 96, 16))


@pytest.mark.parametrize("amax", [1e-37, 5e-36, 2e-39, 3e38, 1.0],
                         ids=["tiny", "below-8e-36", "subnormal", "near-max", "one"])
def test_scales_clamp_at_the_float32_edges_as_transformer_engine_does(amax):
    """A tensor whose largest magnitude is below ~8e-36 overflows the global encode scale;
    clamped to the float32 maximum it keeps its values (a subnormal amax loses them in TE's
    scheme too: the block factor saturates). Against the float64 reference."""
    x = _tensor(32, 32)
    x = x / x.abs().max() * amax
    got = quantize_nvfp4(x).double().numpy()
    reference = nvfp4_reference(x.numpy(), two_d=False)
    assert np.isfinite(got).all()
    # float32 subnormals carry fewer bits: one quantum of float32's subnormal grid apart
    np.testing.assert_allclose(got, reference, rtol=2 ** -20, atol=2.0 ** -149)
    if amax >= 1e-37:  # normal amax: the values are kept, not flushed to zero
        assert np.abs(got).max() > 0.5 * amax


def test_blocks_pad_and_keep_shape():
    x = _tensor(rows=20, cols=40)  # neither a multiple of 16
    np.testing.assert_allclose(quantize_nvfp4(x).double().numpy(),
                               nvfp4_reference(x.numpy(), False), rtol=2 ** -22, atol=0)
    assert quantize_nvfp4(x, two_d=True).shape == x.shape


def test_stochastic_rounding_stays_on_the_grid_and_is_unbiased():
    generator = torch.Generator().manual_seed(0)
    values = torch.linspace(-6, 6, 97, dtype=torch.float64).float()  # ties, grid and between
    draws = torch.stack([stochastic_round(values, E2M1, generator) for _ in range(20_000)])
    magnitudes = draws.abs().numpy()
    assert np.isin(magnitudes, E2M1_GRID).all()
    for value, column in zip(values.numpy(), draws.T.numpy()):
        below = E2M1_GRID[E2M1_GRID <= abs(value)].max()
        above = E2M1_GRID[E2M1_GRID >= abs(value)].min()
        assert set(np.abs(column)) <= {below, above}  # only the two neighbours
        # mean of 20k Bernoulli draws: within 5 standard errors of the value
        spread = (above - below) / 2 / np.sqrt(len(column))
        assert abs(column.mean() - value) <= 5 * spread + 1e-7


def test_hadamard_is_orthogonal_and_leaves_the_weight_gradient_unchanged():
    signs = random_signs(seed=3)
    h = hadamard_matrix(signs).double()
    np.testing.assert_allclose((h @ h.T).numpy(), np.eye(16), atol=1e-12)
    assert set(signs.tolist()) == {-1.0, 1.0}
    generator = torch.Generator().manual_seed(1)
    g, x = torch.randn(40, 24, generator=generator), torch.randn(40, 32, generator=generator)
    hg, hx = transform_tokens(g, h.float()), transform_tokens(x, h.float())
    assert hx.shape == (48, 32)  # tokens padded to a multiple of 16
    np.testing.assert_allclose((hg.double().T @ hx.double()).numpy(),
                               (g.double().T @ x.double()).numpy(), atol=1e-4)
    # the inverse is the transpose: H^T (H x) = x
    back = torch.matmul(h.float().T, hx.reshape(-1, 16, 32)).reshape(-1, 32)[:40]
    np.testing.assert_allclose(back.numpy(), x.numpy(), atol=1e-5)


def _recipe(*flags):
    return build_recipe(parse_config(["--precision-recipe", "nvfp4", *flags]).precision)


def test_the_wgrad_operands_are_transformed_then_quantized_along_tokens():
    path = _recipe("--no-nvfp4-stochastic-rounding").low
    generator = torch.Generator().manual_seed(2)
    x, g = torch.randn(48, 32, generator=generator), torch.randn(48, 64, generator=generator)
    saved = saved_for_weight_gradient(x, None, path, None)
    got = weight_gradient(g, None, saved, path, None)
    h = hadamard_matrix(torch.tensor(path.hadamard_signs)).double().numpy()

    def reference(a):  # H a per 16 tokens, then 1x16 blocks along tokens
        transformed = np.concatenate([h @ a[i:i + 16] for i in range(0, len(a), 16)])
        return nvfp4_reference(transformed.T, False).T

    expected = reference(g.double().numpy()).T @ reference(x.double().numpy())
    np.testing.assert_allclose(got.double().numpy(), expected, rtol=1e-5, atol=1e-6)


def test_every_part_of_the_recipe_is_switchable():
    full = _recipe()
    assert full.low.weight.granularity == "nvfp4-2d" and full.low.grad.stochastic
    assert full.low.hadamard_signs is not None and full.recovery.is_exact
    plain = _recipe("--no-nvfp4-2d-weights", "--no-nvfp4-stochastic-rounding",
                    "--no-nvfp4-hadamard", "--nvfp4-recovery", "fp8")
    assert plain.low.weight.granularity == "nvfp4" and not plain.low.grad.stochastic
    assert plain.low.hadamard_signs is None
    assert plain.recovery.input.format == "e4m3" and plain.recovery.grad.format == "e5m2"
