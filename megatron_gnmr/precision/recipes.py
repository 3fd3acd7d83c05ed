"""Recipes: a low-cost path and a recovery path per unit (SPEC 6).

| recipe | low-cost | recovery |
|---|---|---|
| `fp8-emulated` | E4M3 forward operands, E5M2 gradients (`--fp8-format hybrid`; `e4m3`: E4M3 everywhere), per-tensor current scaling (`--fp8-recipe tensorwise`), 1x128/128x128 (`blockwise`) or MX (`mxfp8`) | exact (megatron's linear) |
| `deepseek` | FP6 (`--deepseek-low-format`, E2M3 default) with 1x128 activation/gradient tiles and 128x128 weight blocks, power-of-two scales | the same at FP8 E4M3 |
| `nvfp4` | FP4 E2M1 in 1x16 blocks (16x16 for weights) with E4M3 block scales and an FP32 tensor scale, stochastic rounding on gradients, random Hadamard transform on the wgrad inputs | BF16 (`--nvfp4-recovery`; or FP8 tensorwise) |
| `w8a8` | INT8 GEMM operands, symmetric: per-token activations, per-output-channel weights (LoRA's frozen base; the dgrad uses the INT8 weight, gradients unquantized) | exact (megatron's linear) |
| `act-quant` | saved activation at `--act-quant-bits` (INT4 default) for the weight-gradient GEMM | saved at `--act-quant-recovery-bits` (8; 16 = exact) |
| `te-fp8` | Transformer Engine FP8 (GPU) | BF16 under a disabled TE autocast |
| `fp8-torchao` | real FP8 GEMMs through torchao (`torch._scaled_mm`): tensorwise or rowwise (`--fp8-recipe`) | exact (megatron's linear) |

Embedding, output head, norms and the attention core are never units: they stay in the
run's precision.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_gnmr.errors import UserError
from megatron_gnmr.precision.paths import GemmPath
from megatron_gnmr.precision.scaling import QuantSpec
from megatron_gnmr.precision.te_backend import check_fp8_recipe

@dataclass(frozen=True)
class Recipe:
    name: str
    low: GemmPath
    recovery: GemmPath


EXACT = GemmPath("exact")


# --fp8-recipe -> (activation/gradient granularity, weight granularity)
FP8_GRANULARITY = {"tensorwise": ("tensor", "tensor"), "blockwise": ("tile", "block"),
                   "mxfp8": ("mx", "mx")}


def fp8_emulated(config) -> Recipe:
    check_fp8_recipe(config.fp8_recipe)
    act, weight = FP8_GRANULARITY[config.fp8_recipe]
    grad_format = "e5m2" if (config.fp8_format or "hybrid") == "hybrid" else "e4m3"
    pow2 = config.fp8_recipe == "blockwise"
    low = GemmPath("fp8", QuantSpec("e4m3", act, pow2), QuantSpec("e4m3", weight, pow2),
                   QuantSpec(grad_format, act, pow2))
    return Recipe("fp8-emulated", low, EXACT)


def deepseek(config) -> Recipe:
    def blockwise(fmt: str) -> GemmPath:
        return GemmPath(f"{fmt}-blockwise", QuantSpec(fmt, "tile", True),
                        QuantSpec(fmt, "block", True), QuantSpec(fmt, "tile", True))
    return Recipe("deepseek", blockwise(config.deepseek_low_format), blockwise("e4m3"))


def nvfp4(config) -> Recipe:
    """NVFP4 (precision/nvfp4.py): E2M1 in 16-element blocks with E4M3 block scales and an
    FP32 tensor scale; 16x16 weight blocks, stochastically rounded gradients and the random
    Hadamard transform on the weight-gradient GEMM's inputs, each switchable."""
    from megatron_gnmr.precision.nvfp4 import random_signs

    values = QuantSpec("e2m1", "nvfp4")
    grads = QuantSpec("e2m1", "nvfp4", stochastic=config.nvfp4_stochastic_rounding)
    weights = QuantSpec("e2m1", "nvfp4-2d" if config.nvfp4_2d_weights else "nvfp4")
    signs = tuple(random_signs().tolist()) if config.nvfp4_hadamard else None
    low = GemmPath("nvfp4", values, weights, grads, wgrad_input=values, wgrad_grad=grads,
                   hadamard_signs=signs)
    recovery = EXACT if config.nvfp4_recovery == "bf16" else GemmPath(
        "fp8", QuantSpec("e4m3", "tensor"), QuantSpec("e4m3", "tensor"),
        QuantSpec("e5m2", "tensor"))
    return Recipe("nvfp4", low, recovery)


def w8a8(config) -> Recipe:
    """SmoothQuant-style W8A8 without smoothing: one scale per token of x and one per output
    channel of W (rows of both in [-1, K]); the backward's dx = dy @ W_q reads the same INT8
    weight, and a trainable weight's dW = dy^T @ x_q. --int-weight-bits / --int-activation-bits
    narrow the integers (W4A4: a stress where 8 bits do no harm)."""
    weight, activation = f"int{config.int_weight_bits}", f"int{config.int_activation_bits}"
    name = f"w{config.int_weight_bits}a{config.int_activation_bits}"
    low = GemmPath(name, input=QuantSpec(activation, "row"), weight=QuantSpec(weight, "row"))
    return Recipe("w8a8", low, EXACT)


def act_quant(config) -> Recipe:
    def saved(bits: int) -> GemmPath:  # the bits' values: precision/config.py
        if bits == 16:
            return EXACT
        fmt = {8: "int8", 4: "int4"}.get(bits, f"int{bits}")
        return GemmPath(f"act-int{bits}",
                        saved_input=QuantSpec(fmt, config.act_quant_granularity))
    return Recipe("act-quant", saved(config.act_quant_bits),
                  saved(config.act_quant_recovery_bits))


def fp8_torchao(config) -> Recipe:
    """Real FP8 GEMMs through torchao: tensorwise (torchao's `tensorwise` recipe with
    --fp8-format hybrid) or rowwise (power-of-two scales; torchao's `rowwise` recipe with
    --fp8-format e4m3); recovery is megatron's own linear."""
    if config.fp8_recipe not in ("tensorwise", "rowwise"):
        raise UserError(f"--fp8-recipe {config.fp8_recipe!r} with --precision-recipe "
                        "fp8-torchao: use tensorwise or rowwise")
    granularity, pow2 = ("tensor", False) if config.fp8_recipe == "tensorwise" else ("row", True)
    grad_format = "e5m2" if (config.fp8_format or "hybrid") == "hybrid" else "e4m3"
    low = GemmPath(f"fp8-torchao-{config.fp8_recipe}", QuantSpec("e4m3", granularity, pow2),
                   QuantSpec("e4m3", granularity, pow2), QuantSpec(grad_format, granularity, pow2),
                   kernel="torchao")
    return Recipe("fp8-torchao", low, EXACT)
