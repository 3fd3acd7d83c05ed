"""Hugging Face interop at tensor-parallel size 2 (torchrun, 2 processes), judged by
transformers with tests/test_hf_interop.py's bound: a random transformers LLaMA imported and
read at TP 2 gives transformers' logits, and a run trained at TP 2 with the distributed
optimizer exports (resharded to one rank) to a model whose transformers logits equal ours
at TP 2."""

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from tests.helpers import LAUNCH_TIMEOUT_S, REPO, TINY, TORCHRUN, run_pretrain
from tests.test_hf_interop import BOUND, cli, random_llama, relative_gap, tokens

pytest.importorskip("transformers", reason="transformers is a test dependency "
                    "(pip install -e .[dev])")


def _logits_at_tp2(jobs: list[list[str]], leave_errors: bool = False) -> None:
    """hf_logits_worker.py's jobs in one launch; a job's traceback fails here unless its
    caller reads each job's LOGITS.pt.error itself (leave_errors)."""
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as file:
        json.dump(jobs, file)
    jobs_file = Path(file.name)
    try:
        result = subprocess.run(
            [TORCHRUN, "--standalone", "--nproc_per_node=2",
             str(REPO / "tests" / "distributed" / "hf_logits_worker.py"), str(jobs_file)],
            cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO)),
            capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)
    finally:
        jobs_file.unlink()
    assert result.returncode == 0, result.stderr[-5000:]
    errors = [Path(f"{job[2]}.error") for job in jobs]
    assert leave_errors or not any(e.exists() for e in errors), \
        "\n".join(e.read_text()[-3000:] for e in errors if e.exists())


def test_import_and_export_at_tp2_give_transformers_logits(tmp_path):
    from megatron_gnmr.interop.hf import judge

    random_llama(tmp_path / "hf")
    assert cli("import-hf", str(tmp_path / "hf"), str(tmp_path / "imported")) == 0
    run = tmp_path / "run"
    run_pretrain([*TINY, "--train-iters", "3", "--eval-interval", "100",
                  "--tensor-model-parallel-size", "2", "--use-distributed-optimizer",
                  "--save", str(run)], nproc=2)
    assert cli("export-hf", str(run), str(tmp_path / "exported"), "--dtype", "fp32") == 0
    jobs = []
    for name, vocab in (("imported", 600), ("run", 4096)):
        torch.save(tokens(vocab), tmp_path / f"{name}_tokens.pt")
        jobs.append([str(tmp_path / name), str(tmp_path / f"{name}_tokens.pt"),
                     str(tmp_path / f"{name}_logits.pt")])
    _logits_at_tp2(jobs)
    for name, hf in (("imported", "hf"), ("run", "exported")):
        theirs = judge.logits(judge.load(tmp_path / hf), torch.load(tmp_path /
                                                                    f"{name}_tokens.pt"))
        gap = relative_gap(torch.load(tmp_path / f"{name}_logits.pt"), theirs)
        print(f"\n{name} at TP 2: max |ours - transformers| / max |logit| = {gap:.2e}")
        assert gap <= BOUND, (name, gap)
    # the TP 2 run evaluated in this one process (torch_dist reshards to it): evaluate's
    # held-out loss is transformers' on the same sequences of the export
    from megatron_gnmr.evaluation.command import mean_loss
    from megatron_gnmr.evaluation.loaded_run import load_run
    from megatron_gnmr.training import distributed

    loaded = load_run(str(run), exact=True)
    try:
        valid = loaded.valid_split(sequences=8, seed=0)
        ours = mean_loss(loaded, valid, 8)
    finally:
        distributed.shutdown()
    theirs = judge.mean_loss(judge.load(tmp_path / "exported"), [valid[i] for i in range(8)])
    assert abs(ours - theirs) <= 1e-5 * theirs, (ours, theirs)
