"""The monitors inside a run: when to snapshot, when to measure, metrics and alarm events.

Checks happen at steps that are multiples of `interval`. The attention monitor needs the
weights of `delta` steps earlier, so it snapshots after step k*interval - delta
(`delta <= interval`); the router monitor arms itself before a check step's forward. Every
rank ends up with the same values (reduced over TP, gathered over PP), so every rank runs the
same alarm book and checkpoints the same monitor state. Monitors only read: training is
never changed by them.
"""

from __future__ import annotations

from megatron_gnmr.monitors.alarms import AlarmBook
from megatron_gnmr.monitors.contracts import Monitor, SignalKey
from megatron_gnmr.monitors.detectors.reference_runs import load_reference_signals
from megatron_gnmr.monitors.families import FAMILIES, parse_families


class MonitorSuite:
    def __init__(self, config, model_chunks, unit_names: list[str], model_family):
        """`unit_names`: every unit of the model (eligible or not), to say which an alarm
        names (`Family.unit_prefixes`); `model_family`: what the monitors read in each layer
        (`model_families/`)."""
        self.unit_names = list(unit_names)
        self.interval = config.monitor_interval
        self.monitors: dict[str, Monitor] = {
            name: FAMILIES[name].monitor(model_chunks, config, model_family)
                         for name in parse_families(config.monitors)}
        references = config.monitor_reference
        self.alarms = AlarmBook(
            detector="reference" if references else config.monitor_detector,
            band=config.monitor_band, patience=config.monitor_patience,
            baseline_samples=config.monitor_baseline_samples,
            trend_window=config.monitor_trend_window, trend_horizon=config.monitor_trend_horizon,
            reference_smooth=config.monitor_reference_smooth,
            references=load_reference_signals(references) if references else {})

    def before_step(self, step: int) -> None:
        """`step` is the 1-based step about to run."""
        for monitor in self.monitors.values():
            monitor.before_step(step)

    def after_step(self, step: int) -> tuple[dict, list[dict]]:
        """Metrics and alarm events of the step that just finished (empty off-check)."""
        metrics, events = {}, []
        if step % self.interval == 0:
            for family, monitor in self.monitors.items():
                alarm_signals = FAMILIES[family].alarm_signals
                for layer, values in (monitor.measure() or {}).items():
                    for name, value in values.items():
                        metrics[SignalKey(family, layer, name).metric] = value
                        if name in alarm_signals:
                            alarm = self.alarms.observe(step, family, layer, name, value)
                            if alarm is not None:
                                events.append(alarm)
        for monitor in self.monitors.values():
            monitor.after_step(step)
        return metrics, events

    def reads_weights(self, step: int) -> bool:
        """Whether `after_step(step)` reads the model's weights (which must then be whole:
        `training/overlap.py`)."""
        return any(monitor.reads_weights(step) for monitor in self.monitors.values())

    def alarmed(self) -> frozenset[str]:
        """The unit-name prefixes named by every layer alarm that is firing now (the signal
        is still outside its band)."""
        out = set()
        for text, detector in self.alarms.signals.items():
            key = SignalKey.from_alarm(text)
            if detector.firing and key.layer is not None:
                out.add(self._named(FAMILIES[key.family].unit_prefixes(key.layer)))
        return frozenset(out)

    def _named(self, prefixes: tuple[str, ...]) -> str:
        """The first prefix some unit of the model has (else the broadest, the last)."""
        return next((prefix for prefix in prefixes
                     if any(name.startswith(prefix) for name in self.unit_names)), prefixes[-1])

    def state_dict(self) -> dict:
        return {"alarms": self.alarms.state_dict(),
                "monitors": {name: m.state_dict() for name, m in self.monitors.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.alarms.load_state_dict(state["alarms"])
        for name, monitor in self.monitors.items():
            monitor.load_state_dict(state["monitors"][name])

    def load_alarms(self, alarms: dict) -> None:
        """The alarm book alone (a resume on another layout: the monitors' own state holds
        this rank's weight shards, which belong to the old layout)."""
        self.alarms.load_state_dict(alarms)


class NoMonitors:
    """The stand-in when no monitor runs: nothing measured, nothing firing, no state."""

    def before_step(self, step: int) -> None:
        pass

    def after_step(self, step: int) -> tuple[dict, list[dict]]:
        return {}, []

    def reads_weights(self, step: int) -> bool:
        return False

    def alarmed(self) -> frozenset[str]:
        return frozenset()

    def state_dict(self) -> None:
        return None

    def load_state_dict(self, state) -> None:
        pass

    def load_alarms(self, alarms) -> None:
        pass
