"""Run the real entry point (in this process for one rank, as a user launches it for several,
or when asked) and read its results."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))

# The limit of any process a test launches: not a performance bound, only what ends a hung
# launch. The longest launch measured takes about 1-2 minutes on a quiet 2-core machine and
# 2.7 minutes beside the other test worker (the TP=2 batch of
# tests/distributed/test_precision_tp.py); CI allows 90 minutes for everything, of which the
# suite, the offline install and the newest megatron-core take about 50, so 15 minutes is
# over 5x the slowest measurement and leaves a hang the time to be reported (with its
# stacks: `launch`).
LAUNCH_TIMEOUT_S = 900

# A model small enough that a 2-process launch takes seconds; the data is the prepared
# Shakespeare corpus in the repository's cache (run_tests.sh prepares it).
TINY = [
    "--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "176",
    "--num-attention-heads", "4", "--num-query-groups", "2", "--seq-length", "64",
    "--micro-batch-size", "4", "--global-batch-size", "8", "--lr", "3e-3",
    "--lr-warmup-iters", "2", "--log-interval", "1", "--eval-iters", "2",
    "--data-cache-dir", str(REPO / ".cache" / "megatron_gnmr"),
    # the values the tests were written against, before the defaults became Megatron-LM's
    "--min-lr", "3e-4", "--lr-decay-style", "cosine", "--weight-decay", "0.1",
    "--adam-beta2", "0.95", "--num-workers", "0",
]


def run_pretrain(args: list[str], nproc: int = 1, check: bool = True,
                 timeout: int = LAUNCH_TIMEOUT_S,
                 extra_env: dict | None = None, torchrun_args: list[str] = (),
                 new_process: bool = False) -> subprocess.CompletedProcess:
    """Run the entry point: in this process when it is one rank with nothing special about
    its environment (seconds saved on every run: no interpreter start, no megatron import),
    else (or with `new_process`) as the user launches it, with torchrun for several ranks."""
    if nproc == 1 and not torchrun_args and not extra_env and not new_process:
        return _in_this_process(args, check)
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", **(extra_env or {}))
    script = str(REPO / "pretrain_llama.py")
    if nproc == 1 and not torchrun_args:
        command = [PYTHON, script, *args]
    else:
        command = [TORCHRUN, "--standalone", f"--nproc_per_node={nproc}", *torchrun_args,
                   script, *args]
    result = launch(command, env, timeout)
    if check and result.returncode != 0:
        raise AssertionError(f"{' '.join(command)} failed ({result.returncode}):\n"
                             f"{result.stdout[-3000:]}\n{result.stderr[-5000:]}")
    return result


def launch(command: list[str], env: dict, timeout: int) -> subprocess.CompletedProcess:
    """`subprocess.run` in the repository, output captured; a launch still running at
    `timeout` has every process of its tree print its Python stacks (faulthandler, on
    SIGABRT) before it ends, and the failure shows them: a hang says where it hung."""
    import signal

    import psutil

    env = dict(env, PYTHONFAULTHANDLER="1")
    with subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True) as process:
        try:
            out, err = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            tree = psutil.Process(process.pid).children(recursive=True)
            for member in [*tree, psutil.Process(process.pid)]:
                with contextlib.suppress(psutil.Error):
                    member.send_signal(signal.SIGABRT)
            try:
                out, err = process.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
                out, err = process.communicate()
            raise AssertionError(f"{' '.join(command)} still running after {timeout} s; "
                                 f"the stacks of its processes:\n{out[-3000:]}\n"
                                 f"{err[-30000:]}") from None
    return subprocess.CompletedProcess(command, process.returncode, out, err)


def _in_this_process(args: list[str], check: bool) -> subprocess.CompletedProcess:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = pretrain_in_process(args)
    result = subprocess.CompletedProcess(["pretrain_llama.py", *args], code, out.getvalue(),
                                         err.getvalue())
    if check and code != 0:
        raise AssertionError(f"pretrain_llama.py {' '.join(args)} failed ({code}):\n"
                             f"{result.stdout[-3000:]}\n{result.stderr[-5000:]}")
    return result


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def read_growing_jsonl(path: Path) -> list[dict]:
    """The whole records of a log a live run is still appending to: its last line may be
    half-written."""
    lines = path.read_text().split("\n")[:-1]  # what follows the last newline is unfinished
    return [json.loads(line) for line in lines if line.strip()]


def train_losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["train/loss"] for r in read_jsonl(run_dir / "metrics.jsonl")
            if "train/loss" in r}


def saved_weight_shapes(run_dir: Path) -> dict[str, tuple[int, ...]]:
    """The model tensors the run's newest checkpoint holds, name -> global shape, read from
    its files (torch_dist's index as torch writes it; a torch format's rank-0 shard)."""
    newest = sorted(Path(run_dir).glob("iter_*")) or \
        sorted((Path(run_dir) / "checkpoints").glob("iter_*"))
    if (newest[-1] / ".metadata").is_file():
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        index = FileSystemReader(str(newest[-1])).read_metadata()
        return {k: tuple(v.size) for k, v in index.state_dict_metadata.items()
                if isinstance(v, TensorStorageMetadata) and not k.startswith("optimizer.")}
    import torch

    shard = torch.load(newest[-1] / "rank_00000.pt", weights_only=True)["model"][0]
    return {k: tuple(v.shape) for k, v in shard.items() if torch.is_tensor(v)}


def trace_records(run_dir: Path) -> list[dict]:
    return [r for r in read_jsonl(run_dir / "gnmr_trace.jsonl") if r.get("type") != "header"]


def run_batch(runs: list[list[str]], nproc: int = 1, timeout: int = LAUNCH_TIMEOUT_S) -> None:
    """Train several configs in one launch (tests/distributed/batch_runner.py)."""
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as file:
        json.dump(runs, file)
    script = str(REPO / "tests" / "distributed" / "batch_runner.py")
    command = [PYTHON, script, file.name] if nproc == 1 else \
        [TORCHRUN, "--standalone", f"--nproc_per_node={nproc}", script, file.name]
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    result = launch(command, env, timeout)
    os.unlink(file.name)
    if result.returncode != 0:
        raise AssertionError(f"batch of {len(runs)} runs failed ({result.returncode}):\n"
                             f"{result.stdout[-3000:]}\n{result.stderr[-5000:]}")


def pretrain_in_process(args: list[str]) -> int:
    """The entry point in this process (a world of one): its exit status. Everything it
    leaves initialised (process group, megatron's parallel state) is torn down, so the next
    call starts clean (the environment: conftest's `_environment_as_found`). Read its output
    with pytest's `capfd`."""
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from pretrain_llama import main

    from megatron_gnmr.platform import attention_environment
    from megatron_gnmr.training import distributed

    # a model built earlier in this process (another run) must not decide this run's
    # attention backend: a launch starts without its record, and so does this run
    before = dict(os.environ)
    attention_environment.forget()
    try:
        main(args)
        return 0
    except SystemExit as exit:
        return exit.code
    finally:
        distributed.shutdown()
        os.environ.clear()
        os.environ.update(before)
