"""scripts/gpu_check.sh's program, run in its CPU smoke mode so that the one prepared GPU
check cannot rot between GPU loans: every available backend trains, its recovered units
equal their high-precision layer bitwise, an async save resumes bit for bit and a checkpoint
resumes in another process, and the table says what it could not run."""

import subprocess
import sys

from tests.helpers import LAUNCH_TIMEOUT_S, REPO


def test_gpu_check_smoke_runs_every_available_backend(tmp_path):
    out = tmp_path / "gpu_check.md"
    result = subprocess.run([sys.executable, "-m", "megatron_gnmr.experiments.gpu_check",
                             "--smoke", "--out", str(out)], cwd=REPO, capture_output=True,
                            text=True, timeout=LAUNCH_TIMEOUT_S, env={"OMP_NUM_THREADS": "1",
                                                         "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    table = out.read_text()
    rows = {line.split("|")[1].strip(): line for line in table.splitlines()
            if line.startswith("| fp")}
    assert set(rows) == {"fp32", "fp8-emulated", "fp8-torchao", "fp8-torchao+gnmr"}
    assert "| yes | yes |" in rows["fp8-torchao"]  # recovery bitwise BF16, low path differs
    assert all("| yes |" in row for row in rows.values())  # within the loss tolerance
    checks = [line for line in table.splitlines() if line.startswith(("| save", "| resume"))]
    assert len(checks) == 2 and all(line.endswith("| yes |") for line in checks), checks
    assert "bound 0)" in checks[0]  # on the CPU a resume is bit for bit
    assert "not run: te-fp8: Transformer Engine needs CUDA" in table
    assert table.rstrip().endswith("verdict: OK")
