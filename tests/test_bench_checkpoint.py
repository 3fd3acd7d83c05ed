"""`scripts/bench_checkpoint.py` runs end to end (it once broke without anyone noticing): at
8x512, one repeat, it prints its table with every form, and the sizes it reports are the
model's (checked against a count of the parameters by hand: fp32 weights and Adam's two
moments, 12 bytes per parameter, one copy in torch_dist and one per DP rank in torch)."""

import re
import subprocess
import sys

import pytest

from tests.helpers import LAUNCH_TIMEOUT_S, REPO

pytestmark = pytest.mark.slow  # a torchrun launch of six runs

VOCABULARY = 4096  # the prepared Shakespeare corpus's tokenizer (a multiple of 128: no padding)


def _parameters(layers: int, hidden: int, ffn: int) -> int:
    """A LLaMA of that shape (every head a KV head, untied embeddings): per layer the QKV and
    output projections (4 h^2), SwiGLU's three h x ffn GEMMs, two RMSNorms; the embedding,
    the output layer and the final norm."""
    per_layer = 4 * hidden * hidden + 3 * hidden * ffn + 2 * hidden
    return layers * per_layer + 2 * VOCABULARY * hidden + hidden


def test_bench_checkpoint_prints_its_table_at_8x512():
    result = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_checkpoint.py"),
                             "--size", "8x512", "--repeats", "1"], cwd=REPO,
                            capture_output=True, text=True, timeout=4 * LAUNCH_TIMEOUT_S)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = {}
    for line in result.stdout.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if cells[0] in ("torch", "torch_dist", "torch_dist async"):
            rows[cells[0]] = cells
    assert sorted(rows) == ["torch", "torch_dist", "torch_dist async"], result.stdout
    mib = {form: float(re.fullmatch(r"([\d.]+) MiB", cells[1]).group(1))
           for form, cells in rows.items()}
    expected = 12 * _parameters(8, 512, 1408) / 2**20
    assert abs(mib["torch_dist"] - expected) < 0.01 * expected, (mib, expected)
    assert abs(mib["torch_dist async"] - mib["torch_dist"]) < 0.01 * expected
    assert abs(mib["torch"] - 2 * expected) < 0.02 * expected, (mib, expected)
    for cells in rows.values():
        loop, published, load = (float(re.fullmatch(r"([\d.]+) s", c).group(1))
                                 for c in cells[2:5])
        assert 0 < loop <= published and load > 0, cells
    assert "async / sync (torch_dist)" in result.stdout
