"""Per-unit norms under TP=2 and expert parallelism: exact against a float64 reference,
one collective per step."""

import json
import subprocess

import numpy as np
import pytest

from tests.helpers import REPO, TINY, TORCHRUN

LAYOUTS = {
    "tp2": (["--tensor-model-parallel-size", "2"], 8),
    # MoE: 2 attention units + 4 experts x (fc1, fc2) per layer, experts split over 2 EP ranks
    "moe_ep2": (["--num-experts", "4", "--expert-model-parallel-size", "2"], 20),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_unit_norms_and_one_collective(layout):
    flags, num_units = LAYOUTS[layout]
    command = [TORCHRUN, "--standalone", "--nproc_per_node=2",
               str(REPO / "tests" / "distributed" / "grad_stats_script.py"), *TINY,
               "--train-iters", "4", *flags, "--gnmr", "--gnmr-agreement-interval", "0"]
    out = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300,
                         env={**__import__("os").environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr[-4000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    # The whole controlled optimizer step (statistics, decision, clipping, update) makes
    # exactly one collective: the all-reduce of the per-unit squared norms.
    assert result["collectives"] == ["all_reduce"]
    np.testing.assert_allclose(result["norms"], result["reference"], rtol=1e-5)
    assert len(result["norms"]) == num_units and min(result["norms"]) > 0
    assert result["total"] > np.linalg.norm(result["norms"])  # + embeddings, norms, head
