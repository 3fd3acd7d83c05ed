"""Weights & Biases: offline by default when no API key is configured, files in the run dir.

Every W&B file (run log, cache, settings) goes under `<run dir>/wandb*`, so an offline run is
complete, travels with the run directory and can be uploaded later with `wandb sync`. Scalars
are logged under their names (`train/`, `valid/`, `gnmr/`, `monitor/...`); images (the
per-unit GNMR heatmap and the recovery timeline) every `image_interval` steps; events as
W&B alerts-free text in the summary; the run summary at the end. `close()` also ends the
`wandb-core` helper process, which otherwise outlives `finish()`.

W&B's own console output is off (it would interleave with the progress lines), so the run
says itself, once at the start and once at the end, where its W&B files are and how to open
or upload them (`where_line`): an offline run is only useful to someone who knows that.
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


def where_line(mode: str, sync_dir: str, url: str | None, finished: bool) -> str:
    """The console line that says where a run's W&B files are and how to open or sync them
    (`wandb leet` reads the runs of a wandb directory, `wandb sync` uploads one)."""
    sync = f"wandb sync {sync_dir}"
    if mode != "offline":
        return (f"wandb: {'synced' if finished else 'logging'} to {url or 'W&B'}; files in "
                f"{sync_dir} (upload again: `{sync}`)")
    state = "offline run saved in" if finished else "offline run, files in"
    return (f"wandb: {state} {sync_dir}; open it with `wandb leet {Path(sync_dir).parent}`, "
            f"upload it with `{sync}`")


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
        self.mode = resolve_mode(mode)
        self.run = wandb.init(project=project, name=name, entity=entity, group=group,
                              mode=self.mode, dir=str(root.resolve()), config=config,
                              settings=wandb.Settings(silent=True, console="off"))
        # read while the run is live (a finished run may refuse): where its files go
        self.sync_dir = self.run.settings.sync_dir
        self.url = None if self.mode == "offline" else self.run.url
        self._say_where(finished=False)

    def _say_where(self, finished: bool) -> None:
        print(where_line(self.mode, self.sync_dir, self.url, finished), flush=True)

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
        self._say_where(finished=True)
        self._wandb.teardown()
