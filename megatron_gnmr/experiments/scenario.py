"""A scenario file (`configs/scenarios/NAME.yaml`): the runs that make one table.

    description: what the scenario shows
    base: [pretrain flags shared by every run]
    smoke: [flags appended for --smoke (about a minute in all)]
    seeds: [1, 2, 3]
    smoke_seeds: [1]
    reference: variant whose step time the others are divided by
    variants:
      name: [flags of this variant]
    pretrain:          # optional: a base run every variant starts from (`{pretrain}` in flags)
      name: NAME
      flags: [pretrain flags]
      smoke: [flags appended for --smoke]
    evaluate: [megatron-gnmr evaluate flags]   # optional: downstream scores of every run
    evaluate_exact: true   # optional: evaluate again with every unit exact (--exact)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

from megatron_gnmr.errors import UserError

SCENARIO_DIR = Path(__file__).resolve().parents[2] / "configs" / "scenarios"


@dataclass
class Scenario:
    name: str
    description: str
    base: list[str]
    smoke: list[str]
    seeds: list[int]
    smoke_seeds: list[int]
    reference: str
    variants: dict[str, list[str]]
    pretrain: dict | None = None
    evaluate: list[str] | None = None
    evaluate_exact: bool = False

    def pretrain_flags(self, smoke: bool) -> list[str]:
        """The base run's flags (with --smoke's additions)."""
        return [*self.pretrain["flags"], *(self.pretrain.get("smoke", []) if smoke else [])]

    def pretrain_dir(self, cache_dir: str, smoke: bool) -> Path:
        """Where the base run lives: cached by its flags, so every reproduction reuses it."""
        import hashlib

        digest = hashlib.sha256(" ".join(self.pretrain_flags(smoke)).encode()).hexdigest()
        return Path(cache_dir) / "pretrained" / f"{self.pretrain['name']}-{digest[:10]}"

    def runs(self, smoke: bool) -> list[tuple[str, int, list[str]]]:
        """(variant, seed, flags) for every run, seeds innermost."""
        seeds = self.smoke_seeds if smoke else self.seeds
        extra = self.smoke if smoke else []
        return [(variant, seed, [*self.base, *flags, *extra, "--seed", str(seed)])
                for variant, flags in self.variants.items() for seed in seeds]


def results_dir(scenario: Scenario, out: str | None, smoke: bool) -> Path:
    """Where a scenario's runs live: `--out`, else results/NAME (results/NAME-smoke)."""
    return Path(out or f"results/{scenario.name}{'-smoke' if smoke else ''}")


def available() -> list[str]:
    return sorted(p.stem for p in SCENARIO_DIR.glob("*.yaml"))


def load_scenario(name: str) -> Scenario:
    path = SCENARIO_DIR / f"{name}.yaml"
    if not SCENARIO_DIR.is_dir():  # an installed wheel carries the code, not the experiments
        raise UserError(f"reproduce: no scenarios at {SCENARIO_DIR}: the experiments run from a "
                        "clone of the repository (pip install -e . there)")
    if not path.is_file():
        raise UserError(f"reproduce: unknown scenario {name!r}; available: "
                        f"{', '.join(available())}")
    data = yaml.safe_load(path.read_text())
    as_strings = lambda flags: [str(f) for f in flags or []]  # noqa: E731 (YAML numbers)
    variants = {str(k): as_strings(v) for k, v in data["variants"].items()}
    reference = data.get("reference", next(iter(variants)))
    if reference not in variants:
        raise UserError(f"{path}: reference {reference!r} is not a variant")
    pretrain = data.get("pretrain")
    if pretrain is not None:
        pretrain = {"name": str(pretrain["name"]), "flags": as_strings(pretrain["flags"]),
                    "smoke": as_strings(pretrain.get("smoke"))}
    evaluate = as_strings(data["evaluate"]) if "evaluate" in data else None
    return Scenario(name, data.get("description", ""), as_strings(data.get("base")),
                    as_strings(data.get("smoke")), list(data.get("seeds", [1])),
                    list(data.get("smoke_seeds", [1])), reference, variants, pretrain,
                    evaluate, bool(data.get("evaluate_exact", False)))
