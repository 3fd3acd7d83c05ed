"""Which units are measured must not change training: the global gradient norm, whose
clipping coefficient scales every gradient, is the same whatever the registry holds.

It once was not: the squared norms were summed in float32 slot by slot (a unit's slot, then
the rest), so the registry decided the order of the additions, the last bits of the clip
coefficient followed, and at FP8's learning-rate edge that decided whether a run lived
(docs/results.md section 14)."""

import pytest
import torch

from megatron_gnmr.controller.grad_stats import GradStats
from megatron_gnmr.controller.units import UnitRegistry


def _model_with_gradients(seed: int) -> torch.nn.ModuleList:
    generator = torch.Generator().manual_seed(seed)
    sizes = [(48, 64), (64, 176), (176, 64), (64, 64), (16, 64), (64, 4096 // 64), (5, 7)]
    model = torch.nn.ModuleList(torch.nn.Linear(i, o, bias=False) for i, o in sizes)
    for layer in model:  # gradients of very different sizes, as a model's layers have
        scale = 10.0 ** float(torch.empty(()).uniform_(-3, 3, generator=generator))
        layer.weight.grad = torch.randn(layer.weight.shape, generator=generator) * scale
    return model


def _clipped(seed: int, units: list[int]) -> tuple[float, list[torch.Tensor]]:
    model = _model_with_gradients(seed)
    registry = UnitRegistry([f"unit{u}" for u in units], dict(enumerate(model[u] for u in units)))
    stats = GradStats(registry, [model])
    total = stats.compute().total_norm
    stats.clip_(total, max_norm=1.0e-3)
    return total, [layer.weight.grad for layer in model]


def test_the_registry_does_not_move_the_global_norm_or_the_clipped_gradients(megatron_world):
    registries = [[], [0], [1, 4], [0, 1, 2, 3, 4, 5, 6], [6, 3]]
    for seed in range(20):
        model = _model_with_gradients(seed)
        exact = sum(layer.weight.grad.double().square().sum() for layer in model).sqrt()
        results = [_clipped(seed, units) for units in registries]
        for total, grads in results:
            assert total == pytest.approx(float(exact), rel=1e-6)  # float64 from the gradients
            assert total == results[0][0], (seed, [t for t, _ in results])
            for grad, first in zip(grads, results[0][1], strict=True):
                assert torch.equal(grad, first), seed
