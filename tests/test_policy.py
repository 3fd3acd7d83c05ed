"""The GNMR policy against a hand-computed trace, a plain reference, and properties."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_gnmr.controller import GNMRConfig, GNMRPolicy
from tests.reference_policy import reference_decisions

NAN = math.nan


def test_hand_computed_trace():
    """alpha 2, beta 1.5, delta 2, max_o 1, t_lock 2, warmup 3; three units.

    t1: no history: every score undefined, risk 0, nothing selected.
    t2: GNMR = n / mean(previous) = [1, 1, 1], Delta-GNMR undefined (no past GNMR yet).
    t3: GNMR [1, 1, 1]; Delta-GNMR still undefined (1 past GNMR < delta 2); warm-up.
    t4: unit 0 jumps to 3: GNMR 3/1 = 3 > 2, Delta-GNMR 3 / mean(1, 1) = 3 > 1.5;
        risk max(3/2, 3/1.5) = 2. Pool {0}; selected {0}; lock(0) = 2.
    t5: unit 2 is NaN: risky with risk inf (not entered in its history). Unit 0:
        GNMR 1 / mean(1,1,1,3) = 2/3, Delta-GNMR (2/3) / mean(3, 1) = 1/3, not risky but
        locked. Pool {0, 2}; budget 1 -> {2}; lock(2) = 2; lock(0) 2 -> 1.
    t6: unit 1 jumps to 8: GNMR 8 / mean(2,2,2,2,2) = 4, Delta-GNMR 4 / mean(1, 1) = 4,
        risk max(2, 8/3) = 8/3. Pool {0 (lock 1), 1, 2 (lock 2)} -> {1}; lock(1) = 2,
        lock(0) 1 -> 0, lock(2) 2 -> 1.
    t7: nothing risky. Unit 1: GNMR 2 / mean(2,2,2,2,2,8) = 2/3, Delta-GNMR (2/3) / mean(1, 4)
        = 4/15, risk 1/3. Unit 2: GNMR 4 / mean(4,4,4,4) = 1 (its NaN was skipped),
        Delta-GNMR 1 / mean(1, 1) = 1, risk max(1/2, 2/3) = 2/3. Pool {1, 2} -> {2} (higher
        risk); lock(2) 1 -> 0 (selected but not risky), lock(1) 2 -> 1.
    """
    policy = GNMRPolicy(GNMRConfig(alpha=2.0, beta=1.5, delta=2, max_o=1, t_lock=2, warmup=3),
                        num_units=3)
    rows = [[1, 2, 4], [1, 2, 4], [1, 2, 4], [3, 2, 4], [1, 2, NAN], [1, 8, 4], [1, 2, 4]]
    expected = [
        # recovery, locks, pool size, risk
        ((), [0, 0, 0], 0, [0, 0, 0]),
        ((), [0, 0, 0], 0, [0.5, 0.5, 0.5]),
        ((), [0, 0, 0], 0, [0.5, 0.5, 0.5]),
        ((0,), [2, 0, 0], 1, [2.0, 2 / 3, 2 / 3]),
        ((2,), [1, 0, 2], 2, [1 / 3, 2 / 3, math.inf]),
        ((1,), [0, 2, 1], 3, [(1 / 1.4) / 2, 8 / 3, 2 / 3]),
        ((2,), [0, 1, 0], 2, [(0.75 / ((1 / 1.4 + 2 / 3) / 2)) / 1.5, 1 / 3, 2 / 3]),
    ]
    for t, (row, (recovery, locks, pool, risk)) in enumerate(zip(rows, expected), start=1):
        decision = policy.step(row)
        assert decision.step == t
        assert decision.recovery == recovery, f"step {t}"
        assert decision.locks.tolist() == locks, f"step {t}"
        assert decision.pool_size == pool, f"step {t}"
        np.testing.assert_allclose(decision.risk, risk, rtol=1e-12, err_msg=f"step {t}")
    assert decision.gnmr[1] == pytest.approx(2 / 3)
    assert decision.delta_gnmr[1] == pytest.approx(4 / 15)


def test_ties_go_to_the_lower_index():
    policy = GNMRPolicy(GNMRConfig(delta=1, warmup=2, max_o=2), num_units=4)
    decision = policy.step([NAN, 1.0, NAN, NAN])  # three units at risk +inf
    assert decision.recovery == (0, 2)


def test_fractional_budget_rounds_down():
    assert GNMRPolicy(GNMRConfig(max_o=0.25), num_units=10).max_o == 2
    assert GNMRPolicy(GNMRConfig(max_o=0.05), num_units=10).max_o == 0
    assert GNMRPolicy(GNMRConfig(max_o=3), num_units=10).max_o == 3


@pytest.mark.parametrize("field,value,message", [
    ("alpha", 0, "gnmr.alpha"), ("beta", -1.0, "gnmr.beta"), ("alpha", math.inf, "gnmr.alpha"),
    ("delta", 0, "gnmr.delta"), ("t_lock", -1, "gnmr.t_lock"), ("max_o", -1, "gnmr.max_o"),
    ("max_o", 1.5, "gnmr.max_o"), ("warmup", 4, "gnmr.warmup"),
    ("alpha_schedule", "0:2.0", "gnmr.alpha_schedule"),
])
def test_bad_config_names_the_field(field, value, message):
    with pytest.raises(ValueError, match=message):
        GNMRConfig(**{field: value, "delta": 8 if field != "delta" else value})


def test_threshold_schedule_is_piecewise_constant():
    config = GNMRConfig(alpha=2.0, alpha_schedule="10:3.0,20:1.5")
    assert [config.threshold("alpha", t) for t in (1, 9, 10, 19, 20, 99)] == \
        [2.0, 2.0, 3.0, 3.0, 1.5, 1.5]


def test_accepts_numpy_and_torch_vectors():
    import torch

    a = GNMRPolicy(GNMRConfig(), num_units=3)
    b = GNMRPolicy(GNMRConfig(), num_units=3)
    for row in ([1.0, 2.0, 3.0], [2.0, 1.0, 9.0]):
        assert a.step(np.array(row)).recovery == b.step(torch.tensor(row)).recovery
    with pytest.raises(ValueError, match="expected 3 norms"):
        a.step([1.0, 2.0])


# --- properties on random traces with spikes and NaN/Inf -------------------------------------

def _configs():
    return st.builds(
        lambda alpha, beta, delta, max_o, t_lock, extra: dict(
            alpha=alpha, beta=beta, delta=delta, max_o=max_o, t_lock=t_lock,
            warmup=delta + 1 + extra),
        st.floats(1.05, 4.0), st.floats(1.05, 3.0), st.integers(1, 5),
        st.integers(0, 6), st.integers(0, 6), st.integers(0, 6))


def _traces(num_units: int, steps: int):
    value = st.one_of(
        st.floats(0.01, 2.0),  # ordinary
        st.floats(5.0, 100.0),  # spike
        st.sampled_from([0.0, NAN, math.inf, -math.inf]),  # zero and non-finite
    )
    return st.lists(st.lists(value, min_size=num_units, max_size=num_units),
                    min_size=steps, max_size=steps)


@settings(max_examples=150, deadline=None)
@given(config=_configs(), data=st.data())
def test_matches_the_plain_reference(config, data):
    num_units = data.draw(st.integers(1, 7))
    rows = data.draw(_traces(num_units, data.draw(st.integers(1, 30))))
    policy = GNMRPolicy(GNMRConfig(**config), num_units)
    reference = reference_decisions(rows, **config)
    for row, expected in zip(rows, reference):
        decision = policy.step(row)
        assert decision.recovery == expected["recovery"]
        assert decision.locks.tolist() == expected["locks"]
        assert decision.risky.tolist() == expected["risky"]
        assert decision.pool_size == expected["pool_size"]
        np.testing.assert_allclose(decision.risk, expected["risk"], rtol=1e-12)
        np.testing.assert_allclose(decision.gnmr, expected["gnmr"], rtol=1e-12)
        np.testing.assert_allclose(decision.delta_gnmr, expected["delta_gnmr"], rtol=1e-12)


@settings(max_examples=150, deadline=None)
@given(config=_configs(), data=st.data())
def test_budget_warmup_determinism_and_resume(config, data):
    num_units = data.draw(st.integers(1, 7))
    rows = data.draw(_traces(num_units, data.draw(st.integers(2, 30))))
    cut = data.draw(st.integers(0, len(rows)))
    cfg = GNMRConfig(**config)
    first, twin = GNMRPolicy(cfg, num_units), GNMRPolicy(cfg, num_units)
    resumed = None
    ever_nonfinite: set[int] = set()
    for t, row in enumerate(rows, start=1):
        if t - 1 == cut:  # take the state at an arbitrary step, load it into a fresh policy
            resumed = GNMRPolicy(cfg, num_units)
            resumed.load_state_dict(first.state_dict())
        decision = first.step(row)
        assert twin.step(row).recovery == decision.recovery  # deterministic
        if resumed is not None:
            again = resumed.step(row)
            assert again.recovery == decision.recovery
            assert again.locks.tolist() == decision.locks.tolist()
        assert len(decision.recovery) <= first.max_o
        ever_nonfinite |= {u for u, x in enumerate(row) if not math.isfinite(x)}
        if t <= cfg.warmup:
            assert set(decision.recovery) <= ever_nonfinite
    if resumed is not None:
        assert resumed.summary() == first.summary()


def test_a_latch_keeps_what_it_selected_within_max_o():
    """max_o 2, no GNMR (other risk only): unit 0 risky at step 3 only, unit 1 at step 5 only,
    unit 2 from step 7: with the latch 0 and 1 stay selected to the end and 2 never gets a
    place; without it each is selected only while risky; a resumed latch keeps them."""
    config = dict(max_o=2, t_lock=0, delta=1, warmup=2)
    risk = np.zeros((10, 3))
    risk[2, 0], risk[4, 1], risk[6:, 2] = 3.0, 3.0, 5.0
    latched, free = GNMRPolicy(GNMRConfig(**config, latch=True), 3), \
        GNMRPolicy(GNMRConfig(**config), 3)
    got_latched = [latched.step(np.ones(3), row, use_gnmr=False).recovery for row in risk]
    got_free = [free.step(np.ones(3), row, use_gnmr=False).recovery for row in risk]
    assert got_latched == [(), (), (0,), (0,), (0, 1), (0, 1), (0, 1), (0, 1), (0, 1), (0, 1)]
    assert got_free == [(), (), (0,), (), (1,), (), (2,), (2,), (2,), (2,)]
    resumed = GNMRPolicy(GNMRConfig(**config, latch=True), 3)
    resumed.load_state_dict(latched.state_dict())
    assert resumed.step(np.ones(3), np.zeros(3), use_gnmr=False).recovery == (0, 1)
