"""Weights & Biases: offline by default when no API key is configured, files in the run dir.

Every W&B file (run log, cache, settings) goes under `<run dir>/wandb*`, so an offline run is
complete, travels with the run directory and can be uploaded later with `wandb sync`. Scalars
are logged under their names (`train/`, `valid/`, `gnmr/`, `monitor/...`); images (the
per-unit GNMR heatmap and the recovery timeline) every `image_interval` steps; events as
W&B alerts-free text in the summary; the run summary at the end. `close()` also ends the
`wandb-core` helper process, which otherwise outlives `finish()`.
"""

from __future__ import annotations

import numbers
import os
from pathlib import Path


def has_api_key() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    netrc = Path.home() / ".netrc"
    return netrc.is_file() and "api.wandb.ai" in netrc.read_text(errors="ignore")


def resolve_mode(mode: str | None) -> str:
    return mode or ("online" if has_api_key() else "offline")


class WandbLogger:
    def __init__(self, run_dir: Path, config: dict, project: str, name: str | None,
                 entity: str | None, mode: str | None, group: str | None = None):
        import wandb

        self._wandb = wandb
        root = Path(run_dir)
        for variable, folder in (("WANDB_DIR", "."), ("WANDB_CACHE_DIR", "wandb-cache"),
                                 ("WANDB_DATA_DIR", "wandb-data"),
                                 ("WANDB_CONFIG_DIR", "wandb-config")):
            path = (root / folder).resolve()
            path.mkdir(parents=True, exist_ok=True)
            os.environ[variable] = str(path)
        self.run = wandb.init(project=project, name=name, entity=entity, group=group,
                              mode=resolve_mode(mode), dir=str(root.resolve()), config=config,
                              settings=wandb.Settings(silent=True, console="off"))

    def log(self, step: int, metrics: dict) -> None:
        scalars = {k: v for k, v in metrics.items()
                   if isinstance(v, numbers.Number) and not isinstance(v, bool)}
        if scalars:
            self.run.log(scalars, step=step)

    def image(self, step: int, key: str, figure) -> None:
        self.run.log({key: self._wandb.Image(figure)}, step=step)

    def event(self, step: int, kind: str, payload: dict) -> None:
        if kind == "summary":
            self.run.summary.update({k: v for k, v in payload.items() if v is not None})
        else:
            self.run.log({f"events/{kind}": 1}, step=step)

    def close(self) -> None:
        self.run.finish()
        self._wandb.teardown()
