"""Attention update spectra (SPEC 7.1), per layer, from snapshots of the attention's weights.

Every check compares each layer's query and key maps with those of the snapshot taken
`delta` steps earlier: H(dW_q), H(dW_k) of the full increments, and H(D2) per head (mean and
min over heads) through the QR core, never a d_model x d_model matrix. What the maps are is
the model family's (`model_families/`: LLaMA's fused QKV rows, MLA's composed latent maps);
the increments are taken of the maps, so a map composed of two weights moves as the
composition does. Under TP each rank holds whole heads with the keys they read: the per-head
entropies are reduced over the TP group (sum and count for the mean, MIN for the min), and
the stacked W_q / W_k rows are all-gathered over the TP group (check steps only) so every
layout reports the same values. Pipeline stages exchange their layers' values, so every rank
holds all layers.
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state

from megatron_gnmr.model_families.base import gather_rows
from megatron_gnmr.platform.device import run_device
from megatron_gnmr.monitors.spectra import (
    d2_singular_values,
    d3_singular_values,
    singular_values,
    spectral_entropy,
)


def attention_layers(model_chunks) -> dict[int, torch.nn.Module]:
    """0-based global layer -> its SelfAttention module, for this rank's layers."""
    layers = {}
    for chunk in model_chunks:
        for module in chunk.modules():
            if hasattr(module, "self_attention") and hasattr(module, "layer_number"):
                layers[module.layer_number - 1] = module.self_attention
    return layers


class AttentionMonitor:
    """Snapshots W_q/W_k `--monitor-delta` steps before each check, measures at the check."""

    def __init__(self, model_chunks, config, model_family):
        self.family = model_family
        self.layers = attention_layers(model_chunks)
        self.with_d3 = config.monitor_d3
        self.interval, self.delta = config.monitor_interval, config.monitor_delta
        self.snapshots: dict[int, dict[str, torch.Tensor]] = {}
        self.tp_group = parallel_state.get_tensor_model_parallel_group()

    def before_step(self, step: int) -> None:
        pass

    def after_step(self, step: int) -> None:
        if (step + self.delta) % self.interval == 0:
            self.snapshot()

    def reads_weights(self, step: int) -> bool:
        """After `step`: a snapshot or a check."""
        return (step + self.delta) % self.interval == 0 or step % self.interval == 0

    @torch.no_grad()
    def snapshot(self) -> None:
        self.snapshots = {layer: self.family.attention_weights(attention)
                          for layer, attention in self.layers.items()}

    @property
    def has_snapshot(self) -> bool:
        return bool(self.snapshots) or not self.layers

    @torch.no_grad()
    def measure(self) -> dict[int, dict[str, float]] | None:
        """Every layer's values at a check step (None before the first snapshot)."""
        if not self.has_snapshot:
            return None
        local = {layer: self._measure_layer(layer, attention)
                 for layer, attention in self.layers.items()}
        return gather_over_pipeline(local)

    def _measure_layer(self, layer: int, attention) -> dict[str, float]:
        old = self.family.query_key_maps(self.snapshots[layer], attention, self.tp_group)
        new = self.family.query_key_maps(self.family.attention_weights(attention), attention,
                                         self.tp_group)
        values = {}
        for name, rows in (("dWq", new.query_rows - old.query_rows),
                           ("dWk", new.key_rows - old.key_rows)):
            spectrum = spectral_entropy(singular_values(gather_rows(rows, self.tp_group)))
            values[f"H_{name}"] = spectrum["entropy"]
            values[f"H_{name}_normalized"] = spectrum["normalized"]
            values[f"effective_rank_{name}"] = spectrum["effective_rank"]
        d_queries, d_keys = new.queries - old.queries, new.keys - old.keys
        group_of = old.group_of_head
        d2 = [spectral_entropy(d2_singular_values(old.queries[h], old.keys[group_of[h]],
                                                  d_queries[h], d_keys[group_of[h]]))["entropy"]
              for h in range(old.queries.shape[0])]
        values.update(self._reduce_heads("H_D2", d2))
        if self.with_d3:
            d3 = [spectral_entropy(d3_singular_values(d_queries[h], d_keys[group_of[h]]))
                  ["entropy"] for h in range(old.queries.shape[0])]
            values.update(self._reduce_heads("H_D3", d3))
        return values

    def _reduce_heads(self, name: str, entropies: list[float]) -> dict[str, float]:
        totals = torch.tensor([sum(entropies), len(entropies)], dtype=torch.float64,
                              device=run_device())
        minimum = torch.tensor([min(entropies)], dtype=torch.float64, device=run_device())
        if torch.distributed.get_world_size(self.tp_group) > 1:
            torch.distributed.all_reduce(totals, group=self.tp_group)
            torch.distributed.all_reduce(minimum, op=torch.distributed.ReduceOp.MIN,
                                         group=self.tp_group)
        return {f"{name}_mean": float(totals[0] / totals[1]), f"{name}_min": float(minimum[0])}

    def state_dict(self) -> dict:
        return {"snapshots": {layer: {name: tensor.clone() for name, tensor in weights.items()}
                              for layer, weights in self.snapshots.items()}}

    def load_state_dict(self, state: dict) -> None:
        # a checkpoint is read to the host; the snapshots meet the weights on the run's device
        self.snapshots = {
            int(layer): {name: tensor.to(run_device(), copy=True)
                         for name, tensor in self.family.upgrade_snapshot(weights).items()}
            for layer, weights in state["snapshots"].items()}


def gather_over_pipeline(local: dict) -> dict:
    group = parallel_state.get_pipeline_model_parallel_group()
    if torch.distributed.get_world_size(group) == 1:
        return local
    parts = [None] * torch.distributed.get_world_size(group)
    torch.distributed.all_gather_object(parts, local, group=group)
    merged = {}
    for part in parts:
        merged.update(part)
    return dict(sorted(merged.items()))
