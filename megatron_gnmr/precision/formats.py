"""Low-precision number formats as fake quantization: round a tensor to the nearest value
of the format and return it in float32.

Every floating-point format is described by its exponent/mantissa widths and how it treats
overflow, Inf and NaN; one routine rounds to any of them (round to nearest, ties to even,
subnormals included), computed in float64 where every step is exact. The results are
bit-exact with `ml_dtypes` casts (tested on millions of values and the edge cases):

| format | max | overflow (`saturate=False`) | Inf in | NaN in |
|---|---|---|---|---|
| fp8 E4M3 (fn) | 448 | NaN (no Inf encoding) | NaN | NaN |
| fp8 E5M2 | 57344 | Inf (IEEE) | Inf | NaN |
| fp6 E2M3 / E3M2, fp4 E2M1 (fn) | 7.5 / 28 / 6 | saturate to max | +-max | -0 (ml_dtypes) |

`saturate=True` clamps finite overflow to +-max, which is what scaled quantization does
(TE, torch's float8 casts for E4M3). Integer formats (INT8, INT4) are symmetric grids with
round-half-even and clamping to the type's range; NaN stays NaN.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class FloatFormat:
    name: str
    exponent_bits: int
    mantissa_bits: int
    bias: int
    max_value: float
    has_inf: bool
    has_nan: bool

    @property
    def min_exponent(self) -> int:  # exponent of the smallest normal number
        return 1 - self.bias

    @property
    def bits(self) -> int:
        return 1 + self.exponent_bits + self.mantissa_bits


@dataclass(frozen=True)
class IntFormat:
    name: str
    bits: int

    @property
    def max_value(self) -> float:
        return float(2 ** (self.bits - 1) - 1)

    @property
    def min_value(self) -> float:
        return float(-(2 ** (self.bits - 1)))


E4M3 = FloatFormat("e4m3", 4, 3, 7, 448.0, has_inf=False, has_nan=True)
E5M2 = FloatFormat("e5m2", 5, 2, 15, 57344.0, has_inf=True, has_nan=True)
E2M3 = FloatFormat("e2m3", 2, 3, 1, 7.5, has_inf=False, has_nan=False)
E3M2 = FloatFormat("e3m2", 3, 2, 3, 28.0, has_inf=False, has_nan=False)
E2M1 = FloatFormat("e2m1", 2, 1, 1, 6.0, has_inf=False, has_nan=False)
INT8 = IntFormat("int8", 8)
INT4 = IntFormat("int4", 4)
INT3 = IntFormat("int3", 3)  # below the paper's 4 bits: for stress where 4 bits barely hurt
INT2 = IntFormat("int2", 2)

FORMATS = {f.name: f for f in (E4M3, E5M2, E2M3, E3M2, E2M1, INT8, INT4, INT3, INT2)}
Format = FloatFormat | IntFormat


def get_format(name: str) -> Format:
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown format {name!r}; known: {', '.join(FORMATS)}") from None


def round_to_format(x: torch.Tensor, fmt: Format, saturate: bool = False) -> torch.Tensor:
    """x rounded to the nearest value of `fmt` (ties to even), as float32."""
    if isinstance(fmt, IntFormat):
        return _round_to_int(x, fmt)
    return _round_to_float(x, fmt, saturate)


def _round_to_int(x: torch.Tensor, fmt: IntFormat) -> torch.Tensor:
    # torch.round rounds half to even; clamp keeps NaN.
    return torch.round(x.float()).clamp(fmt.min_value, fmt.max_value)


def _round_to_float(x: torch.Tensor, fmt: FloatFormat, saturate: bool) -> torch.Tensor:
    xd = x.double()
    magnitude = xd.abs()
    _, exponent = torch.frexp(magnitude)  # magnitude = m * 2**exponent, m in [0.5, 1)
    exponent = torch.clamp(exponent - 1, min=fmt.min_exponent)  # below: the subnormal grid
    quantum = torch.ldexp(torch.ones_like(xd), exponent - fmt.mantissa_bits)
    rounded = torch.round(magnitude / quantum) * quantum  # exact in float64; half to even

    finite = torch.isfinite(xd)
    overflow = finite & (rounded > fmt.max_value)
    if saturate or not (fmt.has_inf or fmt.has_nan):
        rounded = torch.where(overflow, fmt.max_value, rounded)
    else:
        rounded = torch.where(overflow, torch.inf if fmt.has_inf else torch.nan, rounded)

    is_inf = torch.isinf(xd)
    if saturate or not (fmt.has_inf or fmt.has_nan):
        inf_value = fmt.max_value
    else:
        inf_value = torch.inf if fmt.has_inf else torch.nan
    rounded = torch.where(is_inf, inf_value, rounded)
    result = torch.copysign(rounded, xd)

    is_nan = torch.isnan(xd)
    nan_value = torch.nan if fmt.has_nan else -0.0  # ml_dtypes maps NaN to -0 without NaN
    result = torch.where(is_nan, nan_value, result)
    return result.float()
