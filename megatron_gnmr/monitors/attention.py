"""Attention update spectra (SPEC 7.1), per layer, from snapshots of the fused QKV weight.

Every check compares each layer's W_q, W_k with the snapshot taken `delta` steps earlier:
H(dW_q), H(dW_k) of the full increments, and H(D2) per head (mean and min over heads) through
the QR core, never a d_model x d_model matrix. Under TP each rank holds whole query groups
(`qkv_layout`), so heads and their GQA key heads are local: the per-head entropies are
reduced over the TP group (sum and count for the mean, MIN for the min), and the full dW_q /
dW_k are all-gathered over the TP group (check steps only) so every layout reports the
same values. Pipeline stages exchange their layers' values, so every rank holds all layers.
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state

from megatron_gnmr.platform.device import run_device
from megatron_gnmr.monitors.qkv_layout import query_and_key_matrices, split_qkv
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

    def __init__(self, model_chunks, config):
        self.layers = attention_layers(model_chunks)
        self.with_d3 = config.monitor_d3
        self.interval, self.delta = config.monitor_interval, config.monitor_delta
        self.snapshots: dict[int, torch.Tensor] = {}
        self.tp_group = parallel_state.get_tensor_model_parallel_group()

    def before_step(self, step: int) -> None:
        pass

    def after_step(self, step: int) -> None:
        if (step + self.delta) % self.interval == 0:
            self.snapshot()

    def reads_weights(self, step: int) -> bool:
        """After `step`: a snapshot or a check."""
        return (step + self.delta) % self.interval == 0 or step % self.interval == 0

    def _geometry(self, attention) -> tuple[int, int]:
        config = attention.config
        heads_per_group = config.num_attention_heads // config.num_query_groups
        return heads_per_group, config.kv_channels

    @torch.no_grad()
    def snapshot(self) -> None:
        self.snapshots = {layer: attention.linear_qkv.weight.detach().float().clone()
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
        heads_per_group, d_head = self._geometry(attention)
        old = self.snapshots[layer].double()
        delta = attention.linear_qkv.weight.detach().double() - old
        values = {}
        dq, dk = query_and_key_matrices(delta, heads_per_group, d_head)
        for name, matrix in (("dWq", dq), ("dWk", dk)):
            spectrum = spectral_entropy(singular_values(self._gather_rows(matrix)))
            values[f"H_{name}"] = spectrum["entropy"]
            values[f"H_{name}_normalized"] = spectrum["normalized"]
            values[f"effective_rank_{name}"] = spectrum["effective_rank"]
        queries, keys, group_of = split_qkv(old, heads_per_group, d_head)
        d_queries, d_keys, _ = split_qkv(delta, heads_per_group, d_head)
        d2 = [spectral_entropy(d2_singular_values(queries[h], keys[group_of[h]],
                                                  d_queries[h], d_keys[group_of[h]]))["entropy"]
              for h in range(queries.shape[0])]
        values.update(self._reduce_heads("H_D2", d2))
        if self.with_d3:
            d3 = [spectral_entropy(d3_singular_values(d_queries[h], d_keys[group_of[h]]))
                  ["entropy"] for h in range(queries.shape[0])]
            values.update(self._reduce_heads("H_D3", d3))
        return values

    def _gather_rows(self, matrix: torch.Tensor) -> torch.Tensor:
        world = torch.distributed.get_world_size(self.tp_group)
        if world == 1:
            return matrix
        parts = [torch.empty_like(matrix) for _ in range(world)]
        torch.distributed.all_gather(parts, matrix.contiguous(), group=self.tp_group)
        return torch.cat(parts)

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
        return {"snapshots": {k: v.clone() for k, v in self.snapshots.items()}}

    def load_state_dict(self, state: dict) -> None:
        # a checkpoint is read to the host; the snapshots meet the weights on the run's device
        self.snapshots = {int(k): v.to(run_device(), copy=True)
                          for k, v in state["snapshots"].items()}


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
