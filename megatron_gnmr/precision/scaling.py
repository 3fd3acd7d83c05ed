"""Scaled quantization: choose a scale per tensor / row / tile / block, round, unscale.

Granularities (the last dimension is the GEMM's reduction dimension K):

| granularity | one scale per | used by |
|---|---|---|
| `tensor` | whole tensor (amax reduced over the TP group) | TE current scaling |
| `row` | row of the [-1, K] view (amax reduced over the TP group, if one is given: the rows are split) | per-token / per-channel (W8A8) |
| `tile` | 1 x 128 slice of a row | DeepSeek-V3 / TE Float8BlockScaling activations, grads |
| `block` | 128 x 128 block of a 2-D weight | DeepSeek-V3 / TE Float8BlockScaling weights |
| `mx` | 1 x 32 slice, scale a power of two (E8M0) | OCP MX / TE MXFP8BlockScaling |

scale = format max / amax (amax 0: scale 1), optionally rounded down to a power of two,
all in float32; dequantization multiplies by the float32 reciprocal (TE's scale_inv). MX
uses the shared exponent floor(log2 amax) - floor(log2 format max). Non-finite inputs stay
non-finite (NaN/Inf must surface, not be rounded away) and do not enter the amax.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from megatron_gnmr.precision.formats import Format, get_format, round_to_format_

GRANULARITIES = ("tensor", "row", "tile", "block", "mx", "nvfp4", "nvfp4-2d")


@dataclass(frozen=True)
class QuantSpec:
    format: str
    granularity: str = "tensor"
    pow2_scale: bool = False
    block_size: int = 128  # tile and block edge; MX always uses 32, NVFP4 16
    stochastic: bool = False  # stochastic rounding (NVFP4 only; the global torch generator)

    def __post_init__(self):
        get_format(self.format)
        if self.granularity not in GRANULARITIES:
            raise ValueError(f"granularity must be one of {GRANULARITIES}, got "
                             f"{self.granularity!r}")
        if self.granularity.startswith("nvfp4") and self.format != "e2m1":
            raise ValueError("NVFP4 scaling is for E2M1 values")
        if self.stochastic and not self.granularity.startswith("nvfp4"):
            raise ValueError("stochastic rounding is implemented for NVFP4 only")


def quantize(x: torch.Tensor, spec: QuantSpec, amax_group=None) -> torch.Tensor:
    """Fake-quantize x (returned in x's dtype). `amax_group`: reduce a per-tensor amax over
    this process group (TP), so that a sharded tensor is scaled like the whole one.

    The common case takes one max-abs pass for the scales and the rounding's few float32
    passes. A non-finite value shows in its amax; only then is the input masked (so NaN/Inf
    neither enter the scale nor get rounded away) and quantized again. That check reads the
    amax on the host: a sync per call on a GPU, which the emulation accepts."""
    fmt = get_format(spec.format)
    xf = x.float()
    result = _quantize(xf, spec, fmt, amax_group)
    if result is None:  # NaN/Inf somewhere (on this rank or, per tensor, another TP rank)
        finite = torch.isfinite(xf)
        result = torch.where(finite, _quantize(torch.where(finite, xf, 0), spec, fmt,
                                               amax_group), xf)
    return result.to(x.dtype)


def _quantize(xf: torch.Tensor, spec: QuantSpec, fmt: Format, amax_group):
    """The quantized float32 tensor, or None if an amax is not finite."""
    if xf.numel() == 0 and spec.granularity != "tensor":
        return xf  # nothing to round (an expert without tokens); no collective to join
    if spec.granularity == "tensor":
        amax = _tensor_amax(xf, amax_group)
        return _scaled_round(xf, amax, fmt, spec.pow2_scale) if _finite(amax) else None
    if spec.granularity == "row":
        rows = xf.reshape(-1, xf.shape[-1])
        amax = _group_max(_amax(rows, dim=-1), amax_group)
        return _scaled_round(rows, amax, fmt, spec.pow2_scale).reshape(xf.shape) \
            if _finite(amax) else None
    if spec.granularity.startswith("nvfp4"):
        from megatron_gnmr.precision.nvfp4 import quantize_nvfp4

        amax = _tensor_amax(xf, amax_group)  # the FP32 tensor scale's
        if not _finite(amax):
            return None
        return quantize_nvfp4(xf, two_d=spec.granularity == "nvfp4-2d",
                              stochastic=spec.stochastic, tensor_amax=amax)
    if spec.granularity in ("tile", "mx"):
        return _tiled(xf, 32 if spec.granularity == "mx" else spec.block_size, fmt, spec)
    return _blocked(xf, spec.block_size, fmt, spec.pow2_scale)


def _tensor_amax(xf: torch.Tensor, amax_group) -> torch.Tensor:
    """max |x| over the whole tensor, and over the TP group's shards of it."""
    return _group_max(_amax(xf), amax_group)


def _group_max(amax: torch.Tensor, amax_group) -> torch.Tensor:
    """The elementwise max of `amax` over the group's ranks (their shards of the same
    tensor, or of the same rows)."""
    if amax_group is not None and torch.distributed.get_world_size(amax_group) > 1:
        amax = torch.nan_to_num(amax, nan=math.inf)  # MAX propagates Inf on every rank
        torch.distributed.all_reduce(amax, op=torch.distributed.ReduceOp.MAX, group=amax_group)
    return amax


def _amax(x: torch.Tensor, dim: int | tuple[int, ...] = ()) -> torch.Tensor:
    """max |x| over `dim` (all if empty; kept), NaN if any is NaN. The larger of max and
    -min: one or two reductions cost less than a |x| copy (torch.aminmax is the fastest over
    a whole tensor and the slowest over a dim)."""
    if not dim:
        if x.numel() == 0:  # an expert that received no tokens: scale 1 (and join the MAX)
            return x.new_zeros(())
        low, high = torch.aminmax(x)
        return torch.maximum(high, low.neg_())
    return torch.maximum(x.amax(dim=dim, keepdim=True), x.amin(dim=dim, keepdim=True).neg_())


def _finite(amax: torch.Tensor) -> bool:
    return bool(torch.isfinite(amax).all())


def _scale(amax: torch.Tensor, fmt: Format, pow2: bool) -> torch.Tensor:
    # A tensor / tensor division: `python_float / tensor` is computed by torch as
    # reciprocal(tensor) * float, which rounds twice.
    scale = torch.where(amax > 0, torch.full_like(amax, fmt.max_value) / amax,
                        torch.ones_like(amax))
    if pow2:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    return scale


def _scaled_round(x: torch.Tensor, amax: torch.Tensor, fmt: Format, pow2: bool):
    return _round_with(x, _scale(amax, fmt, pow2), fmt)


def _round_with(x: torch.Tensor, scale: torch.Tensor, fmt: Format) -> torch.Tensor:
    # Dequantize by multiplying with the float32 reciprocal, as TE does with `scale_inv`
    # (and so the result does not depend on how torch vectorises a broadcast division).
    return round_to_format_(x * scale, fmt, saturate=True).mul_(torch.reciprocal(scale))


def _pad(matrix: torch.Tensor, right: int, bottom: int = 0) -> torch.Tensor:
    return F.pad(matrix, (0, right, 0, bottom)) if right or bottom else matrix


def _tiled(x: torch.Tensor, size: int, fmt: Format, spec: QuantSpec):
    rows = x.reshape(-1, x.shape[-1])
    k = rows.shape[-1]
    tiles = _pad(rows, (-k) % size).reshape(rows.shape[0], -1, size)
    amax = _amax(tiles, dim=-1)
    if not _finite(amax):
        return None
    if spec.granularity == "mx":
        shared = torch.floor(torch.log2(torch.where(amax > 0, amax, 1.0)))
        out = _round_with(tiles, torch.exp2(math.floor(math.log2(fmt.max_value)) - shared), fmt)
    else:
        out = _scaled_round(tiles, amax, fmt, spec.pow2_scale)
    return out.reshape(rows.shape[0], -1)[:, :k].reshape(x.shape)


def _blocked(x: torch.Tensor, size: int, fmt: Format, pow2: bool):
    matrix = x.reshape(-1, x.shape[-1])
    m, k = matrix.shape
    padded = _pad(matrix, (-k) % size, (-m) % size)
    pm, pk = padded.shape
    blocks = padded.reshape(pm // size, size, pk // size, size)
    amax = _amax(blocks, dim=(1, 3))
    if not _finite(amax):
        return None
    out = _scaled_round(blocks, amax, fmt, pow2).reshape(pm, pk)[:m, :k]
    return out.reshape(x.shape)
