"""`compare-signals` arithmetic on synthetic run directories: the share of the low path's
loss gap a variant recovers, paired by seed."""

import json

import pytest

from megatron_gnmr.experiments.scenario import Scenario
from megatron_gnmr.experiments.signal_comparison import compare, separation_warning, write_markdown


def _write_run(path, tail_loss, valid_loss):
    path.mkdir(parents=True)
    lines = [{"step": s, "train/loss": 6.0 if s <= 90 else tail_loss} for s in range(1, 101)]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    (path / "summary.json").write_text(json.dumps({"final_valid_loss": valid_loss}))


def test_gap_recovered_is_paired_by_seed(tmp_path):
    scenario = Scenario("synthetic", "", [], [], [1, 2], [1], "low",
                        {"low": [], "high": [], "rule": []})
    # seed 1: low 4.10, high 4.00, rule 4.05 -> 0.5; seed 2: low 4.30, high 4.10, rule 4.25
    # -> 0.25 (a different level per seed: only the paired ratio is comparable)
    for seed, (low, high, rule) in {1: (4.10, 4.00, 4.05), 2: (4.30, 4.10, 4.25)}.items():
        for variant, loss in (("low", low), ("high", high), ("rule", rule)):
            _write_run(tmp_path / f"{variant}-seed{seed}", loss, loss + 0.1)
    result = compare(scenario, tmp_path, "low", "high")
    row = result["rows"]["rule"]
    assert row["per_seed_recovered"] == pytest.approx([0.5, 0.25])
    assert row["gap_recovered"][0] == pytest.approx(0.375)
    assert row["valid_gap_recovered"][0] == pytest.approx(0.375)
    assert result["rows"]["high"]["gap_recovered"][0] == pytest.approx(1.0)
    # low is worse than high on both seeds by 0.10 and 0.20: separated, no warning
    assert result["low_minus_high"] == pytest.approx([0.10, 0.20])
    assert separation_warning(result) is None


@pytest.mark.parametrize("differences, warns", [([0.10, 0.20, 0.15], False),
                                                ([0.05, -0.04, 0.03], True),  # noise
                                                ([-0.02, -0.03, -0.01], True)])  # inverted
def test_the_report_warns_when_low_and_high_paths_are_not_separated(tmp_path, differences,
                                                                   warns):
    scenario = Scenario("synthetic", "", [], [], [1, 2, 3], [1], "low",
                        {"low": [], "high": []})
    for seed, difference in enumerate(differences, start=1):
        _write_run(tmp_path / f"high-seed{seed}", 4.0, 4.1)
        _write_run(tmp_path / f"low-seed{seed}", 4.0 + difference, 4.1)
    result = compare(scenario, tmp_path, "low", "high")
    text = write_markdown(result, tmp_path)
    assert ("not measurably worse" in text) == warns
