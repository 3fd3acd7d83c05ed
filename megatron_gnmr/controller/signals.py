"""Risk signals besides GNMR, and the budget-matched baselines, as per-unit scores.

Every signal turns one step's observations into a dimensionless score per unit, > 1 meaning
"risky"; the policy takes a unit's risk as the MAX of the scores of the signals in
`--gnmr-signals` (any one signal can make a unit risky; among risky units the most alarming
score ranks first) and keeps SPEC 5's pool, lock and budget. The max is chosen because the
signals do not share a scale beyond their thresholds: a sum or product would let a signal
that is merely high everywhere (qerr on heavy-tailed inputs) drown the other's spikes.

| signal | score of unit u at step t |
|---|---|
| `gnmr` | SPEC 4: max(GNMR / alpha, Delta-GNMR / beta) (in the policy itself) |
| `qerr` | e_u = max over its low-path operands of ||Q(x) - x|| / ||x|| (`precision/probes.py`), divided by `qerr_ratio` x its baseline: its own running mean (`history`, like GNMR) or this step's median over units (`peers`) |
| `monitor` | 2 while an alarm of the unit's layer and subsystem is firing (attention alarm: that layer's attention units; router alarm: its MLP/expert units), else 0 |
| `random` | 1 + U(0, 1), seeded: every unit a candidate, chosen at random (a baseline) |
| `static` | 2 for the units matching `static_units` (e.g. every fc2), else 0 (a baseline) |
| `oracle` | 1 + the true relative error of the unit's low-path weight gradient at this step (an exact side GEMM; experiments only): the best any signal could pick at that budget |

Baselines always have more candidates than budget, so they are meant to run with
`--gnmr-budget-rate` (the token bucket in the policy) to spend the same unit-steps as the
rule they are compared with. All scores are computed from all-reduced sums or from the
seed, so every rank scores identically.
"""

from __future__ import annotations

import re

import numpy as np

from megatron_gnmr.precision.probes import ORACLE, SLOTS

SIGNALS = ("gnmr", "qerr", "monitor", "random", "static", "oracle")
PROBED = ("qerr", "oracle")  # signals measured by the precision probes
QERR_BASELINES = ("history", "peers")
MONITOR_SCORE = 2.0


def parse_signals(text: str) -> tuple[str, ...]:
    names = tuple(s.strip() for s in text.split(",") if s.strip())
    unknown = [n for n in names if n not in SIGNALS]
    if unknown or not names:
        bad = ", ".join(unknown) if unknown else repr(text)
        raise ValueError(f"gnmr.signals has unknown or no entries ({bad}); use a comma list "
                         f"of {', '.join(SIGNALS)}")
    return names


def relative_errors(sums: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(qerr, oracle) per unit from the probes' [units, SLOTS] sums of squares; NaN where
    nothing was measured."""
    pairs = sums.reshape(sums.shape[0], SLOTS // 2, 2)
    with np.errstate(invalid="ignore", divide="ignore"):
        ratios = np.sqrt(pairs[:, :, 0] / pairs[:, :, 1])  # 0/0 -> NaN: not measured
    operands = ratios[:, :ORACLE]
    measured = ~np.isnan(operands)
    qerr = np.where(measured.any(axis=1),
                    np.nanmax(np.where(measured, operands, -np.inf), axis=1), np.nan)
    return qerr, ratios[:, ORACLE]


class SignalScores:
    """The non-GNMR scores of one run; its state (qerr history, RNG) is checkpointed."""

    def __init__(self, signals: tuple[str, ...], unit_names: list[str], qerr_ratio: float,
                 qerr_baseline: str, static_units: str, seed: int):
        self.signals = signals
        self.unit_names = unit_names
        self.qerr_ratio = qerr_ratio
        self.qerr_baseline = qerr_baseline
        pattern = re.compile(static_units)
        self.static = np.array([bool(pattern.search(n)) for n in unit_names])
        self.rng = np.random.default_rng(seed)
        self.qerr_sum = np.zeros(len(unit_names))
        self.qerr_count = np.zeros(len(unit_names), dtype=np.int64)

    def scores(self, qerr: np.ndarray | None, oracle: np.ndarray | None,
               firing: set[tuple[str, int]]) -> dict[str, np.ndarray]:
        """Per-signal scores of this step (signals other than `gnmr`)."""
        n = len(self.unit_names)
        out = {}
        if qerr is not None:
            out["qerr"] = self._qerr_score(qerr)
        if "oracle" in self.signals:
            out["oracle"] = 1.0 + np.nan_to_num(oracle, nan=0.0)
        if "random" in self.signals:
            out["random"] = 1.0 + self.rng.random(n)
        if "static" in self.signals:
            out["static"] = np.where(self.static, 2.0, 0.0)
        if "monitor" in self.signals:
            out["monitor"] = np.array([MONITOR_SCORE if _alarmed(name, firing) else 0.0
                                       for name in self.unit_names])
        return out

    def _qerr_score(self, qerr: np.ndarray) -> np.ndarray:
        finite = np.isfinite(qerr)
        with np.errstate(invalid="ignore", divide="ignore"):
            if self.qerr_baseline == "peers":
                baseline = np.full(qerr.shape, np.nanmedian(qerr) if finite.any() else np.nan)
            else:
                baseline = np.where(self.qerr_count > 0,
                                    self.qerr_sum / np.maximum(self.qerr_count, 1), np.nan)
            score = qerr / (self.qerr_ratio * baseline)
        self.qerr_sum[finite] += qerr[finite]
        self.qerr_count[finite] += 1
        return score

    def combined(self, scores: dict[str, np.ndarray]) -> np.ndarray | None:
        """The max over the run's non-GNMR signals (None when it has none)."""
        used = [scores[s] for s in self.signals if s != "gnmr" and s in scores]
        return np.max(np.stack(used), axis=0) if used else None

    def state_dict(self) -> dict:
        return {"rng": self.rng.bit_generator.state, "qerr_sum": self.qerr_sum.copy(),
                "qerr_count": self.qerr_count.copy()}

    def load_state_dict(self, state: dict) -> None:
        self.rng.bit_generator.state = state["rng"]
        self.qerr_sum = np.array(state["qerr_sum"], dtype=np.float64)
        self.qerr_count = np.array(state["qerr_count"], dtype=np.int64)


def _alarmed(unit_name: str, firing: set[tuple[str, int]]) -> bool:
    match = re.match(r"layers\.(\d+)\.(self_attention|mlp)\.", unit_name)
    if match is None:
        return False
    family = "attention" if match.group(2) == "self_attention" else "router"
    return (family, int(match.group(1))) in firing
