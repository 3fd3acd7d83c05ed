"""What a person watching a run should see, in the order they look: the dashboard layout that
`megatron-gnmr dashboard` saves as a W&B workspace and every run writes as TensorBoard's
custom-scalars layout (`observe/dashboard.py`).

Sections: training (loss with validation, LR, grad norm, tokens/s, step time), the controller
(recovery-set size, recovery sparsity = the budget spent, exceedance rate, switches, pool,
the per-unit heatmap and recovery timeline images, whose title gives the share recovered per
unit kind), one section per monitor family (each of its signals on one chart with every
layer, and the alarm events), and in W&B the run's evaluation (`megatron-gnmr evaluate`) when
it has one. A chart is a regex over
metric keys, so one chart holds every layer of a signal; `layout(keys)` keeps the charts
that match a key the run logged and says which logged keys no chart shows.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from megatron_gnmr.monitors.families import FAMILIES


@dataclass(frozen=True)
class Chart:
    title: str
    pattern: str  # a regex that fully matches each key on the chart
    kind: str = "line"  # line | image | events

    def matches(self, key: str) -> bool:
        return re.fullmatch(self.pattern, key) is not None


@dataclass(frozen=True)
class Section:
    name: str
    charts: tuple[Chart, ...]


EVENTS = "events/(alarm|diverged|nonfinite_gradient|warning)"  # W&B: 1 at the event's step


def all_sections() -> list[Section]:
    """Every chart the product can fill, in the order a person reads them."""
    sections = [
        Section("Training", (
            Chart("loss (train, validation)", r"(train|valid)/loss"),
            Chart("perplexity", r"(train|valid)/ppl"),
            Chart("learning rate", r"train/lr"),
            Chart("gradient norm (before clipping)", r"train/grad_norm"),
            Chart("tokens/s", r"train/tokens_per_s"),
            Chart("step time (s)", r"train/step_time_s"),
            Chart("skipped steps (non-finite)", r"train/skipped"),
            Chart("share of the units' GEMM FLOPs on the recovery path",
                  r"precision/recovered_flop_share"),
        )),
        Section("GNMR controller", (
            Chart("recovery-set size (units on the recovery path next step)",
                  r"gnmr/recovery_size"),
            Chart("recovery sparsity (budget spent), its share of the FLOPs, exceedance rate",
                  r"gnmr/(recovery_sparsity|recovery_cost_share|exceedance_rate)"),
            Chart("switches per 1,000 steps", r"gnmr/switches_per_1k_steps"),
            Chart("candidate pool and risky units", r"gnmr/(pool_size|risky_units)"),
            Chart("largest GNMR", r"gnmr/max_gnmr"),
            Chart("per-unit GNMR and recovery timeline (share recovered per unit kind)",
                  r"gnmr/recovery_timeline", kind="image"),
        )),
    ]
    for family, entry in FAMILIES.items():
        prefix = rf"monitor/{family}/layer\d+/"
        sections.append(Section(f"Monitor: {family}", (
            *(Chart(f"{family}: {title} (every layer)", prefix + f"({pattern})")
              for title, pattern in entry.charts.items()),
            Chart(f"{family}: alarm events (1 at each alarm)", EVENTS, kind="events"),
        )))
    return sections


def layout(keys: set[str] | None = None) -> list[Section]:
    """The sections and charts that show at least one of `keys` (None: all of them)."""
    if keys is None:
        return all_sections()
    kept = []
    for section in all_sections():
        charts = tuple(c for c in section.charts if any(c.matches(k) for k in keys))
        if charts:
            kept.append(Section(section.name, charts))
    return kept


def unshown(keys: set[str], sections: list[Section]) -> list[str]:
    """Logged keys under gnmr/ or monitor/ that no chart shows (should be none)."""
    charts = [c for s in sections for c in s.charts]
    return sorted(k for k in keys if k.startswith(("gnmr/", "monitor/"))
                  and not any(c.matches(k) for c in charts))


def sections_for_run_config(config: dict) -> list[Section]:
    """The sections a run of this config (`RunConfig.to_dict()`) fills: training always, the
    controller with --gnmr, a monitor family when --monitors names it."""
    families = set(filter(None, config["monitor"]["monitors"].split(",")))
    wanted = {"Training"} | ({"GNMR controller"} if config["gnmr"]["enabled"] else set()) | \
        {f"Monitor: {family}" for family in families}
    return [section for section in all_sections() if section.name in wanted]
