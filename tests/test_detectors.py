"""Alarm detectors on synthetic signals: a trend that stalls, a level step, pure noise.

References are hand-computed traces and float64 transcriptions, never the detectors' own
output; the noise tests measure the documented false-alarm rates.
"""

import math
import statistics

import numpy as np
import pytest

from megatron_gnmr.monitors.alarms import AlarmBook
from megatron_gnmr.monitors.detectors import OnlineBand, ReferenceBand, ReferenceProfile, TrendModel
from megatron_gnmr.monitors.detectors.reference import trailing_mean
from megatron_gnmr.monitors.detectors.trend import NOISE_FALSE_ALARM_RATE, theil_sen


def alarms(detector, values, steps=None) -> list[int]:
    steps = range(len(values)) if steps is None else steps
    return [step for step, value in zip(steps, values)
            if detector.update(step, float(value)) is not None]


def rising(n, rng, slope=0.01, noise=0.01, level=1.0):
    return level + slope * np.arange(n) + noise * rng.standard_normal(n)


def stalled(n, at, rng, slope=0.01, noise=0.01, level=1.0):
    """Rises like `rising` until sample `at`, then stays flat (the attention-fault shape)."""
    x = np.minimum(np.arange(n), at)
    return level + slope * x + noise * rng.standard_normal(n)


# -- the robust line --------------------------------------------------------------------

def test_theil_sen_matches_its_definition_and_ignores_an_outlier():
    rng = np.random.default_rng(3)
    values = rng.standard_normal(9)
    pairs = [(values[j] - values[i]) / (j - i) for i in range(9) for j in range(i + 1, 9)]
    slope = statistics.median(pairs)
    intercept = statistics.median([values[i] - slope * i for i in range(9)])
    assert theil_sen(np.arange(9.0), values) == pytest.approx((slope, intercept), abs=1e-15)
    x = np.array([0, 1, 2, 3, 5, 8, 9, 10, 11, 14, 15, 16], dtype=np.float64)  # gaps
    line = 2.0 - 0.5 * x
    line[4] += 100.0  # one spike does not bend the fit
    assert theil_sen(x, line) == pytest.approx((-0.5, 2.0), abs=1e-12)


# -- trend model ------------------------------------------------------------------------

def test_trend_stall_alarms_soon_after_the_stall_and_not_before():
    for seed in range(20):
        values = stalled(200, at=100, rng=np.random.default_rng(seed))
        fired = alarms(TrendModel(axis="linear"), values)
        # slope 0.01, noise 0.01: the extrapolation error grows 0.01 per sample after the
        # stall until the fit window starts to absorb it (12-samples horizon); band
        # 4 x noise x inflation (~1.5) ~ 0.06 -> ~6 samples, + patience 5
        assert fired and 100 < fired[0] <= 100 + 20, (seed, fired)


def test_trend_follows_a_steady_trend_without_alarm():
    for seed in range(20):
        assert alarms(TrendModel(axis="linear"), rising(300, np.random.default_rng(seed))) == []


def test_trend_log_axis_follows_a_flattening_curve_the_linear_axis_calls_a_change():
    """A loss-like curve, straight in log(step): the default log axis follows it, a straight
    line in the step sees its flattening as a change of trend."""
    steps = np.arange(1, 301) * 10
    for seed in range(10):
        curve = 6.0 - 0.5 * np.log(steps) + 0.01 * np.random.default_rng(seed).standard_normal(300)
        assert alarms(TrendModel(), curve, steps) == []
        assert alarms(TrendModel(axis="linear"), curve, steps)
    stall = np.where(steps < 1500, 6.0 - 0.5 * np.log(steps), 6.0 - 0.5 * np.log(1500))
    fired = alarms(TrendModel(direction=+1), stall, steps)  # stops falling: above expectation
    assert fired and 1500 < fired[0] <= 2500, fired


def test_trend_level_step_fires_at_the_fifth_sample_after_it():
    values = rising(80, np.random.default_rng(1))
    values[50:] -= 1.0  # far outside any band; patience 5
    assert alarms(TrendModel(axis="linear"), values)[0] == 54


def test_trend_pure_noise_stays_under_the_documented_false_alarm_rate():
    fired = checked = 0
    detector_skip = TrendModel().skip + TrendModel().window + TrendModel().horizon
    for seed in range(200):
        noise = 1.0 + 0.05 * np.random.default_rng(seed).standard_normal(500)
        fired += len(alarms(TrendModel(), noise))
        checked += 500 - detector_skip
    assert fired / checked <= NOISE_FALSE_ALARM_RATE, fired / checked


def test_trend_non_finite_is_outside_and_not_learnt():
    values = rising(70, np.random.default_rng(0))
    values[40:45] = math.nan
    detector = TrendModel(axis="linear")
    fired = alarms(detector, values)
    assert fired == [44]  # fifth NaN; the rest continues the trend across the gap
    assert all(math.isfinite(v) for _, v in detector.history)


# -- reference band ---------------------------------------------------------------------

def _references(seeds, n=120, interval=25):
    steps = [interval * (i + 1) for i in range(n)]
    return steps, [dict(zip(steps, rising(n, np.random.default_rng(s)))) for s in seeds]


def test_reference_profile_is_the_smoothed_mean_and_spread_by_hand():
    steps = [10, 20, 30, 40]
    series = [dict(zip(steps, [1.0, 2.0, 3.0, 5.0])), dict(zip(steps, [2.0, 2.0, 5.0, 5.0]))]
    profile = ReferenceProfile.from_series(series, smooth=2, min_relative_spread=0.0)
    # trailing means over 2: a = 1, 1.5, 2.5, 4; b = 2, 2, 3.5, 5
    assert [profile.mean[s] for s in steps] == pytest.approx([1.5, 1.75, 3.0, 4.5])
    across = [np.std(pair, ddof=1) for pair in ([1, 2], [1.5, 2], [2.5, 3.5], [4, 5])]
    # first differences a: 1, 1, 2 -> median 1, |d - 1| = 0, 0, 1 -> MAD 0 -> noise 0;
    # b: 0, 3, 0 -> median 0, MAD 0 -> noise 0; so the spread is the cross-run std, floored
    # at its median over steps (0.707: the seed-to-seed offset that persists).
    typical = statistics.median(across)
    assert [profile.spread[s] for s in steps] == pytest.approx([max(a, typical) for a in across])
    assert trailing_mean(np.array([1.0, 2.0, 3.0, 5.0]), 3) == pytest.approx([1, 1.5, 2, 10 / 3])


def test_reference_band_catches_a_stall_and_passes_a_healthy_seed():
    steps, refs = _references([1, 2, 3])
    profile = ReferenceProfile.from_series(refs, smooth=4, min_relative_spread=0.01)
    healthy = rising(120, np.random.default_rng(9))
    assert alarms(ReferenceBand(profile), healthy, steps) == []
    fault = stalled(120, at=40, rng=np.random.default_rng(9))
    fired = alarms(ReferenceBand(profile), fault, steps)
    assert fired and steps[40] < fired[0] <= steps[60], fired


def test_reference_band_skips_steps_no_reference_has():
    _, refs = _references([1, 2])
    profile = ReferenceProfile.from_series(refs, smooth=1, min_relative_spread=0.01)
    far_off = np.full(50, 100.0)
    assert alarms(ReferenceBand(profile), far_off, steps=range(1, 51)) == []  # no such steps


# -- the online band (SPEC 7.3 as first built) -------------------------------------------

def test_online_level_step_fires_after_patience_samples():
    rng = np.random.default_rng(0)
    values = np.concatenate([1.0 + 0.01 * rng.standard_normal(40),
                             0.5 + 0.01 * rng.standard_normal(20)])
    assert alarms(OnlineBand(), values) == [44]  # the fifth consecutive sample outside


def test_online_pure_noise_does_not_alarm():
    for seed in range(100):
        noise = 1.0 + 0.05 * np.random.default_rng(seed).standard_normal(500)
        assert alarms(OnlineBand(), noise) == []


def test_online_non_finite_counts_as_outside_and_realarm_after_recovery():
    values = [1.0] * 20 + [float("nan")] * 5 + [1.0] * 3 + [5.0] * 5
    assert alarms(OnlineBand(), values) == [24, 32]


def test_online_band_alarms_on_a_healthy_trend_the_trend_model_follows():
    """Why the trend model is the default: a healthy signal that keeps rising leaves a band
    learnt on its early values (a false alarm), and a stall after that is never seen."""
    for seed in range(10):
        healthy = rising(200, np.random.default_rng(seed))
        assert alarms(OnlineBand(), healthy) and not alarms(TrendModel(axis="linear"), healthy)


# -- the book ---------------------------------------------------------------------------

@pytest.mark.parametrize("detector", ["trend", "online", "reference"])
def test_book_state_round_trips(detector):
    steps, refs = _references([1, 2])
    references = {"attention/layer0/H_D2_mean": refs}
    book = AlarmBook(detector=detector, references=references)
    values = rising(60, np.random.default_rng(4))
    for step, value in zip(steps[:30], values[:30]):
        book.observe(step, "attention", 0, "H_D2_mean", float(value))
    again = AlarmBook(detector=detector, references=references)
    again.load_state_dict(book.state_dict())
    for step, value in zip(steps[30:60], values[30:60] - 5.0):
        assert again.observe(step, "attention", 0, "H_D2_mean", float(value)) == \
            book.observe(step, "attention", 0, "H_D2_mean", float(value))


def test_book_falls_back_to_the_trend_model_for_signals_without_reference():
    book = AlarmBook(detector="reference", references={})
    values = rising(80, np.random.default_rng(1))
    values[50:] -= 1.0
    events = [book.observe(step, "router", 1, "entropy_mean", float(v))
              for step, v in enumerate(values)]
    fired = [e for e in events if e]
    assert fired[0]["detector"] == "trend" and fired[0]["layer"] == 1


@pytest.mark.parametrize("make", [lambda d: TrendModel(axis="linear", direction=d),
                                  lambda d: OnlineBand(direction=d)])
def test_one_sided_detectors_alarm_only_on_the_failure_side(make):
    up = rising(80, np.random.default_rng(2), slope=0.0)
    up[50:] += 1.0
    down = rising(80, np.random.default_rng(2), slope=0.0)
    down[50:] -= 1.0
    assert alarms(make(-1), up) == [] and alarms(make(-1), down)
    assert alarms(make(+1), down) == [] and alarms(make(+1), up)


def test_every_unit_has_a_name_of_its_own_and_one_unit_means_one(monkeypatch):
    """TE's global scope lets every unit switch (max_o = the model's units); a family whose
    max_o is the integer 1 keeps one unit (in Python 1 == 1.0, which once read as 'every')."""
    from megatron_gnmr.experiments import detectors

    assert detectors.Setting("te-global", (5.0, 1e-4)).controller(4)[0].max_o == 4
    one = detectors.Family("one-unit", "gnmr", "alpha", (2.0,), {},
                           {**detectors.PER_UNIT, "max_o": 1})
    monkeypatch.setitem(detectors.FAMILY, "one-unit", one)
    assert detectors.Setting("one-unit", 2.0).controller(4)[0].max_o == 1
