"""Scaled quantization against float64 references written independently per granularity."""

import numpy as np
import pytest
import torch

from megatron_gnmr.precision.formats import E4M3, get_format, round_to_format
from megatron_gnmr.precision.scaling import QuantSpec, quantize


def _ref_round(values: np.ndarray, fmt) -> np.ndarray:
    return round_to_format(torch.from_numpy(values), fmt, saturate=True).double().numpy()


def _ref_group(group: np.ndarray, fmt, pow2: bool) -> np.ndarray:
    amax = np.abs(group).max()
    scale = fmt.max_value / amax if amax > 0 else 1.0
    if pow2:
        scale = 2.0 ** np.floor(np.log2(scale))
    scale = np.float32(scale)  # scaling and unscaling happen in float32, as on the GPU
    scaled = (group.astype(np.float32) * scale).astype(np.float32)
    return _ref_round(scaled, fmt).astype(np.float32) * (np.float32(1) / scale)


@pytest.fixture
def x():
    torch.manual_seed(0)
    return torch.randn(200, 300) * torch.logspace(-3, 2, 300)  # columns of very different scale


@pytest.mark.parametrize("fmt", ["e4m3", "e2m3", "e2m1", "int8"])
@pytest.mark.parametrize("pow2", [False, True])
def test_tensor_row_tile_block(x, fmt, pow2):
    f = get_format(fmt)
    xs = x.numpy()
    tensor = quantize(x, QuantSpec(fmt, "tensor", pow2)).numpy()
    np.testing.assert_array_equal(tensor, _ref_group(xs, f, pow2).astype(np.float32))
    row = quantize(x, QuantSpec(fmt, "row", pow2)).numpy()
    expected = np.stack([_ref_group(r, f, pow2) for r in xs]).astype(np.float32)
    np.testing.assert_array_equal(row, expected)
    tile = quantize(x, QuantSpec(fmt, "tile", pow2)).numpy()
    expected = np.concatenate([np.stack([_ref_group(r[c:c + 128], f, pow2) for r in xs])
                               for c in range(0, 300, 128)], axis=1).astype(np.float32)
    np.testing.assert_array_equal(tile, expected)
    block = quantize(x, QuantSpec(fmt, "block", pow2)).numpy()
    expected = np.zeros_like(xs)
    for r in range(0, 200, 128):
        for c in range(0, 300, 128):
            expected[r:r + 128, c:c + 128] = _ref_group(xs[r:r + 128, c:c + 128], f, pow2)
    np.testing.assert_array_equal(block, expected.astype(np.float32))


def test_mx_uses_power_of_two_shared_exponents(x):
    out = quantize(x, QuantSpec("e4m3", "mx")).numpy()
    xs = x.numpy()
    for r in (0, 57, 199):
        for c in range(0, 300, 32):
            group = xs[r, c:c + 32]
            shared = np.floor(np.log2(np.abs(group).max())) - 8  # e4m3: emax 8
            expected = _ref_round((group / 2.0 ** shared).astype(np.float32), E4M3) * 2 ** shared
            np.testing.assert_array_equal(out[r, c:c + 32], expected.astype(np.float32))


def test_nonfinite_values_surface_and_do_not_poison_the_scale():
    x = torch.tensor([1.0, float("nan"), -2.0, float("inf"), 0.5])
    out = quantize(x, QuantSpec("e4m3", "tensor"))
    assert torch.isnan(out[1]) and torch.isinf(out[3])
    np.testing.assert_array_equal(out[[0, 2, 4]].numpy(),
                                  quantize(torch.tensor([1.0, -2.0, 0.5]),
                                           QuantSpec("e4m3", "tensor")).numpy())
