"""One live job per run directory (issue 51): a `kill -9` to a torchrun job's process group
(the agent) ends its workers too, each saving the step it was in, and a second launch into a
run directory a live job holds is refused in one line naming the holder; a lock left by a
dead job is taken over. Before: the orphaned workers trained on, and a relaunch trained beside
them into the same directory."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

from tests.helpers import REPO, TINY, TORCHRUN, pretrain_in_process, read_jsonl, train_losses

LONG = [*TINY, "--tensor-model-parallel-size", "2", "--train-iters", "100",
        "--eval-interval", "1000", "--save-interval", "2", "--keep-last", "2"]


def _workers(save) -> list[int]:
    """The job's worker processes (and the checkpoint writer's helper process each starts)."""
    found = subprocess.run(["pgrep", "-f", f"pretrain_llama.py .*--save {save}"],
                           capture_output=True, text=True).stdout.split()
    agents = subprocess.run(["pgrep", "-f", f"torchrun.*--save {save}"], capture_output=True,
                            text=True).stdout.split()
    return [int(p) for p in found if p not in agents]


def _wait_for(condition, seconds: float, what: str):
    deadline = time.time() + seconds
    while not condition():
        assert time.time() < deadline, f"waited {seconds:.0f} s for {what}"
        time.sleep(0.2)


def test_a_killed_agent_takes_its_workers_and_a_second_launch_is_refused(tmp_path, capfd):
    save = tmp_path / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    job = subprocess.Popen([TORCHRUN, "--standalone", "--nproc_per_node=2",
                            str(REPO / "pretrain_llama.py"), *LONG, "--save", str(save)],
                           env=env, cwd=REPO, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        _wait_for(lambda: (save / "iter_0000004").is_dir(), 600, "the job's second checkpoint")
        holder = json.loads((save / "job.lock").read_text())
        assert holder["host"] == socket.gethostname() and holder["pid"] in _workers(save)

        # a second launch while the job lives: one line naming the holder, nothing written
        assert pretrain_in_process([*TINY, "--train-iters", "4", "--save", str(save),
                                    "--resume", "auto"]) == 2
        error = [line for line in capfd.readouterr().err.strip().splitlines()
                 if not line.startswith("notice: ")]  # the start notice is no error
        assert len(error) == 1 and "in use by a live job" in error[0]
        assert f"pid {holder['pid']}" in error[0] and holder["host"] in error[0]

        os.killpg(job.pid, signal.SIGKILL)  # the agent and whatever shares its group
        job.wait(timeout=60)
        _wait_for(lambda: not _workers(save), 120, "the orphaned workers to end")
        assert not (save / "job.lock").exists()  # released by the worker that held it
        exits = [r for r in read_jsonl(save / "metrics.jsonl") if r.get("event") == "exit"]
        assert exits and exits[-1]["reason"].startswith("SIGTERM"), exits  # saved, not crashed
        reached = max(int(p.name[len("iter_"):]) for p in save.glob("iter_0*")
                      if p.name[len("iter_"):].isdigit())
        assert exits[-1]["step"] == reached  # the step the workers were in, saved
        time.sleep(2)  # nobody writes into it any more
        assert max(int(p.name[len("iter_"):]) for p in save.glob("iter_0*")
                   if p.name[len("iter_"):].isdigit()) == reached
    finally:
        for pid in _workers(save):
            os.kill(pid, signal.SIGKILL)
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    # the relaunch resumes from the step the workers saved and finishes the run
    result = subprocess.run([TORCHRUN, "--standalone", "--nproc_per_node=2",
                             str(REPO / "pretrain_llama.py"), *LONG, "--save", str(save),
                             "--resume", "auto"], env=env, cwd=REPO, capture_output=True,
                            text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    assert max(train_losses(save)) == 100 and (save / "summary.json").is_file()


def test_a_lock_left_by_a_dead_job_is_taken_over(tmp_path, capfd):
    save = tmp_path / "run"
    save.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (save / "job.lock").write_text(json.dumps({"host": socket.gethostname(), "pid": dead.pid,
                                               "job": None, "attempt": 0,
                                               "started": "earlier"}))
    assert pretrain_in_process([*TINY, "--train-iters", "3", "--eval-interval", "3",
                                "--save", str(save)]) == 0
    assert f"pid {dead.pid} taken over (its process has ended)" in capfd.readouterr().err
    assert not (save / "job.lock").exists()
