"""The monitors inside a run: when to snapshot, when to measure, metrics and alarm events.

Checks happen at steps that are multiples of `interval`. The attention monitor needs the
weights of `delta` steps earlier, so it snapshots after step k*interval - delta
(`delta <= interval`); the router monitor arms itself before a check step's forward. Every
rank ends up with the same values (reduced over TP, gathered over PP), so every rank runs the
same alarm book and checkpoints the same monitor state. Monitors only read: training is
never changed by them.
"""

from __future__ import annotations

from megatron_gnmr.monitors.alarms import ALARM_SIGNALS, AlarmBook
from megatron_gnmr.monitors.detectors.reference_runs import load_reference_signals


class MonitorSuite:
    def __init__(self, config, model_chunks):
        from megatron_gnmr.monitors.attention import AttentionMonitor
        from megatron_gnmr.monitors.router import RouterMonitor

        self.interval = config.monitor_interval
        self.delta = config.monitor_delta
        families = set(filter(None, config.monitors.split(",")))
        self.attention = AttentionMonitor(model_chunks, config.monitor_d3) \
            if "attention" in families else None
        self.router = RouterMonitor(model_chunks) if "router" in families else None
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
        if self.router is not None and step % self.interval == 0:
            self.router.arm()

    def after_step(self, step: int) -> tuple[dict, list[dict]]:
        """Metrics and alarm events of the step that just finished (empty off-check)."""
        metrics, events = {}, []
        if step % self.interval == 0:
            measured = []
            if self.attention is not None and self.attention.has_snapshot:
                measured.append(("attention", self.attention.measure()))
            if self.router is not None:
                measured.append(("router", self.router.measure()))
            for family, per_layer in measured:
                for layer, values in per_layer.items():
                    for name, value in values.items():
                        metrics[f"monitor/{family}/layer{layer}/{name}"] = value
                        if name in ALARM_SIGNALS[family]:
                            alarm = self.alarms.observe(step, family, layer, name, value)
                            if alarm is not None:
                                events.append(alarm)
        if self.attention is not None and (step + self.delta) % self.interval == 0:
            self.attention.snapshot()
        return metrics, events

    def firing(self) -> set[tuple[str, int]]:
        """(family, layer) of every layer alarm that is firing now (signal still outside)."""
        out = set()
        for key, detector in self.alarms.signals.items():
            family, layer = key.split("/")[:2]
            if detector.rule.firing and layer.startswith("layer"):
                out.add((family, int(layer.removeprefix("layer"))))
        return out

    def state_dict(self) -> dict:
        return {"alarms": self.alarms.state_dict(),
                "attention": self.attention.state_dict() if self.attention else None}

    def load_state_dict(self, state: dict) -> None:
        self.alarms.load_state_dict(state["alarms"])
        if self.attention is not None and state.get("attention"):
            self.attention.load_state_dict(state["attention"])


class NoMonitors:
    """The stand-in when no monitor runs: nothing measured, nothing firing, no state."""

    def before_step(self, step: int) -> None:
        pass

    def after_step(self, step: int) -> tuple[dict, list[dict]]:
        return {}, []

    def firing(self) -> set[tuple[str, int]]:
        return set()

    def state_dict(self) -> None:
        return None

    def load_state_dict(self, state) -> None:
        pass
