"""The monitor section of a run's config (`--monitors`, `--monitor-*`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_gnmr.limits import check_limits, limit


@dataclass
class MonitorConfig:
    monitors: str = ""
    """Comma list of mechanism monitors to run: attention, router."""
    monitor_interval: int = limit(10, ge=1)
    """Measure every N steps."""
    monitor_delta: int = limit(10, ge=1)
    """Attention: dW spans this many steps (<= --monitor-interval)."""
    monitor_detector: str = "trend"
    """Alarm detector: trend (the signal's own recent trend), reference (healthy reference
    runs' band; implied by --monitor-reference) or online (band of its first checks)."""
    monitor_reference: list[str] = field(default_factory=list, metadata={"metavar": "RUN_DIR"})
    """Run directories of healthy runs (same model, data, schedule) for the reference band."""
    monitor_band: float = limit(4.0, gt=0)
    """Alarm when a signal is more than band x its noise from the expected value ..."""
    monitor_patience: int = limit(5, ge=1)
    """... for this many consecutive checks."""
    monitor_baseline_samples: int = limit(16, ge=2)
    """online detector: checks that form each signal's baseline (after 2 start-up checks)."""
    monitor_trend_window: int = limit(16, ge=3)
    """trend detector: checks in the robust line fit."""
    monitor_trend_horizon: int = limit(12, ge=0)
    """trend detector: checks between the end of the fit window and the checked sample."""
    monitor_reference_smooth: int = limit(4, ge=1)
    """reference detector: live and reference signals are trailing means over this many checks."""
    monitor_d3: bool = False
    """Attention: also the second-order term D3 = dA dB^T."""

    def __post_init__(self) -> None:
        check_limits(self, "monitor")


# The defaults, for the alarm book and the detectors built outside a run (replays, tests):
# declared once, above.
DEFAULTS = MonitorConfig()
