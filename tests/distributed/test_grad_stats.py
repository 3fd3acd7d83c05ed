"""Per-unit norms under TP=2: exact against a float64 reference, one collective per step."""

import json
import subprocess

import numpy as np

from tests.helpers import REPO, TINY, TORCHRUN


def test_unit_norms_and_one_collective_tp2():
    command = [TORCHRUN, "--standalone", "--nproc_per_node=2",
               str(REPO / "tests" / "distributed" / "grad_stats_script.py"), *TINY,
               "--train-iters", "4", "--tensor-model-parallel-size", "2", "--gnmr",
               "--gnmr-agreement-interval", "0"]
    out = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300,
                         env={**__import__("os").environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr[-4000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    # The whole controlled optimizer step (statistics, decision, clipping, update) makes
    # exactly one collective: the all-reduce of the per-unit squared norms.
    assert result["collectives"] == ["all_reduce"]
    np.testing.assert_allclose(result["norms"], result["reference"], rtol=1e-5)
    assert len(result["norms"]) == 8 and min(result["norms"]) > 0
    assert result["total"] > np.linalg.norm(result["norms"])  # + embeddings, norms, head
