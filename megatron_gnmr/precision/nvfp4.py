"""NVFP4 as fake quantization: FP4 E2M1 values in 16-element blocks with FP8 E4M3 block
scales and an FP32 per-tensor scale, stochastic rounding, and the random Hadamard transform.

Two-level scaling (NVIDIA's NVFP4 pretraining recipe; TE's `NVFP4BlockScaling`): with the
tensor's amax A, the FP32 encode scale is s = (6 * 448) / A (E2M1's max times E4M3's), so
that every block's decode scale, amax_block / 6, times s lands in E4M3's range; each block
stores that product rounded to E4M3 (d), and its values are rounded to E2M1 after
multiplying by s / d. Dequantized: q * d / s. Activations and gradients use 1x16 blocks along
the GEMM's reduction dimension; weights 16x16 blocks, so that W and W^T quantize the same.

Stochastic rounding (gradients): each value goes to one of its two neighbours on the E2M1
grid with probability proportional to closeness, so the expected rounded value is the value.

The random Hadamard transform (the weight-gradient GEMM's inputs): dW = G^T X sums over
tokens; multiplying both operands, 16 tokens at a time, by the same orthogonal matrix
H = Hadamard_16 diag(signs) / 4 leaves G^T X unchanged (H^T H = I) but spreads each block's
outliers over its 16 tokens before the 1x16 quantization along tokens.
"""

from __future__ import annotations

import functools
import math

import torch

from megatron_gnmr.precision.formats import E2M1, E4M3, FloatFormat, round_to_format_

BLOCK = 16
E2M1_MAX, E4M3_MAX = E2M1.max_value, E4M3.max_value  # 6, 448


FLOAT32_MAX = torch.finfo(torch.float32).max


def quantize_nvfp4(x: torch.Tensor, two_d: bool = False, stochastic: bool = False,
                   generator: torch.Generator | None = None,
                   tensor_amax: torch.Tensor | None = None,
                   draws: torch.Tensor | None = None) -> torch.Tensor:
    """Fake-quantize a [..., K] tensor (float32 result): 1x16 blocks along the last
    dimension, or 16x16 blocks of the [rows, K] matrix with `two_d`. `tensor_amax`: the
    per-tensor amax when x is a shard (reduced over the TP group by the caller). `draws`:
    the stochastic rounding's random integers (`nvfp4_draws`), drawn by a caller that
    compiles this function (a compiled draw is not the eager generator's); None: drawn
    here from `generator`."""
    matrix = x.float().reshape(-1, x.shape[-1])
    rows, cols = matrix.shape
    if matrix.numel() == 0:
        return matrix.reshape(x.shape)
    pad_rows = (-rows) % BLOCK if two_d else 0
    padded = torch.nn.functional.pad(matrix, (0, (-cols) % BLOCK, 0, pad_rows))
    pr, pc = padded.shape
    if two_d:
        blocks = padded.reshape(pr // BLOCK, BLOCK, pc // BLOCK, BLOCK)
        block_amax = blocks.abs().amax(dim=(1, 3), keepdim=True)
    else:
        blocks = padded.reshape(pr, pc // BLOCK, BLOCK)
        block_amax = blocks.abs().amax(dim=-1, keepdim=True)
    if tensor_amax is None:
        tensor_amax = matrix.abs().amax()
    # Transformer Engine's global encode scale: clamped to the float32 maximum (an amax below
    # ~8e-36 would overflow it to infinity and zero the tensor), 1 for an all-zero tensor.
    encode = torch.clamp((E2M1_MAX * E4M3_MAX) / tensor_amax, max=FLOAT32_MAX)
    encode = torch.where((tensor_amax > 0) & (encode > 0), encode, torch.ones_like(encode))
    block_scale = round_to_format_(block_amax / E2M1_MAX * encode, E4M3, saturate=True)
    safe = torch.where(block_scale > 0, block_scale, torch.ones_like(block_scale))
    # the per-block encode factor, clamped as TE clamps it (a huge global scale over a small
    # block scale overflows)
    scaled = blocks * torch.clamp(encode / safe, max=FLOAT32_MAX)
    if stochastic:
        rounded = stochastic_round(scaled, E2M1, generator, draws)
    else:
        rounded = round_to_format_(scaled, E2M1, saturate=True)
    out = torch.where(block_scale > 0, rounded * (safe / encode), torch.zeros_like(rounded))
    return out.reshape(pr, pc)[:rows, :cols].reshape(x.shape)


def nvfp4_draws(shape: torch.Size, two_d: bool, generator: torch.Generator | None = None,
                device=None) -> torch.Tensor:
    """The random integers `quantize_nvfp4` draws for a tensor of `shape` (its padded blocks'
    shape), drawn as it draws them: the same generator state gives the same integers."""
    cols = shape[-1]
    rows = math.prod(shape[:-1])
    padded_rows, padded_cols = rows + ((-rows) % BLOCK if two_d else 0), cols + (-cols) % BLOCK
    blocks = (padded_rows // BLOCK, BLOCK, padded_cols // BLOCK, BLOCK) if two_d else \
        (padded_rows, padded_cols // BLOCK, BLOCK)
    return _draw(blocks, E2M1, generator, device)


def _draw(shape, fmt: FloatFormat, generator, device) -> torch.Tensor:
    return torch.randint(0, 2 ** (23 - fmt.mantissa_bits), shape, generator=generator,
                         dtype=torch.int32, device=device)


def stochastic_round(x: torch.Tensor, fmt: FloatFormat,
                     generator: torch.Generator | None = None,
                     draws: torch.Tensor | None = None) -> torch.Tensor:
    """Round to a neighbour on `fmt`'s grid with probability 1 - distance / quantum
    (unbiased below the format's max; beyond it, saturate).

    On the float32 bit pattern: among the normal numbers of `fmt`, the 23 - m low mantissa
    bits of |x| are its distance above the lower neighbour in units of 2^-(23 - m) quanta, so
    adding a uniform random integer below 2^(23 - m) carries into the kept bits with exactly
    that probability, and clearing the low bits truncates (a carry out of the mantissa lands
    on the next binade's first value, the upper neighbour). Below `fmt`'s smallest normal N
    the quantum is that of [N, 2N), so |x| + N is rounded there and N taken off again (exact;
    only |x|'s bits under float32's quantum at N, 2^-23 N, are lost to the shift)."""
    magnitude = x.float().abs().clamp_(max=fmt.max_value)
    dropped = 23 - fmt.mantissa_bits
    draw = draws if draws is not None else \
        _draw(magnitude.shape, fmt, generator, magnitude.device)
    shift = (magnitude < 2.0 ** fmt.min_exponent).float().mul_(2.0 ** fmt.min_exponent)
    bits = magnitude.add_(shift).view(torch.int32).add_(draw).bitwise_and_(~(2 ** dropped - 1))
    rounded = bits.view(torch.float32).sub_(shift).clamp_(max=fmt.max_value)
    return torch.copysign(rounded, x.float())


@functools.lru_cache(maxsize=8)
def cached_hadamard(signs: tuple[float, ...], device: torch.device) -> torch.Tensor:
    """`hadamard_matrix` of fixed signs on `device`, built once (every unit's backward asks)."""
    return hadamard_matrix(torch.tensor(signs)).to(device)


def hadamard_matrix(signs: torch.Tensor) -> torch.Tensor:
    """H = Hadamard_n diag(signs) / sqrt(n), n = len(signs) a power of two: orthogonal."""
    n = signs.numel()
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h * signs.float() / n ** 0.5


def random_signs(seed: int = 0, n: int = BLOCK) -> torch.Tensor:
    """The transform's fixed random sign vector (one per run, like TE's)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 2, (n,), generator=generator).float() * 2 - 1


def transform_tokens(x: torch.Tensor, matrix: torch.Tensor) -> torch.Tensor:
    """[tokens, features] -> H applied to each run of 16 tokens (tokens zero-padded to a
    multiple of 16; the padding changes no weight gradient: its rows are zero before H and
    H's columns are orthonormal)."""
    tokens, features = x.shape
    padded = torch.nn.functional.pad(x.float(), (0, 0, 0, (-tokens) % BLOCK))
    chunks = padded.reshape(-1, BLOCK, features)
    return torch.matmul(matrix.to(x.device), chunks).reshape(-1, features)
