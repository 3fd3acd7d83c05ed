"""Fake quantization is bit-exact with ml_dtypes (and torch's float8 casts)."""

import ml_dtypes
import numpy as np
import pytest
import torch

from megatron_gnmr.precision.formats import E2M1, E2M3, E3M2, E4M3, E5M2, INT4, INT8, \
    round_to_format

FLOAT_FORMATS = {
    E4M3: ml_dtypes.float8_e4m3fn, E5M2: ml_dtypes.float8_e5m2,
    E2M3: ml_dtypes.float6_e2m3fn, E3M2: ml_dtypes.float6_e3m2fn, E2M1: ml_dtypes.float4_e2m1fn,
}


def _edge_cases(dtype) -> np.ndarray:
    info = ml_dtypes.finfo(dtype)
    top, tiny, sub = float(info.max), float(info.smallest_normal), float(info.smallest_subnormal)
    # every representable value, and every midpoint between neighbours (the ties)
    grid = np.unique(np.arange(256, dtype=np.uint8).view(dtype) if np.dtype(dtype).itemsize == 1
                     else np.array([], dtype))
    grid = grid.astype(np.float64)
    grid = np.sort(grid[np.isfinite(grid)])
    midpoints = (grid[1:] + grid[:-1]) / 2
    values = [0.0, -0.0, top, -top, tiny, sub, sub / 2, sub * 0.51, -sub / 2, top * 1.01,
              top * 1.5, top * 4, 1e30, -1e30, np.inf, -np.inf, np.nan]
    return np.concatenate([grid, midpoints, np.nextafter(midpoints, np.inf),
                           np.nextafter(midpoints, -np.inf), values]).astype(np.float32)


def _random_values(count: int, top: float) -> np.ndarray:
    rng = np.random.default_rng(1234)
    magnitude = np.exp(rng.uniform(np.log(top) - 14, np.log(top) + 2, count))
    return (magnitude * rng.choice([-1.0, 1.0], count)).astype(np.float32)


def _same_bits(actual: torch.Tensor, expected: np.ndarray):
    expected = expected.astype(np.float32)
    got = actual.numpy()
    both_nan = np.isnan(got) & np.isnan(expected)
    mismatch = ~both_nan & (got.view(np.uint32) != expected.view(np.uint32))
    assert not mismatch.any(), list(zip(got[mismatch][:5], expected[mismatch][:5]))


@pytest.mark.parametrize("fmt", list(FLOAT_FORMATS), ids=lambda f: f.name)
def test_float_formats_match_ml_dtypes(fmt):
    dtype = FLOAT_FORMATS[fmt]
    values = np.concatenate([_random_values(1_000_000, float(ml_dtypes.finfo(dtype).max)),
                             _edge_cases(dtype)])
    expected = values.astype(dtype).astype(np.float32)
    _same_bits(round_to_format(torch.from_numpy(values), fmt), expected)


def test_nonfinite_rules_are_the_formats():
    x = torch.tensor([np.inf, -np.inf, np.nan, 1e9])
    assert torch.isnan(round_to_format(x, E4M3)).tolist() == [True, True, True, True]
    assert round_to_format(x, E5M2).tolist()[:2] == [np.inf, -np.inf]
    assert round_to_format(x, E2M1).tolist()[:2] == [6.0, -6.0]


@pytest.mark.parametrize("fmt,torch_dtype", [(E4M3, torch.float8_e4m3fn),
                                             (E5M2, torch.float8_e5m2)], ids=["e4m3", "e5m2"])
def test_float8_matches_torch_casts(fmt, torch_dtype):
    values = torch.from_numpy(_random_values(1_000_000, 448.0 if fmt is E4M3 else 57344.0))
    # torch saturates E4M3 (no Inf/NaN on overflow) and is IEEE for E5M2.
    saturate = fmt is E4M3
    finite = values[values.abs() < 1e4] if fmt is E4M3 else values
    _same_bits(round_to_format(finite, fmt, saturate=saturate),
               finite.to(torch_dtype).float().numpy())


@pytest.mark.parametrize("fmt", [INT8, INT4], ids=lambda f: f.name)
def test_int_formats_round_half_even_and_clamp(fmt):
    rng = np.random.default_rng(7)
    values = np.concatenate([rng.uniform(-2 ** fmt.bits, 2 ** fmt.bits, 1_000_000),
                             np.arange(-10.5, 10.5, 0.5), [np.nan, np.inf, -np.inf]])
    values = values.astype(np.float32)
    info = ml_dtypes.iinfo(ml_dtypes.int4) if fmt is INT4 else np.iinfo(np.int8)
    expected = np.clip(np.rint(values), info.min, info.max)
    _same_bits(round_to_format(torch.from_numpy(values), fmt), expected)


@pytest.mark.parametrize("fmt", list(FLOAT_FORMATS), ids=lambda f: f.name)
@pytest.mark.parametrize("saturate", [False, True], ids=["ieee", "saturate"])
def test_every_rounding_route_matches_ml_dtypes(fmt, saturate):
    """The float32 magic-number rounding (every format), torch's float8 cast (where its
    overflow rule is the format's) and the dispatch between them, against ml_dtypes;
    saturation = ml_dtypes of the value clipped to +-max."""
    from megatron_gnmr.precision import formats

    dtype = FLOAT_FORMATS[fmt]
    values = np.concatenate([_random_values(200_000, float(ml_dtypes.finfo(dtype).max)),
                             _edge_cases(dtype)])
    top = float(ml_dtypes.finfo(dtype).max)
    reference = np.clip(values, -top, top) if saturate else values
    expected = reference.astype(dtype).astype(np.float32)
    routes = [formats.magic_round, formats.round_to_format]
    native = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}.get(fmt.name)
    if native is not None and (saturate or fmt.has_inf):
        routes.append(lambda x, f, s: formats._native_cast_(x.float().clone(), f, native, s))
    for route in routes:
        _same_bits(route(torch.from_numpy(values), fmt, saturate), expected)
