"""scripts/launch_slurm.sh builds the launch it documents: torchrun on every node of the
allocation it got (a requeued job may get fewer), resuming from --save, restarts within the
allocation; and refuses to start without a run directory. The preemption path it triggers
(SIGTERM to the training processes) is tested on real processes in
tests/distributed/test_dist_checkpoint.py."""

import os
import subprocess

from tests.helpers import REPO

SCRIPT = REPO / "scripts" / "launch_slurm.sh"


def _run(tmp_path, env: dict, *args: str) -> subprocess.CompletedProcess:
    fake = tmp_path / "bin"
    fake.mkdir(exist_ok=True)
    # a large allocation's host list: a reader that stops at the first line would leave
    # scontrol writing into a closed pipe (SIGPIPE, which pipefail makes the script's status)
    (fake / "scontrol").write_text("#!/bin/sh\necho node-a\ni=0\nwhile [ $i -lt 20000 ]; do "
                                   "echo node-b$i; i=$((i + 1)); done\n")
    (fake / "scontrol").chmod(0o755)
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True,
                          env={**os.environ, "PATH": f"{fake}:{os.environ['PATH']}",
                               "DRY_RUN": "1", **env})


def test_the_launch_fits_the_allocation_and_resumes(tmp_path):
    result = _run(tmp_path, {"SAVE": "/runs/x", "SLURM_JOB_NUM_NODES": "3",
                             "SLURM_JOB_NODELIST": "node-[a-c]", "SLURM_JOB_ID": "42",
                             "GPUS_PER_NODE": "8"}, "--config", "configs/llama2_7b.yaml")
    assert result.returncode == 0, result.stderr
    command = result.stdout.split()
    assert "--nnodes=3" in command and "--nproc_per_node=8" in command
    assert "--rdzv_endpoint=node-a:29500" in command and "--rdzv_id=42" in command
    assert command[-4:] == ["--save", "/runs/x", "--resume", "auto"]
    assert any(part.startswith("--max-restarts=") for part in command)


def test_it_refuses_to_start_without_a_run_directory(tmp_path):
    result = _run(tmp_path, {"SLURM_JOB_NUM_NODES": "2"})
    assert result.returncode != 0 and "SAVE" in result.stderr
