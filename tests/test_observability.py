"""W&B offline runs read back with wandb's own schema, TensorBoard scalars, and the report."""

import subprocess
import sys
import time
import uuid

import numpy as np
import psutil
import pytest

from tests.helpers import LAUNCH_TIMEOUT_S, REPO, TINY, run_pretrain
from tests.wandb_offline_reader import read_offline_run

GNMR = ["--gnmr", "--gnmr-delta", "2", "--gnmr-warmup", "3", "--gnmr-alpha", "1.2",
        "--gnmr-beta", "1.1", "--gnmr-max-o", "2"]


def _processes_of_this_run(marker: str) -> list[str]:
    """The processes alive that inherited `marker` from the run's environment (as wandb-core
    does): those of the other tests running beside this one (wandb's, too) do not count."""
    found = []
    for process in psutil.process_iter(["pid", "cmdline"]):
        try:
            if process.environ().get("GNMR_TEST_RUN_MARKER") == marker:
                found.append(f"{process.info['pid']} {' '.join(process.info['cmdline'])}")
        except psutil.Error:  # exited, or not ours to read
            continue
    return found


@pytest.fixture(scope="module")
def logged_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("wandb_run")
    marker = uuid.uuid4().hex
    run_pretrain([*TINY, *GNMR, "--train-iters", "8", "--eval-interval", "4",
                  "--save", str(run_dir), "--wandb-project", "gnmr-test", "--wandb-mode",
                  "offline", "--tensorboard-dir", str(run_dir / "tb"), "--image-interval", "4"],
                 extra_env={"WANDB_API_KEY": "", "GNMR_TEST_RUN_MARKER": marker})
    return run_dir, marker


def test_wandb_offline_run_has_the_metrics_and_no_process_is_left(logged_run):
    run_dir, marker = logged_run
    offline = list((run_dir / "wandb").glob("offline-run-*"))
    assert len(offline) == 1
    run = read_offline_run(offline[0])
    keys = {k for row in run["history"] for k in row}
    for key in ("train/loss", "train/lr", "train/grad_norm", "train/tokens_per_s",
                "train/step_time_s", "valid/loss", "gnmr/recovery_size",
                "gnmr/recovery_sparsity", "gnmr/exceedance_rate", "gnmr/pool_size"):
        assert key in keys, key
    images = [row for row in run["history"] if "gnmr/recovery_timeline/_type" in row]
    assert [row["_step"] for row in images] == [4, 8]
    assert images[0]["gnmr/recovery_timeline/_type"] == "image-file"
    assert (offline[0] / "files" / images[0]["gnmr/recovery_timeline/path"]).is_file()
    losses = [row["train/loss"] for row in run["history"] if "train/loss" in row]
    assert len(losses) == 8 and all(np.isfinite(losses))
    assert run["config"]["gnmr"]["enabled"] is True  # the full run config
    assert run["config"]["model"]["num_layers"] == 2
    assert "final_valid_loss" in run["summary"]
    deadline = time.monotonic() + 60  # wandb-core exits asynchronously after teardown
    while _processes_of_this_run(marker) and time.monotonic() < deadline:
        time.sleep(0.25)
    assert not _processes_of_this_run(marker)


def test_tensorboard_has_the_same_scalars(logged_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir, _ = logged_run
    events = EventAccumulator(str(run_dir / "tb"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "valid/loss", "gnmr/recovery_size", "gnmr/exceedance_rate"} <= tags
    assert len(events.Scalars("train/loss")) == 8


def test_report_of_two_runs_has_every_panel(logged_run, tmp_path):
    from matplotlib.image import imread

    from megatron_gnmr.observe.report import load_run, render_report

    run_dir, _ = logged_run
    static = tmp_path / "static"
    run_pretrain([*TINY, "--train-iters", "8", "--eval-interval", "4", "--save", str(static)])
    titles = [ax.get_title() for ax in render_report([load_run(run_dir),
                                                      load_run(static)]).axes]
    for panel in ("Loss", "GNMR score distribution", f"Recovery timeline: {run_dir.name}",
                  "Recovery timeline: static", "Monitor signals"):
        assert any(t.startswith(panel) for t in titles), (panel, titles)

    out = tmp_path / "report.png"
    cli = subprocess.run([sys.executable, "-m", "megatron_gnmr.cli", "report", str(run_dir),
                          str(static), "--out", str(out)], cwd=REPO, capture_output=True,
                         text=True, timeout=LAUNCH_TIMEOUT_S)
    assert cli.returncode == 0, cli.stderr
    image = imread(out)
    assert image.shape[0] > 1000 and image.shape[1] > 1000
    assert image[..., :3].std() > 0.05  # not blank


def test_report_reads_a_crashed_run(logged_run, tmp_path):
    import shutil

    from megatron_gnmr.observe.report import load_run

    run_dir, _ = logged_run
    crashed = tmp_path / "crashed"
    shutil.copytree(run_dir, crashed, ignore=shutil.ignore_patterns("wandb*", "tb"))
    for name in ("metrics.jsonl", "gnmr_trace.jsonl"):
        text = (crashed / name).read_text()
        (crashed / name).write_text(text[: len(text) - 25])  # cut mid-line, as a kill would
    run = load_run(str(crashed))
    assert run.recovery is not None and len(run.records) > 5


def test_report_names_a_bad_directory(tmp_path):
    cli = subprocess.run([sys.executable, "-m", "megatron_gnmr.cli", "report",
                          str(tmp_path / "nope")], cwd=REPO, capture_output=True, text=True)
    assert cli.returncode == 2 and "metrics.jsonl" in cli.stderr


def test_recovery_shares_per_kind_of_unit():
    import numpy as np

    from megatron_gnmr.observe.report import RunLog, recovery_shares, shares_line

    units = ["layers.0.self_attention.linear_qkv", "layers.0.mlp.linear_fc1",
             "layers.1.self_attention.linear_proj", "layers.1.mlp.shared_experts.linear_fc1",
             "layers.1.mlp.experts.0.linear_fc1", "layers.1.mlp.experts.1.linear_fc2"]
    recovery = np.zeros((4, 6), dtype=bool)
    recovery[1, 0] = recovery[2, 4] = recovery[3, 4] = recovery[3, 5] = True
    run = RunLog("moe", [], units, recovery, None, None)
    assert recovery_shares(run) == {"attention": (1, 8), "dense MLP": (0, 4),
                                    "shared expert": (0, 4), "routed experts": (3, 8)}
    assert shares_line(run) == ("attention 12.5%, dense MLP 0.0%, shared expert 0.0%, "
                                "routed experts 37.5%")
