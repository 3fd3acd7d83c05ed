"""A run with W&B says where its W&B files went and how to open or upload them, at the start
and at the end; the directory it names is the run W&B wrote (W&B's own terminal reader,
`wandb leet inspect`, finds the logged metrics there)."""

import json
import subprocess
import sys
from pathlib import Path

from tests.helpers import LAUNCH_TIMEOUT_S


def test_an_offline_run_names_its_directory_and_the_commands(tmp_path, monkeypatch, capfd):
    from megatron_gnmr.observe.wandb_logger import WandbLogger

    monkeypatch.setenv("WANDB_API_KEY", "")
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc: offline by default
    logger = WandbLogger(tmp_path / "run", {"model": {"num_layers": 2}}, "gnmr-test", None,
                         None, None)
    start = [line for line in capfd.readouterr().out.splitlines() if line.startswith("wandb:")]
    logger.log(1, {"train/loss": 5.25})
    logger.close()
    end = [line for line in capfd.readouterr().out.splitlines() if line.startswith("wandb:")]

    (written,) = (tmp_path / "run" / "wandb").glob("offline-run-*")  # where W&B wrote it
    upload, open_it = f"`wandb sync {written}`", f"`wandb leet {written.parent}`"
    assert len(start) == 1 and f"files in {written};" in start[0]
    assert upload in start[0] and open_it in start[0]
    assert len(end) == 1 and f"saved in {written};" in end[0]
    assert upload in end[0] and open_it in end[0]

    wandb = Path(sys.executable).with_name("wandb")
    result = subprocess.run([str(wandb), "leet", "inspect", "--summary", "--json",
                             str(written)], capture_output=True, text=True,
                            timeout=LAUNCH_TIMEOUT_S)
    assert result.returncode == 0, result.stderr[-2000:]
    assert '"train/loss"' in result.stdout and "5.25" in json.dumps(json.loads(result.stdout))


def test_an_online_run_names_its_page():
    from megatron_gnmr.observe.wandb_logger import where_line

    line = where_line("online", "/r/wandb/run-1-x", "https://wandb.ai/e/p/runs/x", True)
    assert line.startswith("wandb: synced to https://wandb.ai/e/p/runs/x;")
    assert "`wandb sync /r/wandb/run-1-x`" in line
