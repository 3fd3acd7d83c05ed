"""MoE router statistics (SPEC 7.2) on plain tensors.

- weight similarity s = (E * ||mean_i(w_i / ||w_i||)||^2 - 1) / (E - 1): the mean pairwise
  cosine similarity of the router rows over i != j, without the E x E matrix;
- conditioning ratio eps = max_i ||w_i - w_bar|| / ||w_bar||: small means the rows are
  nearly the same, a non-discriminative router;
- per-token entropy of the full routing distribution over the E experts (before top-k),
  normalised by log E: softmax(logits), or for a sigmoid router (DeepSeek-V3) the sigmoid
  scores normalised to sum to one;
- per-token entropy of the gates actually applied (the router's probabilities over the k
  chosen experts, normalised to sum to one), normalised by log k: how evenly a token's
  output is shared among its experts;
- the spread (max - min) of the auxiliary-loss-free balancing bias: it moves by a fixed
  step per update towards an even load, so a spread that keeps growing means balancing is
  losing to the router.
"""

from __future__ import annotations

import math

import torch


def weight_similarity(router_weight: torch.Tensor) -> float:
    w = router_weight.double()
    experts = w.shape[0]
    unit_rows = w / w.norm(dim=1, keepdim=True).clamp_min(1e-30)
    mean = unit_rows.mean(dim=0)
    return float((experts * mean.square().sum() - 1) / (experts - 1))


def conditioning_ratio(router_weight: torch.Tensor) -> float:
    w = router_weight.double()
    mean_row = w.mean(dim=0)
    return float((w - mean_row).norm(dim=1).max() / mean_row.norm().clamp_min(1e-30))


def routing_entropy(logits: torch.Tensor, score_function: str = "softmax") -> torch.Tensor:
    """Per-token entropy of the full routing distribution, normalised by log E (float32)."""
    logits = logits.float()
    if score_function == "sigmoid":
        scores = torch.sigmoid(logits)
        p = scores / scores.sum(dim=-1, keepdim=True)
        entropy = -(p * torch.log(p.clamp_min(1e-30))).sum(dim=-1)
    else:
        log_p = torch.log_softmax(logits, dim=-1)
        entropy = -(log_p.exp() * log_p).sum(dim=-1)
    return entropy / math.log(logits.shape[-1])


def gate_entropy(probs: torch.Tensor, routing_map: torch.Tensor) -> torch.Tensor:
    """Per-token entropy of the applied gates over the chosen experts, normalised by log k
    (`probs`: tokens x E, zero off the routing map; k the experts per token, > 1)."""
    gates = torch.where(routing_map, probs.float(), 0.0)
    gates = gates / gates.sum(dim=-1, keepdim=True).clamp_min(1e-30)
    entropy = -(gates * torch.log(gates.clamp_min(1e-30))).sum(dim=-1)
    return entropy / math.log(int(routing_map[0].sum()))


def bias_spread(expert_bias: torch.Tensor) -> float:
    return float(expert_bias.max() - expert_bias.min())
