"""What a model family is: the contract every family file fills in.

A family decides everything that depends on the shape of a decoder layer's attention (the MLP
and its experts are megatron's SwiGLU MLP in every family, `megatron_compat.MLP_LINEARS`):
which linears are units and in which order, how big their GEMMs are, which megatron spec and
config build the layer, how each unit linear is routed through a precision backend, what the
attention monitor reads as each head's query and key maps (LoRA adapts every unit linear by
default). Nothing outside `model_families/` builds on an attention linear's name (help texts
and the former `--gnmr-units` default in `controller/config.py` spell LLaMA's); a third family
is one file and one entry in `model_families/__init__.py` (docs/architecture.md shows one).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol

import torch

Route = Callable[[type], type]
"""A precision backend's routing: megatron's linear class -> its path-routed subclass."""


@dataclass(frozen=True)
class UnitLinear:
    """One attention linear that is a unit, with its GEMM shape over the whole model (before
    any tensor-parallel split)."""

    name: str
    """Its attribute in megatron's attention module (and the last part of its unit name)."""
    parallel: str
    """"column" (weight and output split along N over TP) or "row" (split along K)."""
    in_features: int
    """K: the GEMM's inner dimension."""
    out_features: int
    """N: its output width."""


@dataclass(frozen=True)
class QueryKeyMaps:
    """Each local head's query and key maps as SPEC 7.1 reads them (d_model x d_qk, the map
    from the residual stream to the head's query / key), and the rows of the stacked W_q, W_k
    this rank contributes to their spectra (every row on exactly one tensor-parallel rank, so
    the rows gathered over TP are the same in every layout)."""

    queries: torch.Tensor  # [local heads, d_model, d_qk]
    keys: torch.Tensor  # [local key heads, d_model, d_qk]
    group_of_head: torch.Tensor  # [local heads]: the key head each query head reads
    query_rows: torch.Tensor  # [rows, d_model]
    key_rows: torch.Tensor  # [rows, d_model]


class ModelFamily(Protocol):
    name: str
    """Its `--model-family` value."""

    hf: Any = None
    """The family's Hugging Face mapping, or None (export-hf and import-hf refuse the family
    by name). It says which transformers classes it reads and writes (`architectures`,
    `model_types`) and maps both ways, on full state dicts and config dicts: `to_hf`,
    `from_hf`, `hf_config`, `sections` (our config sections from Hugging Face's config),
    `unused_weights` (names in a checkpoint the classes do not use, left out on import),
    `expected_weights` (every tensor the classes hold for a config, its shape and the fields
    that make it, as pairs made lazily: import-hf checks the files against it,
    `checked_hf.py`),
    `exportable` (a UserError naming what the classes cannot express), and for the PEFT
    adapter `projections` (each unit linear's Hugging Face projections, in its weight's row
    order; None: no adapter export) and `unfuse_qkv` (`llama_hf.py` is the LLaMA family's,
    `deepseek_mla_hf.py` the DeepSeek family's)."""

    def attention_linears(self, config: Any) -> tuple[UnitLinear, ...]:
        """The attention linears that are units, in canonical order: the input projections,
        then the output projection (a switchable core attention sits between them)."""

    def head_widths(self, config: Any) -> tuple[int, int]:
        """Each head's (query/key, value) widths: what the core attention's QK^T and PV
        GEMMs contract over."""

    def check(self, config: Any) -> None:
        """Raise a UserError naming the flag for a model this family cannot build, or a
        family setting given to another family's run."""

    def transformer_config(self, config: Any) -> tuple[type, dict]:
        """megatron's TransformerConfig class for this family and the fields it adds."""

    def local_layer_spec(self, config: Any, num_experts: int | None) -> Any:
        """megatron's local (no Transformer Engine) layer spec of this family's model
        (`megatron_compat.local_layer_spec` with the family's keywords). A family whose
        local core attention megatron cannot compute says so with a true class attribute
        `needs_emulated_core_attention`: where megatron's own attention is asked for
        (--attention-backend local), the model builder then hands it the emulated flash
        attention (`precision/attention_unit.py`), else torch's SDPA as every family, so that
        no family imports precision."""

    def te_layer_spec(self, config: Any, num_experts: int | None) -> Any:
        """megatron's Transformer Engine layer spec of this family's model."""

    def route_attention_linears(self, spec: Any, route: Route) -> Any:
        """A copy of the spec whose attention unit linears are built from `route(cls)`."""

    def attention_linear_classes(self, spec: Any) -> dict[str, type]:
        """The classes a layer spec builds its attention unit linears from (present in the
        spec: MLA's query linears depend on --q-lora-rank)."""

    def attention_weights(self, attention: torch.nn.Module) -> dict[str, torch.Tensor]:
        """What the attention monitor snapshots: this rank's tensors that its query and key
        maps are made of (detached, float32 copies)."""

    def query_key_maps(self, weights: dict[str, torch.Tensor], attention: torch.nn.Module,
                       tp_group: Any) -> QueryKeyMaps:
        """The maps of `weights` (a snapshot or the live weights), float64. A collective
        over `tp_group` where the maps need other ranks' rows: every rank calls it."""

    def upgrade_snapshot(self, snapshot: Any) -> dict[str, torch.Tensor]:
        """A snapshot read from a checkpoint, in the form `attention_weights` gives today."""


def gather_rows(matrix: torch.Tensor, group: Any) -> torch.Tensor:
    """The rows every rank of `group` holds, stacked in rank order (ranks may hold different
    numbers of rows: MLA's shared RoPE key rows live on one rank)."""
    world = torch.distributed.get_world_size(group) if group is not None else 1
    if world == 1:
        return matrix
    counts = [torch.zeros(1, dtype=torch.int64, device=matrix.device) for _ in range(world)]
    torch.distributed.all_gather(
        counts, torch.tensor([matrix.shape[0]], dtype=torch.int64, device=matrix.device),
        group=group)
    counts = [int(count) for count in counts]
    padded = matrix.new_zeros(max(counts), *matrix.shape[1:])
    padded[:matrix.shape[0]] = matrix
    parts = [torch.empty_like(padded) for _ in range(world)]
    torch.distributed.all_gather(parts, padded, group=group)
    return torch.cat([part[:count] for part, count in zip(parts, counts)])
