"""A mistake under torchrun: the agent's failure summary names our one line as the root cause.

torch elastic's agent reads each worker's cause of failure from the file TORCHELASTIC_ERROR_FILE
names; without one it printed `error_file: <N/A>` and a link to its docs as the root cause,
burying the one good line above it. The judge is torch's own code: its ProcessFailure and
ChildFailedError read the files our workers write (in-process), and torchrun itself prints
the summary (a 2-process launch). A plain launch writes no file and stays one line.
"""

import pytest

from megatron_gnmr.errors import RunAborted, UserError, exits_cleanly_on_user_error
from tests.helpers import LAUNCH_TIMEOUT_S, PYTHON, TORCHRUN, launch

ROOT_CAUSE = "Root Cause (first observed failure):"


def _fail_with(error: Exception):
    @exits_cleanly_on_user_error
    def main():
        raise error

    return main


def _worker(monkeypatch, tmp_path, rank: int, error: Exception):
    """Run a failing entry point as torchrun's worker `rank`; torch's view of its failure."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    error_file = tmp_path / f"rank{rank}" / "error.json"
    error_file.parent.mkdir()
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    with pytest.raises(SystemExit) as exit:
        _fail_with(error)()
    return ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=exit.value.code,
                          error_file=str(error_file))


def test_the_agent_reads_our_line_as_the_workers_traceback(monkeypatch, tmp_path):
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    failure = _worker(monkeypatch, tmp_path, 0, UserError("--lr: must be >= 0, got -1"))
    assert failure.exitcode == 2
    summary = ChildFailedError("pretrain_llama.py", {0: failure}).format_msg()
    root = summary.split(ROOT_CAUSE)[1]
    assert "traceback : error: --lr: must be >= 0, got -1\n" in root
    assert "<N/A>" not in root

    stopped = _worker(monkeypatch, tmp_path, 1, RunAborted("the loss is NaN"))
    assert stopped.exitcode == 3
    assert ChildFailedError("x", {1: stopped}).get_first_failure()[1].message[
        "extraInfo"]["py_callstack"] == "stopped: the loss is NaN"


def test_a_lost_peer_is_never_the_root_cause_of_its_peers_failure(monkeypatch, tmp_path):
    """Rank 1 refuses its input; rank 0, in a collective with it, loses its peer in the same
    second and is listed first (the agent polls workers in rank order): rank 1 is the cause."""
    import time

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    monkeypatch.setattr(time, "time", lambda: 1_800_000_000.5)
    cause = _worker(monkeypatch, tmp_path, 1, UserError("--data-path x: no x.bin"))
    lost = _worker(monkeypatch, tmp_path, 0, RuntimeError("[gloo] Connection closed by peer"))
    assert lost.exitcode == 1
    rank, first = ChildFailedError("x", {0: lost, 1: cause}).get_first_failure()
    assert rank == 1 and first.message["message"] == "error: --data-path x: no x.bin"


def test_a_plain_launch_writes_no_error_file_and_prints_one_line(monkeypatch, tmp_path, capfd):
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit:
        _fail_with(UserError("--lr: must be >= 0, got -1"))()
    assert exit.value.code == 2
    assert capfd.readouterr().err == "error: --lr: must be >= 0, got -1\n"
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_torchrun_names_our_line_as_the_root_cause():
    import os

    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    env.pop("TORCHELASTIC_ERROR_FILE", None)
    result = launch([TORCHRUN, "--standalone", "--nproc_per_node=2", "pretrain_llama.py",
                     "--config", "configs/tiny_cpu.yaml", "--no-such-flag"], env,
                    LAUNCH_TIMEOUT_S)
    assert result.returncode != 0
    assert ROOT_CAUSE in result.stderr, result.stderr[-3000:]
    root = result.stderr.split(ROOT_CAUSE)[1]
    line = "error: unrecognized arguments: --no-such-flag (see --help)"
    assert f"traceback : {line}\n" in root, result.stderr[-3000:]
    assert "error_file: <N/A>" not in root
    # the plain launch: the same one line, nothing else of ours
    plain = launch([PYTHON, "pretrain_llama.py", "--config", "configs/tiny_cpu.yaml",
                    "--no-such-flag"], env, LAUNCH_TIMEOUT_S)
    assert plain.returncode == 2
    assert [x for x in plain.stderr.splitlines() if x.startswith("error:")] == [line]
    assert "Traceback" not in plain.stderr
