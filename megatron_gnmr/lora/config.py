"""The lora section of a run's config (`--lora`, `--lora-dim`, ...), in Megatron-Bridge's
PEFT vocabulary (`LoRA(target_modules, dim, alpha, dropout, dropout_position)`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_gnmr.limits import check_limits, limit


@dataclass
class LoRAConfig:
    enabled: bool = False
    """LoRA: freeze every base parameter and train low-rank adapters on --lora-target-modules
    (usually with --finetune --load BASE_RUN). --gnmr: the adapted linears are the units,
    scored on their adapters' gradients."""
    target_modules: list[str] = field(default_factory=list, metadata={"metavar": "MODULE"})
    """LoRA: unit linears by name (linear_fc1, linear_proj, ...) or globs over the module
    path (`*.layers.0.*.linear_fc1`, global layer numbers); none given: every unit linear of
    the model family (llama: its qkv, proj, fc1, fc2)."""
    dim: int = limit(32, ge=1)
    """LoRA: the adapters' rank r."""
    alpha: float = limit(32.0, gt=0)
    """LoRA: the update is scaled by alpha / dim."""
    dropout: float = limit(0.0, ge=0, lt=1)
    """LoRA: dropout on the adapter's path."""
    dropout_position: str = limit("pre", choices=("pre", "post"))
    """LoRA: dropout on the adapter's input (pre) or output (post)."""

    def __post_init__(self) -> None:
        check_limits(self, "lora")
