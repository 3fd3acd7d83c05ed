"""MoE router monitor (SPEC 7.2): routing entropy, weight similarity, conditioning ratio and
expert load, per MoE layer; for DeepSeek-style routers also the entropy of the applied gates
and the spread of the balancing bias (`router_stats.py`).

The router's gating is wrapped so that, on an armed step, each forward's per-token entropy
of the FULL routing distribution (before top-k: softmax, or sigmoid scores normalised), the
entropy of the gates over the chosen experts and the tokens per expert (from the routing
map) are kept on the device; `measure` reads them once. Unarmed steps cost one flag check.
Token statistics are reduced over the data-parallel group (which holds the EP ranks too): the
mean entropy and the load are global; the low quantile is the mean of the ranks' quantiles.
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state

from megatron_gnmr.monitors.attention import gather_over_pipeline
from megatron_gnmr.platform.device import run_device
from megatron_gnmr.monitors.router_stats import (
    bias_spread,
    conditioning_ratio,
    gate_entropy,
    routing_entropy,
    weight_similarity,
)

LOW_QUANTILE = 0.05


def router_layers(model_chunks) -> dict[int, torch.nn.Module]:
    layers = {}
    for chunk in model_chunks:
        for module in chunk.modules():
            router = getattr(getattr(module, "mlp", None), "router", None)
            if router is not None and hasattr(module, "layer_number"):
                layers[module.layer_number - 1] = router
    return layers


class RouterMonitor:
    """Arms itself before each check step's forward; measures after it. Its instrumentation
    (a gating wrapper and a forward hook per router) is removed again by `detach`."""

    def __init__(self, model_chunks, config):
        self.interval = config.monitor_interval
        self.routers = router_layers(model_chunks)
        self.armed = False
        self.entropies: dict[int, list[torch.Tensor]] = {layer: [] for layer in self.routers}
        self.gate_entropies: dict[int, list[torch.Tensor]] = {layer: [] for layer in
                                                              self.routers}
        self.loads: dict[int, torch.Tensor] = {}
        self.handles = [self._instrument(layer, router) for layer, router in
                        self.routers.items()]

    def _instrument(self, layer: int, router):
        original_gating = router.gating
        score_function = router.config.moe_router_score_function

        def gating(*args, **kwargs):
            logits = original_gating(*args, **kwargs)
            if self.armed and router.training:
                self.entropies[layer].append(routing_entropy(logits.detach(), score_function))
            return logits

        router.gating = gating  # an instance attribute over the class's method

        def count_tokens(module, args, output):
            if self.armed and module.training:
                probs, routing_map = output[0].detach(), output[1]
                load = routing_map.sum(dim=0).double()
                self.loads[layer] = self.loads.get(layer, 0) + load
                if module.topk > 1:
                    self.gate_entropies[layer].append(gate_entropy(probs, routing_map))

        return router.register_forward_hook(count_tokens)

    def detach(self) -> None:
        """Undo the instrumentation: the routers run exactly megatron's code again."""
        for router, handle in zip(self.routers.values(), self.handles):
            del router.gating
            handle.remove()
        self.handles = []

    def before_step(self, step: int) -> None:
        if step % self.interval == 0:
            self.armed = True

    def after_step(self, step: int) -> None:
        pass

    def reads_weights(self, step: int) -> bool:
        """After `step`: a check (the router weights' similarity)."""
        return step % self.interval == 0

    @torch.no_grad()
    def measure(self) -> dict[int, dict[str, float]]:
        self.armed = False
        local = {}
        group = parallel_state.get_data_parallel_group()
        for layer, router in self.routers.items():
            values = {"weight_similarity": weight_similarity(router.weight.detach()),
                      "conditioning_ratio": conditioning_ratio(router.weight.detach())}
            if getattr(router, "expert_bias", None) is not None:
                values["expert_bias_spread"] = bias_spread(router.expert_bias)
            if self.entropies[layer]:
                entropy = torch.cat([e.reshape(-1) for e in self.entropies[layer]])
                gates = torch.cat([e.reshape(-1) for e in self.gate_entropies[layer]]) \
                    if self.gate_entropies[layer] else entropy.new_zeros(0)
                totals = torch.tensor([float(entropy.sum()), entropy.numel(),
                                       float(torch.quantile(entropy, LOW_QUANTILE)), 1.0,
                                       float(gates.sum()), gates.numel()],
                                      dtype=torch.float64, device=run_device())
                load = self.loads[layer].clone()
                torch.distributed.all_reduce(totals, group=group)
                torch.distributed.all_reduce(load, group=group)
                if totals[5] > 0:
                    values["gate_entropy_mean"] = float(totals[4] / totals[5])
                values.update({
                    "entropy_mean": float(totals[0] / totals[1]),
                    f"entropy_q{int(LOW_QUANTILE * 100):02d}": float(totals[2] / totals[3]),
                    "load_max_over_mean": float(load.max() / load.mean().clamp_min(1e-30)),
                    "load_min_over_mean": float(load.min() / load.mean().clamp_min(1e-30)),
                })
            local[layer] = values
            self.entropies[layer] = []
            self.gate_entropies[layer] = []
        self.loads = {}
        return gather_over_pipeline(local)

    def state_dict(self) -> dict:
        return {}  # a check's statistics are gathered within its step

    def load_state_dict(self, state: dict) -> None:
        pass
