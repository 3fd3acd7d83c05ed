"""The precision section of a run's config (`--precision-recipe`, `--fp8-*`, ...).

Each recipe's knobs declare their allowed values here, beside their defaults (`limit`); which
recipe reads which knob is the recipe's entry in `precision/backends.py` (`options`: a knob
set for another recipe is refused by name), and checks across knobs are the recipe's own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron_gnmr.limits import check_limits, limit

FP8_FORMATS = ("hybrid", "e4m3")
INTEGER_BITS = (2, 3, 4, 8)
ATTENTION_PRECISIONS = ("exact", "fp8")


@dataclass
class PrecisionConfig:
    precision_recipe: Optional[str] = None
    """none | fp8-emulated | deepseek | nvfp4 | w8a8 | act-quant | fp8-torchao | te-fp8 | te: the
    low-cost and recovery path pair of every unit (precision/backends.py). Default: none, or
    te-fp8 with --fp8-format (Megatron-LM's meaning: FP8 through Transformer Engine), or te
    (Transformer Engine's layers, BF16) with --transformer-impl transformer_engine."""
    precision_static: str = limit("low", choices=("low", "recovery"))
    """Every unit on the `low` cost path or on the `recovery` path. With --gnmr the
    controller's choices come on top: on top of `recovery` they change nothing, which makes
    the high bound of a comparison whose arms all take the controller's optimizer path (its
    gradient clipping is not bitwise megatron's)."""
    fp8_format: Optional[str] = limit(None, choices=FP8_FORMATS)
    """hybrid (E4M3 forward, E5M2 gradients) or e4m3 (everywhere): the FP8 recipes' format
    (hybrid unless given). Without --precision-recipe it turns FP8 on through Transformer
    Engine, as in Megatron-LM (te-fp8)."""
    transformer_impl: str = limit("local", choices=("local", "transformer_engine"))
    """Megatron-LM's --transformer-impl: local (megatron-core's local layers, ours; our
    default) or transformer_engine (Transformer Engine's layers: --precision-recipe te, or
    te-fp8 with --fp8-format; Megatron-LM's default)."""
    fp8_recipe: str = "tensorwise"
    """Scaling: tensorwise (current), blockwise (1x128 / 128x128), mxfp8; delayed is refused."""
    deepseek_low_format: str = limit("e2m3", choices=("e2m3", "e3m2"))
    """The 6-bit format of the deepseek recipe's low-cost path: e2m3 or e3m2."""
    int_weight_bits: int = limit(8, choices=INTEGER_BITS)
    """w8a8: bits of the weights' symmetric integers, per output channel (8; 4 makes it a
    W4 stress)."""
    int_activation_bits: int = limit(8, choices=INTEGER_BITS)
    """w8a8: bits of the activations' symmetric integers, per token (8; 4 makes it A4)."""
    act_quant_bits: int = limit(4, choices=INTEGER_BITS)
    """act-quant: bits of the saved activation on the low-cost path (2, 3, 4, 8)."""
    act_quant_recovery_bits: int = limit(8, choices=(*INTEGER_BITS, 16))
    """act-quant: bits on the recovery path (8, or 16 for exact)."""
    act_quant_granularity: str = limit("tensor", choices=("tensor", "row", "tile"))
    """act-quant scale granularity: tensor, row, tile."""
    precision_config_file: Optional[str] = None
    """Megatron's --te-precision-config-file YAML: the units whose module it keeps in BF16
    run the recovery path in every step (precision/precision_config_file.py); write one with
    `megatron-gnmr calibrate`."""
    precision_recovery_gemms: str = "fprop,dgrad,wgrad"
    """Which GEMMs of a unit on the recovery path run it (comma list of fprop, dgrad, wgrad;
    the others stay on the low-cost path): `wgrad` buys a unit's weight-gradient GEMM alone,
    a third of its FLOPs; with `--precision-static recovery` it is Megatron's `--fp8-wgrad
    False` (emulated recipes)."""
    first_last_layers_bf16: bool = False
    """Megatron's --first-last-layers-bf16: the unit linears of the first and last layers run
    the recovery path in every step (how many: the two flags below)."""
    num_layers_at_start_in_bf16: int = limit(1, ge=0)
    """--first-last-layers-bf16: layers at the start kept high (Megatron's default 1)."""
    num_layers_at_end_in_bf16: int = limit(1, ge=0)
    """--first-last-layers-bf16: layers at the end kept high (Megatron's default 1)."""
    nvfp4_recovery: str = limit("bf16", choices=("bf16", "fp8"))
    """nvfp4: the recovery path, bf16 (exact here) or fp8 (fp8-emulated's E4M3/E5M2
    tensorwise path)."""
    nvfp4_2d_weights: bool = True
    """nvfp4: 16x16 weight blocks (W and W^T quantize the same); off: 1x16 like activations."""
    nvfp4_stochastic_rounding: bool = True
    """nvfp4: stochastic rounding of the gradients (both the dgrad and the wgrad operand)."""
    nvfp4_hadamard: bool = True
    """nvfp4: the 16-point random Hadamard transform on the weight-gradient GEMM's inputs."""
    attention_precision: str = limit("exact", choices=ATTENTION_PRECISIONS)
    """The core attention's low-cost path: exact, or fp8 (Q, K, V and P in E4M3, dO in E5M2,
    per-tensor current scaling, as FP8 attention holds them; emulated). With fp8 (or an
    attention fault) each layer's core attention is a unit whose recovery path is exact
    attention (precision/attention_unit.py)."""
    attention_fp8_output: bool = False
    """--attention-precision fp8: the backward also holds O in E4M3 inside delta = rowsum(dO *
    O), as Transformer Engine's FP8 attention saves it for its backward (an unbiased rounding;
    off: O as computed). A healthy low path then has a delta error of its own."""
    moe_dispatch_quant: bool = False
    """MoE (fp8-emulated, deepseek): quantize the tokens before the expert dispatch, as
    DeepSeek-V3 does (E4M3, 1x128 tiles, power-of-two scales; gradients go back unrounded,
    the combine stays in the run's precision). Every routed expert then sees these tokens,
    on either path; the router and the shared expert see the unquantized ones."""

    def __post_init__(self) -> None:
        check_limits(self, "precision")
        if self.precision_recipe is None:  # Megatron-LM's meaning of its two flags
            if self.fp8_format is not None:
                self.precision_recipe = "te-fp8"
            elif self.transformer_impl == "transformer_engine":
                self.precision_recipe = "te"
            else:
                self.precision_recipe = "none"
