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

from megatron_gnmr.platform.compilation import CompiledFunction
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

    Eager, the common case takes one max-abs pass for the scales and the rounding's few
    float32 passes. A non-finite value shows in its amax; only then is the input masked (so
    NaN/Inf neither enter the scale nor get rounded away) and quantized again. That check
    reads the amax on the host: a sync per call on a GPU, which the emulation accepts.

    Compiled (`quantizer_compile`; always inside a compiled layer), the same values without
    the branch: the input is always masked, which changes nothing where it is finite, and
    the mask's passes fuse into the amax and the rounding."""
    fmt = get_format(spec.format)
    if _compiles(x):
        return _quantize_compiled(x, spec, fmt, amax_group)
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
    amax = _reduced_amax(_local_amax(xf, spec), spec, amax_group)
    return _apply_scales(xf, amax, spec, fmt) if _finite(amax) else None


def _reduced_amax(amax: torch.Tensor, spec: QuantSpec, amax_group) -> torch.Tensor:
    """A shard's amaxes made the whole tensor's: per tensor (and NVFP4's tensor scale) and per
    row, the max over the TP group; tiles and blocks are whole on every rank."""
    if spec.granularity in ("tensor", "row") or spec.granularity.startswith("nvfp4"):
        return _group_max(amax, amax_group)
    return amax


def _local_amax(xf: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """max |x| over each of this rank's scaling regions (tensor, rows, tiles, blocks)."""
    if spec.granularity == "tensor" or spec.granularity.startswith("nvfp4"):
        return _amax(xf)
    if spec.granularity == "row":
        return _amax(xf.reshape(-1, xf.shape[-1]), dim=-1)
    if spec.granularity in ("tile", "mx"):
        return _amax(_tiles(xf, _tile_size(spec)), dim=-1)
    return _amax(_blocks(xf, spec.block_size), dim=(1, 3))


def _apply_scales(xf: torch.Tensor, amax: torch.Tensor, spec: QuantSpec, fmt: Format,
                  draws: torch.Tensor | None = None) -> torch.Tensor:
    """xf rounded with the scales of its regions' `amax` (finite). `draws`: NVFP4's
    stochastic rounding's random integers, drawn by the caller (`nvfp4_draws`); None: drawn
    here."""
    if spec.granularity == "tensor":
        return _scaled_round(xf, amax, fmt, spec.pow2_scale)
    if spec.granularity == "row":
        rows = xf.reshape(-1, xf.shape[-1])
        return _scaled_round(rows, amax, fmt, spec.pow2_scale).reshape(xf.shape)
    if spec.granularity.startswith("nvfp4"):
        from megatron_gnmr.precision.nvfp4 import quantize_nvfp4

        return quantize_nvfp4(xf, two_d=spec.granularity == "nvfp4-2d",
                              stochastic=spec.stochastic, tensor_amax=amax, draws=draws)
    if spec.granularity in ("tile", "mx"):
        return _tiled(xf, _tile_size(spec), fmt, spec, amax)
    return _blocked(xf, spec.block_size, fmt, spec.pow2_scale, amax)


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


def _tile_size(spec: QuantSpec) -> int:
    return 32 if spec.granularity == "mx" else spec.block_size


def _tiles(x: torch.Tensor, size: int) -> torch.Tensor:
    """[rows, tiles, size]: the rows of the [-1, K] view in 1 x size slices (K zero-padded)."""
    rows = x.reshape(-1, x.shape[-1])
    return _pad(rows, (-rows.shape[-1]) % size).reshape(rows.shape[0], -1, size)


def _blocks(x: torch.Tensor, size: int) -> torch.Tensor:
    """[row blocks, size, column blocks, size]: the [-1, K] view in size x size blocks
    (zero-padded)."""
    matrix = x.reshape(-1, x.shape[-1])
    m, k = matrix.shape
    padded = _pad(matrix, (-k) % size, (-m) % size)
    return padded.reshape(padded.shape[0] // size, size, padded.shape[1] // size, size)


def _tiled(x: torch.Tensor, size: int, fmt: Format, spec: QuantSpec, amax: torch.Tensor):
    tiles = _tiles(x, size)
    if spec.granularity == "mx":
        shared = torch.floor(torch.log2(torch.where(amax > 0, amax, 1.0)))
        out = _round_with(tiles, torch.exp2(math.floor(math.log2(fmt.max_value)) - shared), fmt)
    else:
        out = _scaled_round(tiles, amax, fmt, spec.pow2_scale)
    k = x.shape[-1]
    return out.reshape(tiles.shape[0], -1)[:, :k].reshape(x.shape)


def _blocked(x: torch.Tensor, size: int, fmt: Format, pow2: bool, amax: torch.Tensor):
    blocks = _blocks(x, size)
    m, k = x.numel() // x.shape[-1], x.shape[-1]
    out = _scaled_round(blocks, amax, fmt, pow2)
    return out.reshape(blocks.shape[0] * size, -1)[:m, :k].reshape(x.shape)


# -- the compiled path ------------------------------------------------------------------

QUANTIZER_COMPILE_MODES = ("auto", "on", "off")
AUTO_COMPILE_NUMEL = 1 << 16
"""`auto` compiles accelerator tensors of at least this many elements: below it a compiled
call's fixed cost (guards, the launch) is more than the kernel launches it saves."""

_compile_mode = "auto"


def set_quantizer_compile(mode: str) -> None:
    """`auto`: compile the quantizers of accelerator (CUDA) tensors of AUTO_COMPILE_NUMEL
    elements or more, where eager's separate kernels each cost a launch and a pass; CPU
    tensors stay eager: on the 2-core Xeon the compiled E4M3 quantizer was 1.00-1.15x eager
    from 2^16 to 2^22 elements and the emulated FP8 step 1.01x (scripts/bench_speed.py,
    docs/guide/precision.md), less than a run's compile time buys back. `on`: every tensor;
    `off`: eager (a compiled layer still traces the branch-free form)."""
    global _compile_mode
    if mode not in QUANTIZER_COMPILE_MODES:
        raise ValueError(f"quantizer compile mode must be one of {QUANTIZER_COMPILE_MODES}, "
                         f"got {mode!r}")
    _compile_mode = mode


def _compiles(x: torch.Tensor) -> bool:
    if torch.compiler.is_compiling():
        return True
    if _compile_mode == "off" or x.numel() == 0:
        return False
    return _compile_mode == "on" or (x.device.type != "cpu" and x.numel() >= AUTO_COMPILE_NUMEL)


def _masked(x: torch.Tensor):
    xf = x.float()
    finite = torch.isfinite(xf)
    return xf, finite, torch.where(finite, xf, 0)


def _masked_local_amax(x: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    return _local_amax(_masked(x)[2], spec)


def _masked_quantize(x: torch.Tensor, amax: torch.Tensor | None, spec: QuantSpec, fmt: Format,
                     draws: torch.Tensor | None) -> torch.Tensor:
    """The eager result without its branch: non-finite values masked out of the amax and
    the rounding and put back (where every value is finite, the mask changes nothing).
    `amax` None: this tensor's own (no TP reduction)."""
    xf, finite, masked = _masked(x)
    if amax is None:
        amax = _local_amax(masked, spec)
    return torch.where(finite, _apply_scales(masked, amax, spec, fmt, draws), xf).to(x.dtype)


_COMPILED_AMAX = CompiledFunction(_masked_local_amax, "the emulated quantizer's amax")
_COMPILED_QUANTIZE = CompiledFunction(_masked_quantize, "the emulated quantizer")


def _quantize_compiled(x: torch.Tensor, spec: QuantSpec, fmt: Format, amax_group):
    """`quantize`'s values from at most two compiled graphs per shape class: the amaxes, the
    TP reduction between them (eager: a collective), the rounding. NVFP4's stochastic
    rounding draws its random integers here, eagerly, as the eager path draws them."""
    if x.numel() == 0 and spec.granularity != "tensor":
        return x.float().to(x.dtype)
    amax = None
    if amax_group is not None and torch.distributed.get_world_size(amax_group) > 1 and \
            (spec.granularity in ("tensor", "row") or spec.granularity.startswith("nvfp4")):
        amax = _group_max(_COMPILED_AMAX(x, spec), amax_group)
    draws = None
    if spec.stochastic:
        from megatron_gnmr.precision.nvfp4 import nvfp4_draws

        draws = nvfp4_draws(x.shape, spec.granularity == "nvfp4-2d", device=x.device)
    return _COMPILED_QUANTIZE(x, amax, spec, fmt, draws)
