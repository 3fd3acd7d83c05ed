"""`megatron-gnmr dashboard RUN_DIR --entity E --project P`: the product's dashboard layout
(`observe/dashboard_layout.py`) saved as a W&B workspace with `wandb-workspaces`, W&B's
library for workspaces as code; `--offline FILE` writes the workspace's spec as JSON instead
(no network: an offline cluster saves it later with `--from-spec FILE`). TensorBoard gets the
same layout as custom scalars, written into `--tensorboard-dir` at the start of every run
(`custom_scalars`).

The workspace shows the charts the run in RUN_DIR logged (every layer of a signal on one
chart, by regex), the alarm events as markers (W&B logs 1 under `events/alarm` at each alarm's
step), the run's evaluation as text when it has one, and groups runs by their W&B group
(`--wandb-group`, e.g. the scenario's variant).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from megatron_gnmr.errors import UserError
from megatron_gnmr.jsonl import read_jsonl
from megatron_gnmr.observe.dashboard_layout import Section, layout, sections_for_run_config

IMAGE_KEYS = ("gnmr/recovery_timeline",)


def custom_scalars(sections: list[Section]) -> dict:
    """TensorBoard's custom-scalars layout (`SummaryWriter.add_custom_scalars`): one category
    per section, one multiline chart per line chart, its tags a regex."""
    return {section.name: {chart.title: ["Multiline", [chart.pattern]]
                           for chart in section.charts if chart.kind == "line"}
            for section in sections if any(c.kind == "line" for c in section.charts)}


def logged_keys(run_dir: Path) -> set[str]:
    """The keys a run sent to W&B: its scalars, its events (`events/KIND`) and, with the
    controller's images on, the recovery timeline."""
    records = read_jsonl(run_dir / "metrics.jsonl")
    keys = {key for record in records if "event" not in record for key, value in record.items()
            if isinstance(value, (int, float)) and not isinstance(value, bool)}
    keys |= {f"events/{record['event']}" for record in records if "event" in record}
    config = json.loads((run_dir / "config.json").read_text())
    if config["gnmr"]["enabled"] and config["logging"]["image_interval"]:
        keys |= set(IMAGE_KEYS)
    return keys - {"step", "time"}


def workspace(run_dir: Path, entity: str, project: str, name: str):
    """The W&B workspace (a `wandb_workspaces.workspaces.Workspace`) for runs like RUN_DIR."""
    try:
        import wandb_workspaces.reports.v2 as wr
        import wandb_workspaces.workspaces as ws
    except ImportError:
        raise UserError("dashboard needs wandb-workspaces: pip install wandb-workspaces") \
            from None
    line = lambda c: wr.LinePlot(title=c.title, metric_regex=c.pattern)  # noqa: E731
    panels_of = {"line": line, "events": line,
                 "image": lambda c: wr.MediaBrowser(title=c.title, media_keys=[c.pattern])}
    sections = [ws.Section(name=s.name, is_open=True,
                           panels=[panels_of[c.kind](c) for c in s.charts])
                for s in layout(logged_keys(run_dir))]
    evaluation = run_dir / "evaluation.json"
    if evaluation.is_file():
        scores = json.loads(evaluation.read_text())
        text = "\n".join(f"- {key}: {value}" for key, value in scores.items()
                         if isinstance(value, (int, float, str)))
        sections.append(ws.Section(name="Evaluation", is_open=True, panels=[
            wr.MarkdownPanel(markdown=f"**megatron-gnmr evaluate {run_dir.name}**\n\n{text}")]))
    return ws.Workspace(entity=entity, project=project, name=name, sections=sections,
                        runset_settings=ws.RunsetSettings(groupby=[ws.Metric("Group")]))


def spec(workspace_) -> str:
    """The workspace as wandb-workspaces' own JSON model (what `save` sends)."""
    return workspace_._to_model().model_dump_json(by_alias=True, indent=1)


def from_spec(text: str):
    """A workspace back from `spec`'s JSON."""
    from wandb_workspaces.workspaces import Workspace, internal

    return Workspace._from_model(internal.View.model_validate_json(text))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", nargs="?", help="a run whose keys the dashboard shows "
                        "(any run of the kind you will watch)")
    parser.add_argument("--entity", help="W&B entity (user or team)")
    parser.add_argument("--project", help="W&B project")
    parser.add_argument("--name", default="megatron-gnmr", help="the workspace's name")
    parser.add_argument("--offline", metavar="FILE", help="write the workspace spec as JSON "
                        "here instead of saving it to W&B (no network)")
    parser.add_argument("--from-spec", metavar="FILE", help="save a spec written with "
                        "--offline (on a machine that reaches W&B)")


def run(args: argparse.Namespace):
    if args.from_spec:
        path = Path(args.from_spec)
        if not path.is_file():
            raise UserError(f"dashboard --from-spec {path}: no such file")
        loaded = from_spec(path.read_text())
        loaded.entity = args.entity or loaded.entity
        loaded.project = args.project or loaded.project
        saved = loaded.save()
        print(f"dashboard: saved {saved.url}")
        return saved
    if not args.run_dir or not (Path(args.run_dir) / "metrics.jsonl").is_file():
        raise UserError(f"dashboard {args.run_dir or ''}: give a run directory (the --save "
                        "of a run, with its metrics.jsonl)")
    if not args.offline and not (args.entity and args.project):
        raise UserError("dashboard: give --entity and --project (or --offline FILE)")
    built = workspace(Path(args.run_dir), args.entity or "offline", args.project or "offline",
                      args.name)
    if args.offline:
        Path(args.offline).write_text(spec(built))
        print(f"dashboard: workspace spec written to {args.offline} (save it later with "
              f"megatron-gnmr dashboard --from-spec {args.offline})")
        return built
    saved = built.save()
    print(f"dashboard: saved {saved.url}")
    return saved


def tensorboard_layout(config: dict) -> dict:
    """The custom-scalars layout a run of this config writes at its start."""
    return custom_scalars(sections_for_run_config(config))
