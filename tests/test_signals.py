"""Risk signals against float64 references: the qerr probe (also in shadow on the recovery
path), the oracle's true weight-gradient error and its choice, signal scores, the budget
bucket, and replay of a live run's signal-driven decisions."""

import ml_dtypes
import numpy as np
import pytest
import torch

from megatron_gnmr.controller.config import GNMRConfig
from megatron_gnmr.controller.policy import GNMRPolicy
from megatron_gnmr.controller.signals import Observations, combined
from megatron_gnmr.controller.signals.monitor import MonitorSignal
from megatron_gnmr.controller.signals.oracle import OracleSignal
from megatron_gnmr.controller.signals.qerr import QerrSignal
from megatron_gnmr.controller.signals.random_units import RandomSignal
from megatron_gnmr.controller.signals.static_units import StaticSignal
from megatron_gnmr.precision.paths import GemmPath, emulated_linear
from megatron_gnmr.precision.measurements import values
from megatron_gnmr.precision.probes import ProbeBank
from megatron_gnmr.precision.scaling import QuantSpec

SETTINGS = {"qerr_ratio": 1.5, "qerr_baseline": "history", "static_units": "x",
            "monitor_hold": 0, "selection_seed": 0, "run_seed": 0}
LOW = GemmPath("act-int3", saved_input=QuantSpec("int3", "tensor"))
RECOVERY = GemmPath("act-int8", saved_input=QuantSpec("int8", "tensor"))


def int_per_tensor(x: np.ndarray, bits: int) -> np.ndarray:
    """Independent float64 symmetric per-tensor integer fake-quantization (RNE, saturate)."""
    qmax = 2 ** (bits - 1) - 1
    scale = qmax / np.abs(x).max()
    return np.clip(np.rint(x * scale), -qmax - 1, qmax) / scale


def fp8_relative_error(x: np.ndarray, dtype) -> float:
    """||Q(x) - x|| / ||x|| for FP8 with one per-tensor scale amax -> the format's max."""
    scale = float(ml_dtypes.finfo(dtype).max) / np.abs(x).max()
    q = (x * scale).astype(np.float32).astype(dtype).astype(np.float64) / scale
    return float(np.linalg.norm(q - x) / np.linalg.norm(x))


def heavy_tailed(shape, seed, tail):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    return (x * torch.exp(tail * torch.randn(shape, generator=g, dtype=torch.float64))).float()


BOTH = ("qerr", "oracle")


def read(bank, measured):
    """The bank's values by name, as the controller reads them after the all-reduce."""
    return values(measured, bank.take().reshape(len(bank.index), -1).numpy())


def run_unit(bank, name, path, x, w, g):
    x = x.clone().requires_grad_(True)
    w = w.clone().requires_grad_(True)
    out = emulated_linear(x, w, None, path, False, None, bank.probe(name))
    out.backward(g)
    return out.detach(), x.grad, w.grad


def test_qerr_probe_is_the_relative_error_of_the_saved_operand():
    x, w = heavy_tailed((32, 48), 0, 1.0), torch.randn(24, 48)
    g = torch.randn(32, 24)
    bank = ProbeBank(["u"], LOW, ("qerr",))
    run_unit(bank, "u", LOW, x, w, g)
    measured = read(bank, ("qerr",))
    x64 = x.double().numpy()
    expected = np.linalg.norm(int_per_tensor(x64, 3) - x64) / np.linalg.norm(x64)
    assert measured["qerr"][0] == pytest.approx(expected, rel=1e-5)
    assert set(measured) == {"qerr"}  # the oracle was not asked for: no slots, no value


def test_shadow_measurement_on_the_recovery_path_reports_the_low_path_and_changes_nothing():
    x, w, g = heavy_tailed((32, 48), 1, 1.0), torch.randn(24, 48), torch.randn(32, 24)
    low_bank, shadow_bank = ProbeBank(["u"], LOW, BOTH), ProbeBank(["u"], LOW, BOTH)
    run_unit(low_bank, "u", LOW, x, w, g)
    probed = run_unit(shadow_bank, "u", RECOVERY, x, w, g)
    plain = run_unit(ProbeBank([], LOW, BOTH), "u", RECOVERY, x, w, g)  # no probe
    low_q, low_o = read(low_bank, BOTH).values()
    shadow_q, shadow_o = read(shadow_bank, BOTH).values()
    assert shadow_q[0] == pytest.approx(low_q[0], rel=1e-6)
    assert shadow_o[0] == pytest.approx(low_o[0], rel=1e-5)
    for a, b in zip(probed, plain):
        assert torch.equal(a, b)


def test_fp8_qerr_is_the_worst_of_its_operands():
    fp8 = GemmPath("fp8", QuantSpec("e4m3"), QuantSpec("e4m3"), QuantSpec("e5m2"))
    x, w, g = heavy_tailed((16, 32), 2, 0.5), torch.randn(8, 32), torch.randn(16, 8)
    bank = ProbeBank(["u"], fp8, ("qerr",))
    run_unit(bank, "u", GemmPath("exact"), x, w, g)  # shadow: the unit runs exact
    sums = bank.take().reshape(4, 2).double().numpy()  # (err^2, ref^2) per operand
    per_operand = np.sqrt(sums[:3, 0] / sums[:3, 1])  # input, weight, grad
    # independent reference: per-tensor current scaling through ml_dtypes' FP8 casts
    expected = [fp8_relative_error(t.double().numpy(), dtype) for t, dtype in (
        (x, ml_dtypes.float8_e4m3fn), (w, ml_dtypes.float8_e4m3fn), (g, ml_dtypes.float8_e5m2))]
    assert per_operand == pytest.approx(expected, rel=1e-4)
    qerr = values(("qerr",), sums.reshape(1, 8))["qerr"]
    assert qerr[0] == pytest.approx(max(expected), rel=1e-4)


def test_oracle_selects_the_units_with_the_largest_true_weight_gradient_error():
    names = ["light", "medium", "heavy", "heaviest"]
    tails = [0.0, 0.6, 1.2, 1.8]
    bank = ProbeBank(names, LOW, BOTH)
    expected = []
    for seed, (name, tail) in enumerate(zip(names, tails)):
        x, w, g = heavy_tailed((64, 32), seed, tail), torch.randn(16, 32), torch.randn(64, 16)
        run_unit(bank, name, LOW, x, w, g)
        x64, g64 = x.double().numpy(), g.double().numpy()
        exact = g64.T @ x64
        low = g64.T @ int_per_tensor(x64, 3)
        expected.append(np.linalg.norm(low - exact) / np.linalg.norm(exact))
    oracle = read(bank, BOTH)["oracle"]
    assert oracle == pytest.approx(expected, rel=1e-4)
    scorer = OracleSignal(names, SETTINGS)
    observed = Observations({"oracle": oracle})
    policy = GNMRPolicy(GNMRConfig(max_o=2, warmup=2, delta=1), len(names))
    policy.step(np.ones(4), combined([scorer.scores(observed)]), use_gnmr=False)  # warm-up
    policy.step(np.ones(4), combined([scorer.scores(observed)]), use_gnmr=False)
    decision = policy.step(np.ones(4), combined([scorer.scores(observed)]), use_gnmr=False)
    assert set(decision.recovery) == set(np.argsort(expected)[-2:])


def int_per_row(x: np.ndarray, bits: int) -> np.ndarray:
    """Independent float64 symmetric per-row integer fake-quantization (RNE, saturate)."""
    qmax = 2 ** (bits - 1) - 1
    scale = qmax / np.abs(x).max(axis=-1, keepdims=True)
    return np.clip(np.rint(x * scale), -qmax - 1, qmax) / scale


def test_loss_cost_is_the_first_order_loss_change_of_the_forward_rounding():
    """<dL/dy, Q(x) Q(W)^T - x W^T> and its terms' magnitudes sum |dL/dy * dy| against
    float64, W8A2 (ternary per-token inputs, INT8 per-channel weights), on the low path and
    in the shadow of the exact path.

    The bound: the signed sum cancels, so float32's error is a share of its terms'
    magnitudes (the gross sum), not of the sum: 1e-5 of it is ~100x float32's rounding of
    one output element (eps 6e-8 times K = 48 products), summed over the elements."""
    w8a2 = GemmPath("w8a2", input=QuantSpec("int2", "row"), weight=QuantSpec("int8", "row"))
    x, w, g = heavy_tailed((32, 48), 3, 0.5), torch.randn(24, 48), torch.randn(32, 24)
    x64, w64, g64 = (t.double().numpy() for t in (x, w, g))
    terms = g64 * (int_per_row(x64, 2) @ int_per_row(w64, 8).T - x64 @ w64.T)
    expected, gross = float(np.sum(terms)), float(np.sum(np.abs(terms)))
    both = ("loss_cost", "loss_cost_gross")
    for path in (w8a2, GemmPath("exact")):
        bank = ProbeBank(["u"], w8a2, both)
        run_unit(bank, "u", path, x, w, g)
        measured = read(bank, both)
        assert abs(measured["loss_cost"][0] - expected) <= 1e-5 * gross
        assert measured["loss_cost_gross"][0] == pytest.approx(gross, rel=1e-5)
    assert abs(expected) < 0.5 * gross  # the terms do cancel: a bound on the sum is wrong
    unmeasured = ProbeBank(["u", "v"], w8a2, ("loss_cost",))
    run_unit(unmeasured, "u", w8a2, x, w, g)
    assert np.isnan(read(unmeasured, ("loss_cost",))["loss_cost"][1])  # v never ran


def test_relative_errors_by_hand():
    sums = np.zeros((2, 10))  # qerr's four (err^2, ref^2) pairs, then the oracle's
    sums[0, 0:2] = [1.0, 4.0]   # input: sqrt(1/4) = 0.5
    sums[0, 6:8] = [9.0, 16.0]  # saved: 0.75
    sums[0, 8:10] = [1.0, 100.0]  # oracle: 0.1
    qerr, oracle = values(BOTH, sums).values()
    assert qerr[0] == 0.75 and oracle[0] == pytest.approx(0.1)
    assert np.isnan(qerr[1]) and np.isnan(oracle[1])


def test_qerr_scores_history_and_peers_by_hand():
    names = ["a", "b", "c"]
    history = QerrSignal(names, {**SETTINGS, "qerr_ratio": 2.0})
    first = history.scores(Observations({"qerr": np.array([0.2, 0.4, 0.8])}))
    assert np.isnan(first).all()  # no history yet
    second = history.scores(Observations({"qerr": np.array([0.6, 0.4, 0.8])}))
    assert second == pytest.approx([0.6 / (2 * 0.2), 0.4 / (2 * 0.4), 0.8 / (2 * 0.8)])
    peers = QerrSignal(names, {**SETTINGS, "qerr_ratio": 2.0, "qerr_baseline": "peers"})
    assert peers.scores(Observations({"qerr": np.array([0.2, 0.4, 1.2])})) == \
        pytest.approx([0.25, 0.5, 1.5])  # median 0.4


def test_random_is_seeded_and_resumable_static_and_monitor_pick_their_units():
    names = ["layers.0.self_attention.linear_qkv", "layers.0.mlp.linear_fc2",
             "layers.1.self_attention.linear_proj", "layers.1.mlp.linear_fc2"]
    settings = {**SETTINGS, "static_units": r"mlp\.linear_fc2$", "selection_seed": 5,
                "run_seed": 2}
    a, b = RandomSignal(names, settings), RandomSignal(names, settings)
    alarm = Observations(alarmed=frozenset({"layers.1.self_attention."}))
    first = a.scores(alarm)
    assert np.array_equal(first, b.scores(Observations()))
    assert all(1.0 <= v < 2.0 for v in first)
    assert list(StaticSignal(names, settings).scores(alarm)) == [0.0, 2.0, 0.0, 2.0]
    assert list(MonitorSignal(names, settings).scores(alarm)) == [0.0, 0.0, 2.0, 0.0]
    state = a.state_dict()
    nxt = a.scores(Observations())
    other = RandomSignal(names, {**settings, "run_seed": 3})  # the seed is their sum
    assert not np.array_equal(other.scores(Observations()), first)
    c = RandomSignal(names, {**settings, "selection_seed": 0})
    c.load_state_dict(state)
    assert np.array_equal(c.scores(Observations()), nxt)


def test_budget_rate_bucket_spends_rate_times_units_per_step():
    """Hand trace: 4 units, budget_rate 0.375 -> 1.5 tokens/step, bucket capped at max_o 2,
    every unit risky after 2 warm-up steps (which fill the bucket: 1.5, 2.0): 2.0 -> select 2
    (0 left), 1.5 -> 1 (0.5 left), 2.0 -> 2, ..."""
    policy = GNMRPolicy(GNMRConfig(max_o=2, warmup=2, delta=1, budget_rate=0.375), 4)
    always = np.full(4, 5.0)
    sizes = [len(policy.step(np.ones(4), always, use_gnmr=False).recovery) for _ in range(8)]
    assert sizes == [0, 0, 2, 1, 2, 1, 2, 1]
    assert policy.recovery_unit_steps == 9
