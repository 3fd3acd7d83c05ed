"""gpu_check's groups at a small size on a GPU: each runs where its backend does (Transformer
Engine's FP8, or torchao on CUDA) and skips elsewhere with the reason. Each group runs in a
process of its own, as `scripts/gpu_check.sh` would run it, and prints its rows; the
recovery rows (parts (a) and (d)) must pass and no row may fail to run. Speed is not judged at
this size."""

import json
import subprocess
import sys

import pytest

from megatron_gnmr.gpu_check.table import CANNOT_RUN, PASS
from megatron_gnmr.platform import capabilities
from megatron_gnmr.precision.torchao_compat import torchao_version
from tests.helpers import LAUNCH_TIMEOUT_S, REPO

# TE's FP8 GEMMs want dims in multiples of 16 and tokens in multiples of 8.
SMALL = ["--num-layers", "2", "--hidden-size", "128", "--ffn-hidden-size", "256",
         "--num-attention-heads", "4", "--num-query-groups", "2", "--seq-length", "128",
         "--micro-batch-size", "2", "--global-batch-size", "2", "--bf16", "--lr", "1e-3"]
SCRIPT = """
import json, sys
from megatron_gnmr.gpu_check.check import base_flags
from megatron_gnmr.gpu_check.groups import groups, run_group
model = json.loads(sys.argv[2])
chosen = groups(base_flags(model, 3, 2, 2), "bf16", "inductor")[int(sys.argv[1])]
rows = run_group(chosen, 3, 2, 2, judge=False)
print("ROWS " + json.dumps([row.__dict__ for row in rows]))
"""
te_fp8 = capabilities.te_recipe("tensorwise")
needs_te_fp8 = pytest.mark.skipif(not te_fp8, reason=te_fp8.reason)
needs_torchao_on_cuda = pytest.mark.skipif(
    not capabilities.cuda() or torchao_version() is None,
    reason=capabilities.cuda().reason if not capabilities.cuda() else "torchao is not installed")


def _group_rows(index: int) -> list[dict]:
    result = subprocess.run([sys.executable, "-c", SCRIPT, str(index), json.dumps(SMALL)],
                            cwd=REPO, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)
    assert result.returncode == 0, result.stderr[-3000:]
    line = next(line for line in result.stdout.splitlines() if line.startswith("ROWS "))
    return json.loads(line[len("ROWS "):])


def _assert_recovery_passes(rows: list[dict], part: str) -> None:
    assert not [row for row in rows if row["status"] == CANNOT_RUN], rows
    recovery = [row for row in rows if row["part"] == part]
    assert len(recovery) == 4 and all(row["status"] == PASS for row in recovery), recovery


@needs_te_fp8
def test_te_fp8_recovered_units_are_te_bf16_bitwise_and_return_to_fresh_fp8():
    _assert_recovery_passes(_group_rows(0), "(a) te-fp8 recovery")


@needs_torchao_on_cuda
def test_torchao_recovered_units_are_bf16_bitwise_under_compiled_layers():
    _assert_recovery_passes(_group_rows(1), "(d) torchao recovery")
