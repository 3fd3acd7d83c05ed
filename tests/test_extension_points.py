"""Adding to an extension point is one new file and one registry line (docs/architecture.md).

The test does what a contributor would: it writes a new risk signal's module, registers it
with one line, and the signal then works end to end: `--gnmr-signals` accepts it, a run
decides with it, the trace records it and replay scores it again. It does the same for an
alarm detector and for a measured quantity (a probe's new measurement, which a run traces
and a signal reads live and in replay).
"""

import importlib.util
import sys
import textwrap

import ml_dtypes
import numpy as np
import pytest
import torch

from megatron_gnmr.controller import signals
from megatron_gnmr.monitors import detectors
from megatron_gnmr.precision import measurements
from tests.helpers import REPO, TINY, trace_records

TOY_SIGNAL = textwrap.dedent('''
    """`toy`: the unit `toy_unit` names is always risky (an example)."""

    from dataclasses import dataclass

    import numpy as np

    from megatron_gnmr.controller.signals.base import Observations, RiskSignal
    from megatron_gnmr.limits import limit


    @dataclass
    class ToySettings:
        toy_unit: int = limit(0, ge=0)
        """toy signal: the index of the unit it makes risky."""


    class ToySignal(RiskSignal):
        name = "toy"
        settings_class = ToySettings

        def scores(self, observations: Observations) -> np.ndarray:
            chosen = self.settings["toy_unit"]
            return np.where(np.arange(len(self.unit_names)) == chosen, 3.0, 0.0)
''')


def load(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_new_risk_signal_is_one_file_and_one_registry_line(tmp_path, monkeypatch):
    (tmp_path / "toy_signal.py").write_text(TOY_SIGNAL)  # the one new file
    toy = load(tmp_path / "toy_signal.py", "toy_signal")
    monkeypatch.setitem(signals.SIGNALS, "toy", toy.ToySignal)  # the one registry line

    sys.path.insert(0, str(REPO))
    from pretrain_llama import main

    run = tmp_path / "run"
    main([*TINY, "--train-iters", "5", "--lr-warmup-iters", "1", "--eval-interval", "100",
          "--gnmr", "--gnmr-signals", "toy", "--gnmr-warmup", "2", "--gnmr-delta", "1",
          "--save", str(run)])
    decided = [r["recovery"] for r in trace_records(run)]
    # risky once the warm-up is over; registered after the gnmr section was composed, its
    # knob has no flag and takes its default (a registry line in SIGNALS makes it a flag)
    assert decided == [[], [], [0], [0], [0]]
    assert toy.ToySignal(["a", "b"], {"toy_unit": 1}).scores(None).tolist() == [0.0, 3.0]

    from megatron_gnmr.controller.config import GNMRConfig
    from megatron_gnmr.controller.replay import replay
    from megatron_gnmr.controller.trace import read_trace

    trace = read_trace(str(run / "gnmr_trace.jsonl"))
    config = GNMRConfig(**{k: v for k, v in trace.config.items()
                           if k in GNMRConfig.__dataclass_fields__})
    assert replay(trace, config).matches_recorded == 5


def test_a_new_alarm_detector_is_one_file_and_one_registry_line(tmp_path, monkeypatch):
    (tmp_path / "fixed_band.py").write_text(textwrap.dedent('''
        """`fixed`: alarms when a signal is below 0 (an example)."""

        from megatron_gnmr.monitors.detectors.streak import Streak


        class FixedBand:
            kind = "fixed"

            def __init__(self, patience, direction):
                self.rule, self.direction = Streak(patience), direction

            def update(self, step, value):
                return {"expected": 0.0, "band": 0.0} if self.rule.push(value < 0) else None

            @property
            def firing(self):
                return self.rule.firing

            def state_dict(self):
                return {"rule": self.rule.state_dict()}

            def load_state_dict(self, state):
                self.rule.load_state_dict(state["rule"])

            @classmethod
            def check(cls, monitor):
                if monitor.monitor_reference:
                    raise ValueError("--monitor-detector fixed takes no --monitor-reference")

            @classmethod
            def for_signal(cls, key, book, band, patience, direction):
                return cls(patience, direction)
    '''))
    fixed = load(tmp_path / "fixed_band.py", "fixed_band")
    monkeypatch.setitem(detectors.DETECTORS, "fixed", fixed.FixedBand)

    # Validation asks the detector what it needs (it names no detector itself).
    from megatron_gnmr.arguments import parse_config
    from megatron_gnmr.errors import UserError
    from megatron_gnmr.validation import validate_monitors

    validate_monitors(parse_config([*TINY, "--monitors", "attention", "--monitor-detector",
                                    "fixed"]))
    with pytest.raises(UserError, match="fixed takes no --monitor-reference"):
        validate_monitors(parse_config([*TINY, "--monitors", "attention", "--monitor-detector",
                                        "fixed", "--monitor-reference", str(REPO)]))

    from megatron_gnmr.monitors.alarms import AlarmBook

    book = AlarmBook(detector="fixed", patience=2)
    values = np.array([1.0, -1.0, -2.0, -3.0, 1.0])
    events, firing = [], []
    for step, value in enumerate(values, start=1):
        events.append(book.observe(step, "attention", 0, "H_D2_mean", value))
        firing.append(book.signals["attention/layer0/H_D2_mean"].firing)
    assert [step for step, event in enumerate(events, start=1) if event] == [3]
    assert events[2]["detector"] == "fixed"
    assert firing == [False, False, True, True, False]  # what the `monitor` risk signal reads


def test_every_registered_component_has_its_protocols_members():
    """The Protocols (monitors/contracts.py, signals/base.py, measurements/base.py,
    model_families/base.py) list what the code uses; each registered class has all of it (a
    missing member fails here, not at a check step hours into a run)."""
    from megatron_gnmr.monitors.attention import AttentionMonitor
    from megatron_gnmr.monitors.contracts import Detector, Monitor
    from megatron_gnmr.monitors.router import RouterMonitor

    def members(protocol):  # methods, properties and declared attributes
        return {name for name in [*vars(protocol), *protocol.__annotations__]
                if not name.startswith("_")}

    for monitor in (AttentionMonitor, RouterMonitor):
        assert members(Monitor) <= set(dir(monitor)), monitor
    for detector in detectors.DETECTORS.values():
        assert members(Detector) <= set(dir(detector)), detector
    from megatron_gnmr.controller.signals.base import RiskSignal
    from megatron_gnmr.model_families import FAMILIES
    from megatron_gnmr.model_families.base import ModelFamily
    from megatron_gnmr.precision.measurements.base import Measurement

    for signal in filter(None, signals.SIGNALS.values()):
        assert members(RiskSignal) <= set(dir(signal)), signal
    for measurement in measurements.MEASUREMENTS.values():
        assert members(Measurement) <= set(dir(measurement)), measurement
        assert isinstance(measurement.slots, int) and measurement.slots > 0, measurement
    for family in FAMILIES.values():
        assert members(ModelFamily) <= set(dir(family)), family


def test_signal_keys_read_back_what_they_write():
    from megatron_gnmr.monitors.contracts import SignalKey

    key = SignalKey("attention", 3, "H_D2_mean")
    assert key.metric == "monitor/attention/layer3/H_D2_mean"
    assert key.alarm == "attention/layer3/H_D2_mean"
    assert SignalKey.from_metric(key.metric) == key == SignalKey.from_alarm(key.alarm)
    assert SignalKey.from_alarm("router/entropy_mean") == SignalKey("router", None, "entropy_mean")
    assert SignalKey.from_metric("gnmr/recovered") is None
    assert SignalKey.from_metric("monitor/attention/layerX/H") is None


UNDERFLOW = textwrap.dedent('''
    """`underflow`: the share of the output gradient's nonzero elements that the low path
    flushes to zero (an example)."""

    import numpy as np
    import torch

    from megatron_gnmr.precision.measurements.base import Measurement, Slots, low_quantized


    class GradientUnderflow(Measurement):
        name = "underflow"
        slots = 2  # flushed elements, nonzero elements

        @torch.no_grad()
        def output_gradient(self, slots: Slots, low_path, grad_output, run_path, g_q, group):
            quantized = low_quantized(low_path, "grad", grad_output, run_path, g_q, group)
            if quantized is not None:
                nonzero = grad_output != 0
                slots.add(0, (nonzero & (quantized == 0)).sum())
                slots.add(1, nonzero.sum())

        def value(self, sums: np.ndarray) -> np.ndarray:
            with np.errstate(invalid="ignore", divide="ignore"):
                return sums[:, 0] / sums[:, 1]
''')

UNDERFLOW_SIGNAL = textwrap.dedent('''
    """`most-flushed`: the unit whose gradient underflows most is risky (an example)."""

    import numpy as np

    from megatron_gnmr.controller.signals.base import Observations, RiskSignal


    class MostFlushed(RiskSignal):
        name = "most-flushed"
        observes = ("underflow",)

        def scores(self, observations: Observations) -> np.ndarray:
            share = np.nan_to_num(observations.measured["underflow"], nan=-1.0)
            return np.where(share == share.max(), 3.0, 0.0)
''')


def test_a_new_measured_quantity_is_one_file_and_one_registry_line(tmp_path, monkeypatch):
    (tmp_path / "underflow.py").write_text(UNDERFLOW)  # the one new file
    underflow = load(tmp_path / "underflow.py", "underflow").GradientUnderflow()
    monkeypatch.setitem(measurements.MEASUREMENTS, "underflow", underflow)  # the registry line

    # The probe hands it the low path's gradient in its own slots, after qerr's: against an
    # independent per-tensor E5M2 cast (ml_dtypes), on a gradient with a tail of tiny values.
    from megatron_gnmr.precision.paths import GemmPath, emulated_linear
    from megatron_gnmr.precision.probes import ProbeBank
    from megatron_gnmr.precision.scaling import QuantSpec

    low = GemmPath("fp8", QuantSpec("e4m3"), QuantSpec("e4m3"), QuantSpec("e5m2"))
    gen = torch.Generator().manual_seed(0)
    g = torch.randn(32, 16, generator=gen) * torch.exp(4 * torch.randn(32, 16, generator=gen))
    x, w = torch.randn(32, 24, generator=gen), torch.randn(16, 24, generator=gen)
    bank = ProbeBank(["u"], low, ("qerr", "underflow"))
    emulated_linear(x.requires_grad_(), w.requires_grad_(), None, GemmPath("exact"), False,
                    None, bank.probe("u")).backward(g)  # shadow: the unit runs exact
    measured = measurements.values(("qerr", "underflow"), bank.take().reshape(1, -1).numpy())
    g64 = g.double().numpy()
    scale = float(ml_dtypes.finfo(ml_dtypes.float8_e5m2).max) / np.abs(g64).max()
    cast = (g64 * scale).astype(np.float32).astype(ml_dtypes.float8_e5m2).astype(np.float64)
    expected = ((cast == 0) & (g64 != 0)).sum() / (g64 != 0).sum()
    assert 0 < expected < 1
    assert measured["underflow"][0] == expected

    # A run traces it, a signal that reads it decides with it, and replay reads it back.
    (tmp_path / "most_flushed.py").write_text(UNDERFLOW_SIGNAL)
    monkeypatch.setitem(signals.SIGNALS, "most-flushed",
                        load(tmp_path / "most_flushed.py", "most_flushed").MostFlushed)
    sys.path.insert(0, str(REPO))
    from pretrain_llama import main

    run = tmp_path / "run"
    main([*TINY, "--train-iters", "5", "--lr-warmup-iters", "1", "--eval-interval", "100",
          "--precision-recipe", "fp8-emulated", "--gnmr", "--gnmr-signals", "most-flushed",
          "--gnmr-warmup", "2", "--gnmr-delta", "1", "--gnmr-max-o", "1", "--save", str(run)])
    from megatron_gnmr.controller.config import GNMRConfig
    from megatron_gnmr.controller.replay import replay
    from megatron_gnmr.controller.trace import read_trace

    trace = read_trace(str(run / "gnmr_trace.jsonl"))
    shares = trace.measured["underflow"]
    assert set(trace.measured) == {"underflow"} and shares.shape == (5, len(trace.units))
    assert np.all((shares >= 0) & (shares <= 1)) and shares.max() > 0
    most = [int(np.argmax(row)) for row in shares]
    assert [list(r) for r in trace.recovery[2:]] == [[u] for u in most[2:]]
    config = GNMRConfig(**{k: v for k, v in trace.config.items()
                           if k in GNMRConfig.__dataclass_fields__})
    assert replay(trace, config).matches_recorded == 5


def test_each_signal_knob_is_declared_once_in_its_signal():
    """A signal's settings class is the one home of its knobs: each field is a gnmr-section
    field with the same default, a `--gnmr-*` flag, recorded in the trace header's signal
    settings and sweepable in replay; and no knob of a signal is declared elsewhere."""
    import dataclasses

    from megatron_gnmr.arguments import build_parser
    from megatron_gnmr.controller.config import GNMRConfig, GNMRRunConfig
    from megatron_gnmr.controller.replay import SIGNAL_SWEEPABLE

    flags = {option for action in build_parser()._actions for option in action.option_strings}
    run_fields = {f.name: f for f in dataclasses.fields(GNMRRunConfig)}
    recorded = GNMRRunConfig().signal_settings(run_seed=0)
    knobs = set()
    for signal in filter(None, signals.SIGNALS.values()):
        for knob in dataclasses.fields(signal.settings_class) if signal.settings_class else ():
            knobs.add(knob.name)
            assert run_fields[knob.name].default == knob.default, (signal, knob.name)
            assert f"--gnmr-{knob.name.replace('_', '-')}" in flags
            assert recorded[knob.name] == knob.default and knob.name in SIGNAL_SWEEPABLE
    assert knobs >= {"qerr_ratio", "qerr_baseline", "monitor_hold", "static_units",
                     "selection_seed"}
    declared_by_the_section = set(GNMRRunConfig.__annotations__) | set(GNMRConfig.__annotations__)
    assert not knobs & declared_by_the_section
