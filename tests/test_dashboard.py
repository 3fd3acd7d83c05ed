"""The dashboards of a real tiny run (the controller, both monitor families, alarms, W&B
offline and TensorBoard): every panel of the W&B workspace and every chart of the TensorBoard
layout shows keys the run really logged, nothing it logged under gnmr/ or monitor/ is left
out, the workspace spec loads back with wandb-workspaces, the TensorBoard layout with
TensorBoard's own reader, and W&B's own terminal reader (`wandb leet inspect --summary`)
finds the workspace's keys in the offline run."""

import json
import re
import subprocess
from pathlib import Path

import pytest

from tests.helpers import LAUNCH_TIMEOUT_S, TINY, read_jsonl, run_pretrain

pytest.importorskip("wandb_workspaces", reason="wandb-workspaces is a dependency")

RUN = [*TINY, "--train-iters", "16", "--lr-warmup-iters", "1", "--eval-interval", "8",
       "--num-experts", "4", "--moe-aux-loss-coeff", "0.01", "--precision-recipe", "fp8-emulated",
       "--gnmr", "--gnmr-delta",
       "1", "--gnmr-warmup", "2", "--monitors", "attention,router", "--monitor-interval", "2",
       "--monitor-delta", "2", "--monitor-detector", "online", "--monitor-baseline-samples",
       "3", "--monitor-patience", "1", "--monitor-band", "0.5", "--image-interval", "8",
       "--wandb-project", "dashboard-test", "--wandb-mode", "offline"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("dashboard")
    run_pretrain([*RUN, "--tensorboard-dir", str(root / "tb"), "--save", str(root / "run")],
                 new_process=True)
    return root


def _scalar_keys(run_dir: Path) -> set[str]:
    return {k for r in read_jsonl(run_dir / "metrics.jsonl") if "event" not in r
            for k, v in r.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def _panels(spec_file: Path) -> dict[str, list[str]]:
    from megatron_gnmr.observe.dashboard import from_spec

    workspace = from_spec(spec_file.read_text())
    return {section.name: [getattr(p, "metric_regex", None) or p.media_keys[0]
                           for p in section.panels]
            for section in workspace.sections}


def test_the_workspace_shows_every_key_and_only_logged_keys(run, tmp_path):
    from megatron_gnmr.cli import main

    spec = tmp_path / "workspace.json"
    main(["dashboard", str(run / "run"), "--offline", str(spec)])
    panels = _panels(spec)
    assert {"Training", "GNMR controller", "Monitor: attention", "Monitor: router"} <= \
        set(panels)
    records = read_jsonl(run / "run" / "metrics.jsonl")
    assert any(r.get("event") == "alarm" for r in records), "the test needs an alarm"
    logged = _scalar_keys(run / "run") | {f"events/{r['event']}" for r in records
                                          if "event" in r} | {"gnmr/recovery_timeline"}
    patterns = [p for section in panels.values() for p in section]
    assert "events/(alarm|diverged|nonfinite_gradient|warning)" in patterns  # alarms shown
    for pattern in patterns:
        assert any(re.fullmatch(pattern, key) for key in logged), pattern
    unshown = [key for key in _scalar_keys(run / "run") if key.startswith(("gnmr/", "monitor/"))
               and not any(re.fullmatch(p, key) for p in patterns)]
    assert unshown == []


def test_wandbs_own_reader_finds_the_workspace_keys_in_the_offline_run(run, tmp_path):
    from megatron_gnmr.cli import main

    spec = tmp_path / "workspace.json"
    main(["dashboard", str(run / "run"), "--offline", str(spec)])
    wandb = Path(__import__("sys").executable).with_name("wandb")
    result = subprocess.run([str(wandb), "leet", "inspect", "--summary", "--json",
                             str(run / "run" / "wandb" / "latest-run")], capture_output=True,
                            text=True, timeout=LAUNCH_TIMEOUT_S)
    assert result.returncode == 0, result.stderr[-2000:]
    summary = json.loads(result.stdout)
    keys = set(_find_summary(summary))
    for pattern in (p for section in _panels(spec).values() for p in section):
        assert any(re.fullmatch(pattern, key) for key in keys), pattern


def _find_summary(document) -> dict:
    """The metrics mapping of `wandb leet inspect --summary --json` (its key names differ
    across wandb versions: the mapping holding train/loss)."""
    if isinstance(document, dict):
        if "train/loss" in document:
            return document
        for value in document.values():
            found = _find_summary(value)
            if found:
                return found
    if isinstance(document, list):
        for value in document:
            found = _find_summary(value)
            if found:
                return found
    return {}


def test_tensorboard_opens_on_the_layout_and_it_covers_the_run(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.custom_scalar import layout_pb2

    accumulator = EventAccumulator(str(run / "tb"), size_guidance={"tensors": 0, "scalars": 0})
    accumulator.Reload()
    [config] = accumulator.Tensors("custom_scalars__config__")
    layout = layout_pb2.Layout.FromString(config.tensor_proto.string_val[0])
    charts = {chart.title: list(chart.multiline.tag) for category in layout.category
              for chart in category.chart}
    categories = {category.title for category in layout.category}
    assert {"Training", "GNMR controller", "Monitor: attention", "Monitor: router"} == \
        categories
    tags = set(accumulator.Tags()["scalars"])
    for title, patterns in charts.items():
        assert any(re.fullmatch(p, tag) for p in patterns for tag in tags), title
    patterns = [p for ps in charts.values() for p in ps]
    unshown = [tag for tag in tags if tag.startswith(("gnmr/", "monitor/"))
               and not any(re.fullmatch(p, tag) for p in patterns)]
    assert unshown == []
