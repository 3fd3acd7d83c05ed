"""Monitors under torchrun: TP=2 reports what TP=1 reports; the MoE model trains with EP=2
and the router monitor on."""

import numpy as np

from tests.helpers import TINY, read_jsonl, run_pretrain, train_losses

ATTENTION = ["--monitors", "attention", "--monitor-interval", "1", "--monitor-delta", "1",
             "--monitor-d3", "--train-iters", "4", "--eval-interval", "100"]


def _monitor_values(run_dir, family):
    values = {}
    for record in read_jsonl(run_dir / "metrics.jsonl"):
        for key, value in record.items():
            if key.startswith(f"monitor/{family}/"):
                values[(record["step"], key)] = value
    return values


def test_attention_monitor_tp2_matches_tp1(tmp_path):
    run_pretrain([*TINY, *ATTENTION, "--save", str(tmp_path / "tp1")])
    run_pretrain([*TINY, *ATTENTION, "--tensor-model-parallel-size", "2",
                  "--save", str(tmp_path / "tp2")], nproc=2)
    tp1, tp2 = _monitor_values(tmp_path / "tp1", "attention"), \
        _monitor_values(tmp_path / "tp2", "attention")
    # 2 layers x steps 2-4 x (3 figures for dWq and dWk, mean and min for D2 and D3)
    assert tp1.keys() == tp2.keys() and len(tp1) == 2 * 3 * 10
    keys = sorted(tp1)
    np.testing.assert_allclose([tp2[k] for k in keys], [tp1[k] for k in keys], rtol=1e-5)


def test_moe_trains_with_ep2_and_the_router_monitor(tmp_path):
    run_pretrain([*TINY, "--num-experts", "4", "--moe-aux-loss-coeff", "0.01",
                  "--moe-router-topk", "2",
                  "--expert-model-parallel-size", "2", "--monitors", "router,attention",
                  "--monitor-interval", "2", "--monitor-delta", "2", "--train-iters", "12",
                  "--eval-interval", "100", "--save", str(tmp_path)], nproc=2)
    losses = train_losses(tmp_path)
    assert losses[12] < losses[1] - 0.3
    router = _monitor_values(tmp_path, "router")
    steps = sorted({step for step, _ in router})
    assert steps == [2, 4, 6, 8, 10, 12]
    for layer in (0, 1):
        entropy = router[(12, f"monitor/router/layer{layer}/entropy_mean")]
        low = router[(12, f"monitor/router/layer{layer}/entropy_q05")]
        assert 0 < low <= entropy <= 1
        assert router[(12, f"monitor/router/layer{layer}/load_max_over_mean")] >= 1
        assert -1 / 3 <= router[(12, f"monitor/router/layer{layer}/weight_similarity")] <= 1
