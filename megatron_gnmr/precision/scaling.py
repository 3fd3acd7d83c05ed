"""Scaled quantization: choose a scale per tensor / row / tile / block, round, unscale.

Granularities (the last dimension is the GEMM's reduction dimension K):

| granularity | one scale per | used by |
|---|---|---|
| `tensor` | whole tensor (amax reduced over the TP group) | TE current scaling |
| `row` | row of the [-1, K] view | per-token / per-channel |
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

from megatron_gnmr.precision.formats import Format, get_format, round_to_format

GRANULARITIES = ("tensor", "row", "tile", "block", "mx")


@dataclass(frozen=True)
class QuantSpec:
    format: str
    granularity: str = "tensor"
    pow2_scale: bool = False
    block_size: int = 128  # tile and block edge; MX always uses 32

    def __post_init__(self):
        get_format(self.format)
        if self.granularity not in GRANULARITIES:
            raise ValueError(f"granularity must be one of {GRANULARITIES}, got "
                             f"{self.granularity!r}")


def quantize(x: torch.Tensor, spec: QuantSpec, amax_group=None) -> torch.Tensor:
    """Fake-quantize x (returned in x's dtype). `amax_group`: reduce a per-tensor amax over
    this process group (TP), so that a sharded tensor is scaled like the whole one."""
    fmt = get_format(spec.format)
    finite = torch.isfinite(x)
    xf = torch.where(finite, x, 0).float()
    if spec.granularity == "tensor":
        amax = xf.abs().amax()
        if amax_group is not None and torch.distributed.get_world_size(amax_group) > 1:
            torch.distributed.all_reduce(amax, op=torch.distributed.ReduceOp.MAX,
                                         group=amax_group)
        result = _scaled_round(xf, amax, fmt, spec.pow2_scale)
    elif spec.granularity == "row":
        rows = xf.reshape(-1, xf.shape[-1])
        amax = rows.abs().amax(dim=-1, keepdim=True)
        result = _scaled_round(rows, amax, fmt, spec.pow2_scale).reshape(xf.shape)
    elif spec.granularity in ("tile", "mx"):
        size = 32 if spec.granularity == "mx" else spec.block_size
        result = _tiled(xf, size, fmt, spec)
    else:
        result = _blocked(xf, spec.block_size, fmt, spec.pow2_scale)
    return torch.where(finite, result, x).to(x.dtype)


def _scale(amax: torch.Tensor, fmt: Format, pow2: bool) -> torch.Tensor:
    # A tensor / tensor division: `python_float / tensor` is computed by torch as
    # reciprocal(tensor) * float, which rounds twice.
    scale = torch.where(amax > 0, torch.full_like(amax, fmt.max_value) / amax,
                        torch.ones_like(amax))
    if pow2:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    return scale


def _scaled_round(x: torch.Tensor, amax: torch.Tensor, fmt: Format, pow2: bool):
    scale = _scale(amax, fmt, pow2)
    # Dequantize by multiplying with the float32 reciprocal, as TE does with `scale_inv`
    # (and so the result does not depend on how torch vectorises a broadcast division).
    return round_to_format(x * scale, fmt, saturate=True) * torch.reciprocal(scale)


def _tiled(x: torch.Tensor, size: int, fmt: Format, spec: QuantSpec) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    k = rows.shape[-1]
    padded = F.pad(rows, (0, (-k) % size))
    tiles = padded.reshape(rows.shape[0], -1, size)
    amax = tiles.abs().amax(dim=-1, keepdim=True)
    if spec.granularity == "mx":
        shared = torch.floor(torch.log2(torch.where(amax > 0, amax, 1.0)))
        scale = torch.exp2(math.floor(math.log2(fmt.max_value)) - shared)
        out = round_to_format(tiles * scale, fmt, saturate=True) * torch.reciprocal(scale)
    else:
        out = _scaled_round(tiles, amax, fmt, spec.pow2_scale)
    return out.reshape(rows.shape[0], -1)[:, :k].reshape(x.shape)


def _blocked(x: torch.Tensor, size: int, fmt: Format, pow2: bool) -> torch.Tensor:
    matrix = x.reshape(-1, x.shape[-1])
    m, k = matrix.shape
    padded = F.pad(matrix, (0, (-k) % size, 0, (-m) % size))
    pm, pk = padded.shape
    blocks = padded.reshape(pm // size, size, pk // size, size)
    amax = blocks.abs().amax(dim=(1, 3), keepdim=True)
    out = _scaled_round(blocks, amax, fmt, pow2).reshape(pm, pk)[:m, :k]
    return out.reshape(x.shape)
