"""LoRA adapters on megatron's unit linears, in Megatron-Bridge's tensor-parallel layout.

    y = W x + (alpha / r) * B (A dropout(x))         A: [r, K]  B: [N, r]  (B = 0 at init)

Each adapter is megatron's own ColumnParallelLinear / RowParallelLinear pair, sharded as
Megatron-Bridge's `ParallelLinearAdapter`:

| base linear | A (`linear_in`) | B (`linear_out`) |
|---|---|---|
| column-parallel (e.g. fc1): x whole, y split along N | column-parallel along r, output gathered | column-parallel along N, output split like y |
| row-parallel (e.g. fc2): x split along K, y whole | row-parallel along K (partial sums all-reduced) | column-parallel along N, output gathered |

so an adapter's output has the shape and split of its base's output. The adapter is a child
module of the base linear (`...linear_fc1.adapter.linear_in.weight`, as Bridge names it) and
adds its output through a forward hook, so the base keeps its class, its precision path and
its unit name; the unit's trainable parameters are then exactly its adapter's, which is what
the controller's per-unit norms read. Adapters run megatron's own linear: high precision,
whatever the base's recipe. A and B are drawn on the CPU from the full matrices and split, so
every TP layout starts from the same adapters.
"""

from __future__ import annotations

import contextlib
import copy
import fnmatch

import torch
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

from megatron_gnmr.errors import UserError
from megatron_gnmr.lora.config import LoRAConfig


class LoRAAdapter(torch.nn.Module):
    def __init__(self, in_features: int, out_features: int, row_parallel: bool,
                 lora: LoRAConfig, tconfig):
        super().__init__()
        self.enabled = True
        # The adapter's linears see whole sequences (the base gathers them) and are always
        # initialised, whatever the base's settings.
        config = copy.copy(tconfig)
        config.sequence_parallel = False
        config.perform_initialization = True
        config.gradient_accumulation_fusion = False
        self.scale = lora.alpha / lora.dim
        self.dim = lora.dim
        self.dropout_position = lora.dropout_position
        self.dropout = torch.nn.Dropout(lora.dropout) if lora.dropout else torch.nn.Identity()
        if row_parallel:
            self.linear_in = RowParallelLinear(
                in_features, lora.dim, config=config, init_method=_xavier_normal,
                bias=False, input_is_parallel=True, skip_bias_add=True)
        else:
            self.linear_in = ColumnParallelLinear(
                in_features, lora.dim, config=config, init_method=_xavier_normal,
                bias=False, gather_output=True)
        self.linear_out = ColumnParallelLinear(
            lora.dim, out_features, config=config, init_method=torch.nn.init.zeros_,
            bias=False, gather_output=row_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.dropout_position == "pre":
            x = self.dropout(x)
        hidden, _ = self.linear_in(x)
        out, _ = self.linear_out(hidden)
        if self.dropout_position == "post":
            out = self.dropout(out)
        return out * self.scale


def _xavier_normal(weight: torch.Tensor) -> None:
    # Megatron-Bridge's default for A ("xavier"); on the full [r, K] matrix before the split.
    torch.nn.init.xavier_normal_(weight)


def _add_adapter_output(linear, args, output):
    """The base linear's forward hook: (y, bias) -> (y + adapter(x), bias)."""
    if not linear.adapter.enabled:
        return output
    y, bias = output
    return y + linear.adapter(args[0]).to(y.dtype), bias


@contextlib.contextmanager
def adapters_disabled(model_chunks):
    """The base model alone (evaluation: what the fine-tune changed)."""
    adapters = [m for chunk in model_chunks for m in chunk.modules() if isinstance(m, LoRAAdapter)]
    for adapter in adapters:
        adapter.enabled = False
    try:
        yield
    finally:
        for adapter in adapters:
            adapter.enabled = True


def is_target(unit_name: str, targets: list[str]) -> bool:
    """A unit (`layers.0.mlp.linear_fc1`) matches a bare module name (no dot, no wildcard) by
    its last component, a glob by its module path (`decoder.layers.0.mlp.linear_fc1`)."""
    path = f"decoder.{unit_name}"
    return any(unit_name.rsplit(".", 1)[-1] == target if _is_bare(target)
               else fnmatch.fnmatchcase(path, target) or fnmatch.fnmatchcase(unit_name, target)
               for target in targets)


def _is_bare(target: str) -> bool:
    return not any(character in target for character in ".*?[")


def lora_targets(config) -> list[str]:
    """The run's targets: --lora-target-modules, else every unit linear of the model."""
    from megatron_gnmr.model_families import unit_linear_names

    return list(config.lora.target_modules) or unit_linear_names(config)


def lora_units(config):
    """The predicate that keeps a LoRA run's units to its adapted linears (None: no LoRA)."""
    if not config.lora.enabled:
        return None
    targets = lora_targets(config)
    return lambda name: is_target(name, targets)


def check_targets(targets: list[str], unit_names: list[str]) -> None:
    linears = sorted({name.rsplit(".", 1)[-1] for name in unit_names
                      if not name.endswith(".core_attention")})
    for target in targets:
        if not any(is_target(name, [target]) for name in unit_names):
            raise UserError(f"--lora-target-modules {target!r} matches no linear (use "
                            f"{', '.join(linears)}, or a glob such as "
                            "'*.layers.0.*.linear_fc1')")


def attach_adapters(units: dict[str, torch.nn.Module], lora: LoRAConfig, targets: list[str],
                    tconfig) -> list[str]:
    """Add an adapter to every targeted unit linear of this rank (in canonical order, so the
    random draws do not depend on the layout); returns the adapted unit names."""
    adapted = []
    for name, linear in units.items():
        if not is_target(name, targets):
            continue
        row = isinstance(linear, RowParallelLinear)
        linear.adapter = LoRAAdapter(linear.input_size, linear.output_size, row, lora, tconfig)
        linear.register_forward_hook(_add_adapter_output)
        adapted.append(name)
    return adapted


def freeze_base(model: torch.nn.Module) -> None:
    """Only adapter parameters train; everything else (embeddings, norms, head, base
    linears) is frozen, so DDP and the optimizer never see it."""
    for name, param in model.named_parameters():
        param.requires_grad = ".adapter." in f".{name}"


def trainable_fraction(model: torch.nn.Module) -> float:
    total = sum(p.numel() for p in model.parameters())
    return sum(p.numel() for p in model.parameters() if p.requires_grad) / max(total, 1)


def check_dim(lora: LoRAConfig, tp: int) -> None:
    if lora.dim % tp:
        raise UserError(f"--lora-dim {lora.dim} must be divisible by "
                        f"--tensor-model-parallel-size {tp} (A of a column-parallel linear is "
                        "split along the rank, as in Megatron-Bridge)")


def check_rank(lora: LoRAConfig, config) -> None:
    """A rank-r update of a K x N weight has rank min(r, K, N): an r above that adds
    parameters and no expressiveness, and is a typo more often than a choice."""
    import dataclasses

    from megatron_gnmr.precision.gemm_shapes import unit_gemms

    whole = dataclasses.replace(config, parallel=dataclasses.replace(
        config.parallel, tensor_model_parallel_size=1))
    for gemm in unit_gemms(whole):
        if any(gemm.unit.endswith(target.rsplit(".", 1)[-1]) for target in lora_targets(config)) \
                and lora.dim > min(gemm.in_features, gemm.out_features):
            raise UserError(f"--lora-dim {lora.dim} exceeds the rank of {gemm.unit} "
                            f"({gemm.out_features} x {gemm.in_features}): use at most "
                            f"{min(gemm.in_features, gemm.out_features)}")
