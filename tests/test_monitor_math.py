"""Monitor math against explicit float64 references."""

import itertools
import math

import numpy as np
import pytest
import torch

from megatron_gnmr.model_families.llama import split_qkv
from megatron_gnmr.monitors.router_stats import bias_spread, conditioning_ratio, gate_entropy, \
    routing_entropy, weight_similarity
from megatron_gnmr.monitors.spectra import d2_singular_values, d3_singular_values, \
    spectral_entropy


@pytest.mark.parametrize("d_model,d_head,scale", [(64, 8, 1e-2), (96, 16, 1e-4), (40, 20, 1.0),
                                                  (128, 32, 1e-3)])
def test_qr_core_spectrum_equals_the_formed_d2(d_model, d_head, scale):
    generator = torch.Generator().manual_seed(d_model + d_head)
    a, b = (torch.randn(d_model, d_head, generator=generator, dtype=torch.float64)
            for _ in range(2))
    da, db = (scale * torch.randn(d_model, d_head, generator=generator, dtype=torch.float64)
              for _ in range(2))
    d2 = da @ b.T + a @ db.T
    explicit = torch.linalg.svdvals(d2)[: 2 * d_head]
    core = torch.sort(d2_singular_values(a, b, da, db), descending=True).values
    np.testing.assert_allclose(core.numpy(), explicit.numpy(), rtol=1e-8,
                               atol=1e-12 * float(explicit[0]))
    d3 = torch.linalg.svdvals(da @ db.T)[:d_head]
    np.testing.assert_allclose(torch.sort(d3_singular_values(da, db), descending=True)
                               .values.numpy(), d3.numpy(), rtol=1e-8,
                               atol=1e-12 * float(d3[0]))


def test_spectral_entropy_against_the_definition():
    s = torch.tensor([3.0, 2.0, 1.0, 0.0])
    p = np.array([9.0, 4.0, 1.0]) / 14
    entropy = -(p * np.log(p)).sum()
    result = spectral_entropy(s)
    assert result["entropy"] == pytest.approx(entropy, rel=1e-12)
    assert result["normalized"] == pytest.approx(entropy / math.log(4), rel=1e-12)
    assert result["effective_rank"] == pytest.approx(math.exp(entropy), rel=1e-12)
    assert spectral_entropy(torch.ones(5))["normalized"] == pytest.approx(1.0)


@pytest.mark.parametrize("groups,heads_per_group", [(4, 1), (2, 2), (1, 4)],
                         ids=["mha", "gqa2", "mqa"])
def test_fused_qkv_layout_with_gqa_pairing(groups, heads_per_group):
    """Build the fused weight the way megatron interleaves it, from known per-head blocks."""
    d_head, d_model = 4, 16
    q = torch.randn(groups, heads_per_group, d_head, d_model)
    k = torch.randn(groups, d_head, d_model)
    v = torch.randn(groups, d_head, d_model)
    fused = torch.cat([torch.cat([q[g].reshape(-1, d_model), k[g], v[g]]) for g in range(groups)])
    queries, keys, group_of_head = split_qkv(fused, heads_per_group, d_head)
    for g, h in itertools.product(range(groups), range(heads_per_group)):
        head = g * heads_per_group + h
        assert torch.equal(queries[head], q[g, h].T)
        assert group_of_head[head] == g
    for g in range(groups):
        assert torch.equal(keys[g], k[g].T)


def test_router_statistics_against_brute_force():
    generator = torch.Generator().manual_seed(0)
    w = torch.randn(8, 32, generator=generator, dtype=torch.float64) + 0.5
    unit = w / w.norm(dim=1, keepdim=True)
    cosines = [float(unit[i] @ unit[j]) for i in range(8) for j in range(8) if i != j]
    assert weight_similarity(w) == pytest.approx(np.mean(cosines), rel=1e-12)
    mean_row = w.mean(dim=0)
    expected = max(float((w[i] - mean_row).norm()) for i in range(8)) / float(mean_row.norm())
    assert conditioning_ratio(w) == pytest.approx(expected, rel=1e-12)

    logits = torch.randn(100, 8, generator=generator) * 3
    probabilities = torch.softmax(logits.double(), dim=-1).numpy()
    reference = -(probabilities * np.log(probabilities)).sum(axis=1) / np.log(8)
    np.testing.assert_allclose(routing_entropy(logits).numpy(), reference, rtol=1e-5)


def test_deepseek_router_statistics_against_hand_computed_values():
    """Sigmoid scores normalised over all experts; the gates over the chosen experts."""
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [2.0, -1.0, 0.5, 3.0]])
    scores = 1 / (1 + np.exp(-logits.double().numpy()))
    p = scores / scores.sum(axis=1, keepdims=True)
    reference = -(p * np.log(p)).sum(axis=1) / np.log(4)
    np.testing.assert_allclose(routing_entropy(logits, "sigmoid").numpy(), reference, rtol=1e-6)
    assert routing_entropy(logits, "sigmoid")[0] == pytest.approx(1.0)  # uniform scores

    # token 0: gates 0.5 / 0.5 -> entropy log 2 / log 2 = 1; token 1: 0.9 / 0.1
    probs = torch.tensor([[0.5, 0.0, 0.5, 0.0], [0.0, 0.9, 0.0, 0.1]])
    routing_map = probs > 0
    expected = [1.0, -(0.9 * math.log(0.9) + 0.1 * math.log(0.1)) / math.log(2)]
    np.testing.assert_allclose(gate_entropy(probs, routing_map).numpy(), expected, rtol=1e-6)
    # DeepSeek's gates carry a scaling factor: the entropy is of the normalised gates
    np.testing.assert_allclose(gate_entropy(2.5 * probs, routing_map).numpy(), expected,
                               rtol=1e-6)
    assert bias_spread(torch.tensor([0.01, -0.02, 0.005])) == pytest.approx(0.03)
