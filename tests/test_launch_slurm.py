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


def test_the_time_limit_requeues_only_after_the_ranks_have_saved(tmp_path):
    """USR1 (the time limit is near): the script sends SIGTERM to the training processes,
    which take a while to save and exit, and only then requeues the job. Fake srun, pkill and
    scontrol log each call in order; the fake training logs when it has saved. Before the
    fix the requeue came first, and Slurm ends a requeued job at once (SIGKILL after
    KillWait, ~30 s), cutting a large model's save short."""
    import signal
    import time

    fake, log, pid = tmp_path / "bin", tmp_path / "calls.log", tmp_path / "training.pid"
    fake.mkdir()
    scripts = {
        # the launch (srun ... torchrun ...) is the training: on SIGTERM it saves for a while
        "srun": f"""#!/bin/bash
if [ "$1" = "--overlap" ]; then shift 2; "$@"; exit 0; fi
echo $$ > {pid}
trap 'sleep 1; echo training-saved >> {log}; exit 0' TERM
echo srun-launch >> {log}
while true; do sleep 0.1; done
""",
        "pkill": f"#!/bin/bash\necho pkill >> {log}\nkill -TERM $(cat {pid})\n",
        "scontrol": f"#!/bin/bash\nif [ \"$1\" = requeue ]; then echo requeue >> {log}; "
                    "else echo node-a; fi\n",
    }
    for name, text in scripts.items():
        (fake / name).write_text(text)
        (fake / name).chmod(0o755)
    env = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}", "SAVE": str(tmp_path / "r"),
           "SLURM_JOB_NUM_NODES": "1", "SLURM_JOB_NODELIST": "node-a", "SLURM_JOB_ID": "7"}
    job = subprocess.Popen(["bash", str(SCRIPT)], env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while not (log.is_file() and "srun-launch" in log.read_text()):
        assert time.time() < deadline and job.poll() is None, job.communicate()
        time.sleep(0.1)
    job.send_signal(signal.SIGUSR1)
    out, err = job.communicate(timeout=120)
    calls = log.read_text().split()
    assert calls.index("pkill") < calls.index("training-saved") < calls.index("requeue"), \
        calls
    assert job.returncode == 0, err  # the training's status, not the trap's interruption
