"""An earlier round's closed-loop summaries (issue 30's format) filling the arms and seeds
the present round lacks, so that runs already made are not made again.

Runs pair only on one CPU model (a seed's arms are compared bit for bit), so an earlier
summary is used only when every run of both rounds was made on the same CPU model; one
made elsewhere is refused by name. The earlier format has no loss curve (the checks that need
one, the plot and following the twin, leave those runs out); its budget is already over the
steps the run ran (recovered unit-steps over its trace's decisions, one per step run).
"""

from __future__ import annotations

import json
from pathlib import Path

from megatron_gnmr.errors import UserError


def _as_present(earlier: dict) -> dict:
    steps = earlier["steps"]
    return {"run": earlier["run"], "finished": earlier.get("finished"), "steps": steps,
            "diverged_at": earlier.get("diverged_at"),
            "first_attention_alarm": earlier.get("first_attention_alarm"),
            "first_recovery": earlier.get("first_recovery"),
            "recovered_share_of_executed_steps": earlier.get("recovered_unit_step_share", 0.0),
            "final_train_loss": earlier.get("final_train_loss"),
            "final_valid_loss": earlier.get("final_valid_loss"),
            "loss_every_25_steps": {}, "cpu": earlier.get("cpu"), "earlier": True}


def merge(table: dict[str, dict[int, dict]], directory: Path, variants, seeds) -> list[str]:
    """Add the earlier round's summary of every (variant, seed) of the scenario that `table`
    lacks; returns what was added ("variant-seedN")."""
    if not directory.is_dir():
        raise UserError(f"--earlier {directory}: no such directory")
    present_cpus = {r.get("cpu") for runs in table.values() for r in runs.values()}
    added = []
    for variant in variants:
        for seed in seeds:
            path = directory / f"{variant}-seed{seed}.json"
            if seed in table.get(variant, {}) or not path.is_file():
                continue
            earlier = json.loads(path.read_text())
            cpus = present_cpus | {earlier.get("cpu")}
            if len(cpus) > 1 or None in cpus:
                raise UserError(f"--earlier {path}: made on {earlier.get('cpu')!r}, this "
                                f"round on {', '.join(sorted(map(str, present_cpus)))}: runs "
                                "pair only on one CPU model")
            table.setdefault(variant, {})[seed] = _as_present(earlier)
            added.append(f"{variant}-seed{seed}")
    return added
