"""Per-unit norms under every layout that changes where gradients live (TP, expert
parallelism, sequence parallelism, the distributed optimizer's shards): exact against a
float64 reference, in one collective per controlled step."""

import json
import os
import subprocess

import numpy as np
import pytest

from tests.helpers import LAUNCH_TIMEOUT_S, REPO, TINY, TORCHRUN

TP2 = ["--tensor-model-parallel-size", "2"]
MOE = ["--num-experts", "4", "--moe-aux-loss-coeff", "0.01"]
DISTOPT = ["--use-distributed-optimizer"]
LAYOUTS = {  # name: (flags, processes, units)
    "tp2": (TP2, 2, 8),
    # MoE: 2 attention units + 4 experts x (fc1, fc2) per layer, experts split over 2 EP ranks
    "moe_ep2": ([*MOE, "--expert-model-parallel-size", "2"], 2, 20),
    # MoE x TP: megatron requires sequence parallelism; experts are TP-split too
    "moe_tp2_sp": ([*MOE, *TP2, "--sequence-parallel"], 2, 20),
    # the distributed optimizer: each DP rank holds a shard of every reduced gradient
    "dp2_distopt": (DISTOPT, 2, 8),
    # ... with dense parameters sharded over 2 ranks and experts (EP=2) over 1
    "moe_ep2_distopt": ([*MOE, "--expert-model-parallel-size", "2", *DISTOPT], 2, 20),
    # TP=2 x DP=2: sequence parallelism and optimizer shards together (4 processes)
    "tp2_sp_dp2_distopt": ([*TP2, "--sequence-parallel", *DISTOPT], 4, 8),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_unit_norms_and_one_collective(layout):
    flags, processes, num_units = LAYOUTS[layout]
    command = [TORCHRUN, "--standalone", f"--nproc_per_node={processes}",
               str(REPO / "tests" / "distributed" / "grad_stats_script.py"), *TINY,
               "--global-batch-size", str(4 * processes), "--train-iters", "4", *flags,
               "--gnmr", "--gnmr-agreement-interval", "0"]
    out = subprocess.run(command, cwd=REPO, capture_output=True, text=True,
                         timeout=LAUNCH_TIMEOUT_S, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr[-4000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    # The controller's whole part of the step (statistics, decision, clipping) makes exactly
    # one collective: the all-reduce of the per-unit squared norms.
    assert result["controller_collectives"] == ["all_reduce"]
    # ... and the update none of these (megatron's distributed optimizer gathers the new
    # weight shards through functions it bound at import, which this count does not see).
    assert result["step_collectives"] == []
    np.testing.assert_allclose(result["norms"], result["reference"], rtol=1e-5)
    assert len(result["norms"]) == num_units and min(result["norms"]) > 0
    assert result["total"] > np.linalg.norm(result["norms"])  # + embeddings, norms, head
    assert result["skipped"] == 0
