"""MoE router statistics (SPEC 7.2) on plain tensors.

- weight similarity s = (E * ||mean_i(w_i / ||w_i||)||^2 - 1) / (E - 1): the mean pairwise
  cosine similarity of the router rows over i != j, without the E x E matrix;
- conditioning ratio eps = max_i ||w_i - w_bar|| / ||w_bar||: small means the rows are
  nearly the same, a non-discriminative router;
- per-token entropy of the full softmax over the E experts (before top-k), normalised by
  log E.
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


def routing_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Per-token entropy of softmax(logits) over experts, normalised by log E (float32)."""
    log_p = torch.log_softmax(logits.float(), dim=-1)
    entropy = -(log_p.exp() * log_p).sum(dim=-1)
    return entropy / math.log(logits.shape[-1])
