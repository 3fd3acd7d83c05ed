"""The GNMR policy: per-unit norms in, the next step's recovery set out (SPEC 4 and 5).

Pure numpy: no torch.distributed, no Megatron. Every rank feeds it the same all-reduced
norm vector and so decides the same set without further communication. Everything that
influences a future decision is in `state_dict()`, so a resumed run decides exactly as the
uninterrupted run would have.

Cost is O(num_units * delta) per step, independent of parameter count.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from megatron_gnmr.controller.config import GNMRConfig


@dataclass(frozen=True)
class Decision:
    """One call of `GNMRPolicy.step`. Per-unit arrays are float64, NaN where undefined."""

    step: int
    recovery: tuple[int, ...]
    """Sorted unit indices that run the recovery path in the NEXT step."""
    norms: np.ndarray
    gnmr: np.ndarray
    delta_gnmr: np.ndarray
    risk: np.ndarray
    risky: np.ndarray
    """bool per unit: exceeded a threshold (or had a non-finite norm) at this step."""
    locks: np.ndarray
    """int per unit, after this step's lock update."""
    pool_size: int
    nonfinite: tuple[int, ...]
    """Units whose norm was NaN/Inf at this step (reported, never entered in a history)."""


class GNMRPolicy:
    """GNMR / Delta-GNMR scoring with a hard budget `max_o` and a lock against thrashing."""

    def __init__(self, config: GNMRConfig, num_units: int, unit_costs=None):
        """`unit_costs`: what each unit spends of the budget when selected, scaled so that all
        of the model's units together cost `num_units` (`precision/unit_costs.py`); read when
        `config.budget_in` is `flops`, else every unit costs one."""
        if num_units < 0:
            raise ValueError(f"num_units must be >= 0, got {num_units}")
        self.config = config
        self.num_units = num_units
        self.max_o = config.budget(num_units)
        self.costs = None
        if config.budget_in == "flops":
            if unit_costs is None:
                raise ValueError("a budget in flops needs the units' costs")
            self.costs = np.asarray(unit_costs, dtype=np.float64).reshape(-1)
            if self.costs.shape != (num_units,) or not np.all(self.costs > 0):
                raise ValueError(f"expected {num_units} unit costs > 0")
        n, delta = num_units, config.delta
        self.t = 0
        self.norm_sum = np.zeros(n, dtype=np.float64)
        self.norm_count = np.zeros(n, dtype=np.int64)
        self._window = np.zeros((delta, n), dtype=np.float64)  # slot-major: rows vectorise
        self.gnmr_count = np.zeros(n, dtype=np.int64)  # GNMR values ever pushed
        self.locks = np.zeros(n, dtype=np.int64)
        # Running totals for the summary figures of SPEC 5.
        self.eligible_unit_steps = 0
        self.recovery_unit_steps = 0
        self.risky_unit_steps = 0
        self.switches = 0
        self._recovery = np.zeros(n, dtype=bool)
        self.latched = np.zeros(n, dtype=bool)  # with config.latch: selected once, kept
        self.tokens = 0.0  # the budget_rate bucket
        self.recovery_cost_steps = 0.0  # the selected units' costs, summed over steps

    def _affordable(self) -> int:
        """Units this step may select: max_o, and with a budget_rate the bucket's tokens."""
        if not self.config.budget_rate:
            return self.max_o
        self.tokens = min(self.tokens + self.config.budget_rate * self.num_units,
                          float(self.max_o))
        return min(self.max_o, int(self.tokens + 1e-9))

    def _select(self, candidates: np.ndarray, risk: np.ndarray) -> np.ndarray:
        """The candidates to recover, and the bucket charged for them."""
        if self.costs is None:
            selected = _highest_risk(candidates, risk, self._affordable())
            self.tokens -= selected.size
            self.recovery_cost_steps += selected.size
            return selected
        # In FLOPs: by risk, highest first (ties to the lower index), each candidate the
        # bucket can still pay for, at most max_o of them. The bucket holds up to max_o of
        # the costliest units, so every unit is affordable in time.
        if self.config.budget_rate:
            self.tokens = min(self.tokens + self.config.budget_rate * self.num_units,
                              self.max_o * float(self.costs.max(initial=1.0)))
        else:
            self.tokens = np.inf
        chosen = []
        for unit in candidates[np.lexsort((candidates, -risk))]:
            if len(chosen) == self.max_o:
                break
            if self.costs[unit] <= self.tokens + 1e-9:
                chosen.append(unit)
                self.tokens -= self.costs[unit]
                self.recovery_cost_steps += self.costs[unit]
        if not self.config.budget_rate:
            self.tokens = 0.0
        return np.sort(np.asarray(chosen, dtype=candidates.dtype))

    def step(self, norms, other_risk=None, use_gnmr: bool = True) -> Decision:
        """Score this step's per-unit gradient norms and choose the next recovery set.

        `other_risk`: per-unit scores of other risk signals (`controller/signals/`), already
        normalised so that > 1 is risky; a unit's risk is the max of its scores. Without
        `use_gnmr` the GNMR scores are computed (and traced) but do not decide."""
        norms = self._as_vector(norms)
        cfg, eps = self.config, self.config.eps
        self.t += 1
        t = self.t
        finite = np.isfinite(norms)
        alpha, beta = cfg.threshold("alpha", t), cfg.threshold("beta", t)

        with np.errstate(invalid="ignore", divide="ignore"):
            mean_norm = self.norm_sum / np.maximum(self.norm_count, 1)
            gnmr = np.where(
                finite & (self.norm_count >= 1), norms / np.maximum(mean_norm, eps), np.nan
            )
            window_full = self.gnmr_count >= cfg.delta
            window_mean = self._window.sum(axis=0) / cfg.delta
            delta_gnmr = np.where(
                window_full & ~np.isnan(gnmr), gnmr / np.maximum(window_mean, eps), np.nan
            )
            # A unit's risk: the larger of its defined scores (fmax skips a NaN), 0 if none.
            risk = np.fmax(gnmr / alpha, delta_gnmr / beta)
        risk[np.isnan(risk)] = 0.0

        risky = (gnmr > alpha) | (delta_gnmr > beta)  # NaN compares False: undefined is safe
        if not use_gnmr:
            risk, risky = np.full(self.num_units, -np.inf), np.zeros(self.num_units, dtype=bool)
        if other_risk is not None:
            other = np.nan_to_num(np.asarray(other_risk, dtype=np.float64), nan=-np.inf)
            risk = np.maximum(risk, other)
            risky |= other > 1.0
        if t <= cfg.warmup:
            risky[:] = False
        risky |= ~finite
        risk[~finite] = np.inf

        candidates = np.flatnonzero(risky | (self.locks > 0) | self.latched)
        # latched units first (they keep their place), then by risk
        ranked = np.where(self.latched, np.inf, risk)
        selected = self._select(candidates, ranked[candidates])

        in_selection = np.zeros(self.num_units, dtype=bool)
        in_selection[selected] = True
        if cfg.latch:
            self.latched |= in_selection
        relock = in_selection & risky
        self.locks -= ~relock & (self.locks > 0) & ~risky  # decay
        self.locks[relock] = cfg.t_lock

        self._update_history(norms, gnmr, finite)
        self._count(in_selection, risky, selected.size)

        return Decision(
            step=t,
            recovery=tuple(selected.tolist()),
            norms=norms,
            gnmr=gnmr,
            delta_gnmr=delta_gnmr,
            risk=risk,
            risky=risky,
            locks=self.locks.copy(),
            pool_size=int(candidates.size),
            nonfinite=tuple(np.flatnonzero(~finite).tolist()),
        )

    def _update_history(self, norms: np.ndarray, gnmr: np.ndarray, finite: np.ndarray) -> None:
        # Only accepted (finite) observations enter sums, counts and windows.
        self.norm_sum += np.where(finite, norms, 0.0)
        self.norm_count += finite
        pushed = ~np.isnan(gnmr)
        # Each unit writes its window slot count % delta. Units that once missed a value are
        # out of phase with the rest, so write one masked row per slot in use (usually one)
        # rather than scatter 31k single values.
        slot = self.gnmr_count % self.config.delta
        for row in np.flatnonzero(np.bincount(slot[pushed], minlength=self.config.delta)):
            np.copyto(self._window[row], gnmr, where=pushed & (slot == row))
        self.gnmr_count += pushed

    def _count(self, in_selection: np.ndarray, risky: np.ndarray, selected: int) -> None:
        self.eligible_unit_steps += self.num_units
        self.recovery_unit_steps += selected
        self.risky_unit_steps += int(np.count_nonzero(risky))
        self.switches += int(np.count_nonzero(in_selection != self._recovery))
        self._recovery = in_selection

    def _as_vector(self, norms) -> np.ndarray:
        if hasattr(norms, "detach"):  # torch tensor, without importing torch here
            norms = norms.detach().cpu().double().numpy()
        vector = np.asarray(norms, dtype=np.float64).reshape(-1)
        if vector.shape != (self.num_units,):
            raise ValueError(f"expected {self.num_units} norms, got {vector.shape[0]}")
        return vector.copy()

    @property
    def gnmr_ring(self) -> np.ndarray:
        """The Delta-GNMR windows, [units, delta] (slot count % delta holds the next value)."""
        return self._window.T

    @property
    def recovery(self) -> tuple[int, ...]:
        """The current recovery set (decided by the last step)."""
        return tuple(int(u) for u in np.flatnonzero(self._recovery))

    def summary(self) -> dict[str, float]:
        """Recovery sparsity, exceedance rate and switches per 1,000 steps so far."""
        eligible = max(self.eligible_unit_steps, 1)
        return {
            "steps": self.t,
            "recovery_sparsity": self.recovery_unit_steps / eligible,
            "exceedance_rate": self.risky_unit_steps / eligible,
            "switches_per_1k_steps": 1000.0 * self.switches / max(self.t, 1),
            # with costs in FLOPs: the share of all units' GEMM FLOPs recovered by this rule
            "recovery_cost_share": self.recovery_cost_steps / eligible,
        }

    _ARRAYS = ("norm_sum", "norm_count", "gnmr_count", "locks", "_recovery", "latched")
    _COUNTERS = ("t", "eligible_unit_steps", "recovery_unit_steps", "risky_unit_steps", "switches")
    _FLOATS = ("tokens", "recovery_cost_steps")

    def state_dict(self) -> dict:
        state = {name: getattr(self, name).copy() for name in self._ARRAYS}
        state["gnmr_ring"] = self._window.T.copy()  # [units, delta], as checkpoints hold it
        state.update({name: getattr(self, name) for name in self._COUNTERS + self._FLOATS})
        state["num_units"] = self.num_units
        state["delta"] = self.config.delta
        return state

    def load_state_dict(self, state: dict) -> None:
        if state["num_units"] != self.num_units or state["delta"] != self.config.delta:
            raise ValueError(
                f"controller state is for {state['num_units']} units and delta "
                f"{state['delta']}, this policy has {self.num_units} units and delta "
                f"{self.config.delta}"
            )
        for name in self._ARRAYS:
            if name == "latched" and name not in state:  # a checkpoint from before the latch
                continue
            setattr(self, name, np.array(state[name], copy=True))
        self._window = np.ascontiguousarray(np.asarray(state["gnmr_ring"], dtype=np.float64).T)
        for name in self._COUNTERS:
            setattr(self, name, int(state[name]))
        for name in self._FLOATS:
            setattr(self, name, float(state.get(name, 0.0)))


def _highest_risk(candidates: np.ndarray, risk: np.ndarray, budget: int) -> np.ndarray:
    """The `budget` candidates of highest risk, ties to the lower unit index, in index order
    (`candidates` ascending, `risk` theirs, never NaN): a partition, not a sort of the pool."""
    if budget <= 0:
        return candidates[:0]
    if candidates.size <= budget:
        return candidates
    cutoff = np.partition(risk, candidates.size - budget)[candidates.size - budget]
    chosen = risk > cutoff
    tied = np.flatnonzero(risk == cutoff)[: budget - np.count_nonzero(chosen)]
    chosen[tied] = True
    return candidates[chosen]
