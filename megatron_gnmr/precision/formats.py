"""Low-precision number formats as fake quantization: round a tensor to the nearest value
of the format and return it in float32.

Every floating-point format is described by its exponent/mantissa widths and how it treats
overflow, Inf and NaN. The rounding is round to nearest, ties to even, subnormals included,
bit-exact with `ml_dtypes` casts (tested on millions of values and every tie and edge case),
and costs a handful of float32 passes over the tensor, no float64 copy:

- float8 E5M2 (and E4M3 off the CPU), where torch's own cast has the format's overflow rule
  and its round trip is cheap: the native cast (after a clamp to +-max when saturating);
- every other format and case (FP6 E2M3 / E3M2, FP4 E2M1, E4M3 on the CPU): the float32
  "magic number" rounding. For |x| with exponent e (clamped below at the format's smallest normal exponent),
  adding 2^(e - mantissa_bits + 23) moves the format's quantum 2^(e - mantissa_bits) to the
  last bit of the float32 sum, so the hardware's own round-to-nearest-even of that addition
  is the format's rounding; subtracting it back is exact. Normal and subnormal values take
  the same three operations.

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

import math
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

    @property
    def overflow_probe(self) -> float:
        """A magnitude that surely rounds above max (2^(max's exponent + 2))."""
        return float(2 ** (math.frexp(self.max_value)[1] + 1))


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
    """x rounded to the nearest value of `fmt` (ties to even), as a new float32 tensor."""
    return round_to_format_(x.to(torch.float32, copy=True), fmt, saturate)


def round_to_format_(work: torch.Tensor, fmt: Format, saturate: bool = False) -> torch.Tensor:
    """Round a float32 tensor the caller owns in place and return it. In place because on a
    CPU a fresh 16 MB buffer costs as much as a pass over it (page faults and zeroing)."""
    if isinstance(fmt, IntFormat):
        return work.round_().clamp_(fmt.min_value, fmt.max_value)  # half to even; NaN stays
    native = _native_dtype(fmt, work.device)
    if native is not None and (saturate or fmt.has_inf):
        return _native_cast_(work, fmt, native, saturate)
    return magic_round_(work, fmt, saturate)


def magic_round(x: torch.Tensor, fmt: FloatFormat, saturate: bool = False) -> torch.Tensor:
    """Any float format by the float32 magic-number rounding, as a new float32 tensor."""
    return magic_round_(x.to(torch.float32, copy=True), fmt, saturate)


def magic_round_(work: torch.Tensor, fmt: FloatFormat, saturate: bool = False) -> torch.Tensor:
    """In place (see the module docstring). The magic number carries x's sign, so the
    addition is a magnitude addition (round to nearest even is symmetric) and the final
    copysign restores the sign of values that round to zero."""
    if not fmt.has_nan:  # ml_dtypes maps NaN to -0 and Inf to the largest finite (-> max)
        work.nan_to_num_(nan=-0.0)
    clamp_to_max = saturate or not (fmt.has_inf or fmt.has_nan)
    # Saturation is a clamp before rounding (max is on the grid). Otherwise a value far
    # beyond the format only has to round to "overflow": clamp it where the magic number
    # cannot overflow float32, and mark what rounded above max. NaN passes the clamp.
    bound = fmt.max_value if clamp_to_max else fmt.overflow_probe
    work.clamp_(-bound, bound)
    # The exponent field of |x|: below the smallest normal, the subnormal grid's quantum;
    # bounded above by the clamp's (NaN's field too, so the integer add cannot overflow).
    lowest, highest = _exponent_field(2.0 ** fmt.min_exponent), _exponent_field(bound)
    magic = (work.view(torch.int32) & _EXPONENT_MASK).clamp_(lowest, highest)
    magic = magic.add_((23 - fmt.mantissa_bits) << 23).view(torch.float32).copysign_(work)
    work.add_(magic).sub_(magic)  # float32's round to nearest even at the format's quantum
    if not clamp_to_max:
        work.masked_fill_(work.abs() > fmt.max_value, torch.inf if fmt.has_inf else torch.nan)
    return work.copysign_(magic)


_EXPONENT_MASK = 0x7F800000


def _exponent_field(value: float) -> int:
    """The biased exponent bits of a positive normal float32 value, in place."""
    return (math.frexp(value)[1] - 1 + 127) << 23


def _native_dtype(fmt: FloatFormat, device: torch.device):
    """torch's float8 dtype where its cast round trip is the cheaper route: E5M2 everywhere;
    E4M3 off the CPU only (torch's CPU E4M3 -> float32 upcast costs ~6 ms per 4M values,
    more than the whole float32 rounding)."""
    if fmt.name == "e5m2":
        return torch.float8_e5m2
    if fmt.name == "e4m3" and device.type != "cpu":
        return torch.float8_e4m3fn
    return None


def _native_cast_(work: torch.Tensor, fmt: FloatFormat, dtype: torch.dtype,
                  saturate: bool) -> torch.Tensor:
    """torch's float8 cast, in place: round to nearest even; E5M2 overflows to Inf like
    IEEE, so a clamp first makes it saturate; NaN stays NaN."""
    if saturate:
        work.clamp_(-fmt.max_value, fmt.max_value)
    return work.copy_(work.to(dtype))
