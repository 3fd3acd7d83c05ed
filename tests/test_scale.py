"""The controller at cluster scale, simulated: up to 512 ranks on torch's fake process group.

For each TP x PP x DP topology, every rank of one model-parallel group builds its real
model shard (megatron's own parallel state on a `FakeStore`), its unit registry and its
GradStats. The statistics are correct for a layout iff, summed over the ranks of the
all-reduce group, each vector slot covers exactly the parameters of the single-process model
(every element once: TP shards partition it, TP duplicates count once, other stages add
nothing). Parameter counts stand in for squared norms: both add over a disjoint partition.
"""

import numpy as np
import pytest
import torch
from torch.testing._internal.distributed.fake_pg import FakeStore

from megatron_gnmr.arguments import parse_config
from megatron_gnmr.controller import GNMRConfig, GNMRPolicy
from megatron_gnmr.controller.grad_stats import GradStats
from megatron_gnmr.controller.units import UnitShape, build_registry, canonical_unit_names
from megatron_gnmr.platform import apply_cpu_patches

LAYERS = 16
MODEL = ["--num-layers", str(LAYERS), "--hidden-size", "64", "--num-attention-heads", "8",
         "--num-query-groups", "8", "--ffn-hidden-size", "128"]


def _slot_coverage(world: int, rank: int, tp: int, pp: int):
    from megatron.core import parallel_state
    from megatron_gnmr.model import build_gpt_model, transformer_config
    from megatron_gnmr.training.distributed import set_seeds

    torch.distributed.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        parallel_state.initialize_model_parallel(tp, pp, create_gloo_process_groups=False)
        config = parse_config([*MODEL, "--tensor-model-parallel-size", str(tp),
                               "--pipeline-model-parallel-size", str(pp)])
        set_seeds(1)
        model = build_gpt_model(config, transformer_config(config), vocab_size=256)
        registry = build_registry([model], UnitShape(LAYERS), config.gnmr.units)
        group = parallel_state.get_model_parallel_group()
        stats = GradStats(registry, [model], group)
        coverage = np.zeros(registry.num_units + 1)
        np.add.at(coverage, stats.slots.numpy(), [p.numel() for p in stats.params])
        return registry.names, coverage, torch.distributed.get_process_group_ranks(group)
    finally:
        parallel_state.destroy_model_parallel()
        torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def single_process_coverage():
    apply_cpu_patches()
    names, coverage, _ = _slot_coverage(1, 0, 1, 1)
    return names, coverage


@pytest.mark.parametrize("tp,pp,dp", [(1, 1, 512), (8, 8, 8), (4, 16, 8), (2, 4, 64),
                                      (8, 1, 64), (2, 2, 2)])
def test_statistics_layout_matches_one_process(single_process_coverage, tp, pp, dp):
    world = tp * pp * dp
    reference_names, reference = single_process_coverage
    names, _, group = _slot_coverage(world, world - 1, tp, pp)  # the last rank's group
    assert len(group) == tp * pp
    total = np.zeros_like(reference)
    for rank in group:
        rank_names, coverage, rank_group = _slot_coverage(world, rank, tp, pp)
        assert rank_names == reference_names  # the same global unit list on every rank
        assert rank_group == group  # every member reduces over the same group
        total += coverage
    np.testing.assert_array_equal(total, reference)


def test_unit_counts_of_real_models():
    names = canonical_unit_names(80)  # LLaMA-2 70B
    assert len(names) == 320 and len(set(names)) == 320
    assert names[:4] == ["layers.0.self_attention.linear_qkv", "layers.0.self_attention."
                         "linear_proj", "layers.0.mlp.linear_fc1", "layers.0.mlp.linear_fc2"]
    moe = canonical_unit_names(61, num_experts=256)  # DeepSeek-V3-like: 256 experts, 61 layers
    assert len(moe) == 61 * (2 + 256 * 2) and len(set(moe)) == len(moe)
    assert moe[2:4] == ["layers.0.mlp.experts.0.linear_fc1", "layers.0.mlp.experts.0.linear_fc2"]
    policy = GNMRPolicy(GNMRConfig(max_o=0.001), num_units=len(moe))
    rng = np.random.default_rng(0)
    for _ in range(20):
        decision = policy.step(rng.lognormal(size=len(moe)) * (1 + 50 * (rng.random() < 0.2)))
        assert len(decision.recovery) <= 31
