"""Alarm rule on synthetic signals: a step fires after `patience` samples, noise does not."""

import numpy as np

from megatron_gnmr.monitors.alarms import AlarmBook, SignalBaseline


def _first_alarm(values, **kwargs):
    defaults = AlarmBook()
    baseline = SignalBaseline(**{"skip": defaults.skip, "baseline_samples":
                                 defaults.baseline_samples, "band": defaults.band,
                                 "patience": defaults.patience, **kwargs})
    fired = [i for i, v in enumerate(values) if baseline.update(float(v))]
    return fired


def test_a_level_step_fires_after_patience_samples():
    rng = np.random.default_rng(0)
    values = np.concatenate([1.0 + 0.01 * rng.standard_normal(40),
                             0.5 + 0.01 * rng.standard_normal(20)])
    assert _first_alarm(values) == [42]  # third consecutive sample out of the band


def test_pure_noise_does_not_alarm():
    """The documented false-alarm rate of the defaults: none in 100 x 500 noise samples."""
    for seed in range(100):
        noise = 1.0 + 0.05 * np.random.default_rng(seed).standard_normal(500)
        assert _first_alarm(noise) == []


def test_non_finite_counts_as_outside_and_realarm_after_recovery():
    values = [1.0] * 20 + [float("nan")] * 3 + [1.0] * 3 + [5.0] * 3
    assert _first_alarm(values) == [22, 28]


def test_book_state_round_trips():
    book = AlarmBook()
    for step in range(20):
        book.observe(step, "attention", 0, "H_D2_mean", 1.0 + 0.001 * step)
    again = AlarmBook()
    again.load_state_dict(book.state_dict())
    for step in range(20, 28):
        assert again.observe(step, "attention", 0, "H_D2_mean", 3.0) == \
            book.observe(step, "attention", 0, "H_D2_mean", 3.0)
