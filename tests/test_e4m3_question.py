"""The E4M3 question's own quantizer (issue 24): the independent implementation agrees with
the project's bit for bit, its stochastic rounding stays on the grid and is unbiased, its
noise variant has the rounding's error norm; the paired comparison by hand; the harness runs
through the project's extension points (a backend and a kernel), not by patching."""

import pytest
import torch

from megatron_gnmr.experiments.e4m3_question import _quantize_independently, paired
from megatron_gnmr.precision.scaling import QuantSpec, quantize


def _heavy_tailed(rows=256, cols=384, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, cols, generator=generator) * torch.exp(
        2 * torch.randn(rows, 1, generator=generator))


@pytest.mark.parametrize("fmt", ["e4m3", "e3m2", "e2m3"])
@pytest.mark.parametrize("granularity", ["tile", "block"])
@pytest.mark.parametrize("pow2", [True, False])
def test_independent_quantizer_equals_the_project_s(fmt, granularity, pow2):
    x = _heavy_tailed()
    spec = QuantSpec(fmt, granularity, pow2)
    independent = _quantize_independently(x, spec)
    project = quantize(x, spec)
    if pow2:  # power-of-two scales: scaling and unscaling are exact, so every bit agrees
        assert torch.equal(independent, project)
    else:  # q / s here, q * float32(1 / s) there: at most two float32 roundings apart
        torch.testing.assert_close(independent, project, rtol=2 ** -22, atol=0)


def test_stochastic_rounding_is_on_the_grid_and_unbiased():
    x = _heavy_tailed(128, 128)
    spec = QuantSpec("e4m3", "tile", True)
    generator = torch.Generator().manual_seed(1)
    draws = torch.stack([_quantize_independently(x, spec, "stochastic", generator)
                         for _ in range(400)])
    for draw in draws[:3]:  # each draw lies on the format's grid: nearest rounding keeps it
        assert torch.equal(_quantize_independently(draw, spec), draw)
    nearest = _quantize_independently(x, spec)
    # the mean of 400 draws is closer to x than round-to-nearest is, by far
    assert (draws.mean(0) - x).norm() < 0.2 * (nearest - x).norm()


def test_noise_variant_has_the_rounding_error_norm():
    x = _heavy_tailed()
    spec = QuantSpec("e4m3", "tile", True)
    noisy = _quantize_independently(x, spec, "noise", torch.Generator().manual_seed(2))
    rounding_error = (_quantize_independently(x, spec) - x).norm()
    assert float((noisy - x).norm()) == pytest.approx(float(rounding_error), rel=1e-5)
    assert not torch.equal(noisy, _quantize_independently(x, spec))


def test_paired_comparison_by_hand():
    rows = {"a": {"gaps": {3: 0.05, 4: 0.01, 5: 0.03}},
            "b": {"gaps": {3: 0.01, 4: 0.02, 5: 0.00, 6: 0.9}}}  # seed 6 is not shared
    c = paired(rows, "a", "b")
    assert c["seeds"] == [3, 4, 5]
    assert c["diffs"] == pytest.approx([0.04, -0.01, 0.03])
    assert c["mean"] == pytest.approx(0.02) and c["a_worse"] == 2
    assert c["std"] == pytest.approx(0.0264575, rel=1e-5)
    assert -0.01 <= c["interval"][0] <= c["mean"] <= c["interval"][1] <= 0.04


def test_the_harness_runs_through_the_extension_points(tmp_path):
    """Each variant is a registered backend (and kernel) selected by flags, not a patch: the
    independent kernel trains step for step as the project's emulated path (the same
    numbers, computed apart), and a unit subset keeps every other unit exact through a
    precision config file."""
    import os
    import subprocess
    import sys

    from tests.helpers import REPO, train_losses

    def run(variant):
        out = tmp_path / variant
        subprocess.run([sys.executable, "-m", "megatron_gnmr.experiments.e4m3_question",
                        "--run", variant, "--seed", "3", "--out", str(out), "--smoke"],
                       cwd=REPO, check=True, capture_output=True,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
        return out

    project, independent = run("e4m3-fwd"), run("e4m3-fwd-independent")
    losses, again = train_losses(project), train_losses(independent)
    assert sorted(losses) == list(range(1, 21))
    assert [again[s] for s in losses] == pytest.approx([losses[s] for s in losses], rel=1e-6)
    kept = (run("e4m3-fwd-qkv") / "kept_exact.yaml").read_text()
    assert "linear_qkv" not in kept.split("matchers:")[1]
    for name in ("linear_proj", "linear_fc1", "linear_fc2"):
        assert f"decoder.layers.1.{'self_attention' if name == 'linear_proj' else 'mlp'}." \
               f"{name}" in kept
