"""The DeepSeek-style MoE pipeline across expert and tensor parallelism (2 processes): the
deepseek recipe on every expert, tokens quantized before the dispatch, GNMR choosing experts
with one global budget."""

import numpy as np
import pytest

from tests.helpers import TINY, read_jsonl, run_batch, trace_records, train_losses

STEPS = 12
# Per-shard dimensions are multiples of 128 at TP=2 (hidden 256, expert widths 256), so the
# recipe's 1x128 tiles and 128x128 blocks cover the same elements in every layout.
ALIGNED = [*TINY, "--hidden-size", "256", "--ffn-hidden-size", "256"]
DEEPSEEK_MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "256",
                "--moe-shared-expert-intermediate-size", "256",
                "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
                "--moe-router-load-balancing-type", "none", "--moe-aux-loss-coeff", "0",
                "--precision-recipe", "deepseek", "--moe-dispatch-quant"]
GNMR = ["--gnmr", "--gnmr-delta", "2", "--gnmr-warmup", "3", "--gnmr-max-o", "3",
        "--gnmr-alpha", "1.2", "--gnmr-beta", "1.1", "--gnmr-agreement-interval", "1",
        "--gnmr-units", r"mlp\.experts"]
LAYOUTS = {"ep1": [], "ep2": ["--expert-model-parallel-size", "2"],
           "tp2_sp": ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                      "--monitors", "router", "--monitor-interval", "2",
                      "--monitor-delta", "2"]}
# The documented tolerances of the deepseek recipe across layouts (relative):
# - EP=2 vs EP=1: the same model (platform/expert_init.py), the same tokens per expert and
#   the same per-token tiles; measured bit-identical over 12 steps. Compared at 1e-6.
# - TP=2 vs TP=1: the row-parallel GEMMs sum their partial products in another order, and
#   with E2M3's 3 mantissa bits a value that crosses a rounding midpoint moves by up to 1/16
#   of itself; a token whose two best experts are nearly tied then picks the other one,
#   which moves that expert's gradient norm by percents. Measured: loss 1.4e-4 by step 5;
#   unit norms 9e-6 over 2 steps, then 2% (step 3) to 22% (step 5); the same decisions
#   through step 6. Compared: losses at 1e-3 over 5 steps, norms at 1e-4 over 2, decisions
#   over 5.


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_layouts")
    common = [*ALIGNED, *DEEPSEEK_MOE, *GNMR, "--train-iters", str(STEPS),
              "--eval-interval", "100"]
    run_batch([[*common, *flags, "--save", str(root / name)] for name, flags in
               LAYOUTS.items()], nproc=2)
    return root


def _compare(runs, layout, loss_steps: int, loss_rtol: float, norm_steps: int,
             norm_rtol: float):
    expected, got = train_losses(runs / "ep1"), train_losses(runs / layout)
    assert sorted(got) == list(range(1, STEPS + 1))
    np.testing.assert_allclose([got[s] for s in range(1, loss_steps + 1)],
                               [expected[s] for s in range(1, loss_steps + 1)], rtol=loss_rtol)
    ref_trace, trace = trace_records(runs / "ep1"), trace_records(runs / layout)
    np.testing.assert_allclose([r["norms"] for r in trace[:norm_steps]],
                               [r["norms"] for r in ref_trace[:norm_steps]], rtol=norm_rtol)
    return [r["recovery"] for r in ref_trace], [r["recovery"] for r in trace]


def test_expert_parallel_layout_reproduces_ep1(runs):
    expected, got = _compare(runs, "ep2", STEPS, 1e-6, STEPS, 1e-6)
    # One budget over all experts of both EP ranks: the same units, whoever holds them.
    assert got == expected
    assert any(got), "the settings should make the controller act"
    assert max(len(units) for units in got) <= 3


def test_tensor_parallel_layout_reproduces_ep1_within_the_recipe_tolerance(runs):
    expected, got = _compare(runs, "tp2_sp", 5, 1e-3, 2, 1e-4)
    assert got[:5] == expected[:5] and any(got[:5])


def test_the_budget_is_global_over_expert_parallel_ranks(runs):
    """At EP=2 each rank holds experts 0-1 or 2-3 of each layer; the decisions must name
    experts of both halves (a per-rank budget would pick max_o on each rank)."""
    units = read_jsonl(runs / "ep2" / "gnmr_trace.jsonl")[0]["units"]
    chosen = {units[index] for r in trace_records(runs / "ep2") for index in r["recovery"]}
    experts = {int(name.split(".")[4]) for name in chosen}
    assert experts & {0, 1} and experts & {2, 3}, chosen


def test_moe_with_tensor_parallelism_trains_with_the_router_monitor(runs):
    router = {(r["step"], k): v for r in read_jsonl(runs / "tp2_sp" / "metrics.jsonl")
              for k, v in r.items() if k.startswith("monitor/router")}
    for layer in (0, 1):
        assert 0 < router[(STEPS, f"monitor/router/layer{layer}/entropy_mean")] <= 1
        assert 0 <= router[(STEPS, f"monitor/router/layer{layer}/gate_entropy_mean")] <= 1
        assert router[(STEPS, f"monitor/router/layer{layer}/expert_bias_spread")] > 0
